"""benchmarks.serving_baselines: the arithmetic floor's grouping and scaling, and that the floor runs the
forwards its docstring describes (on a tiny random model; no timing is asserted)."""

import pytest

from benchmarks.serving_baselines import floor_seconds, prefill_groups, scale_decode


def test_prefill_groups_sort_by_length_and_keep_the_padded_size_within_the_budget():
    lengths = [50, 10, 30, 10, 60, 300]
    groups = prefill_groups(lengths, 100)
    assert groups == [[1, 3, 2], [0], [4], [5]]   # 10, 10, 30 (3 x 30 = 90); 50 + 60 would pad to 120
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 100
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert prefill_groups([16] * 8, 64) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefill_groups([1], 0)


def test_scale_decode_extrapolates_the_wave_to_the_workloads_tokens():
    assert scale_decode(2.0, batch=16, steps=63, decode_tokens=2016) == pytest.approx(4.0)
    assert scale_decode(1.5, batch=4, steps=10, decode_tokens=20) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="batch, steps"):
        scale_decode(1.0, batch=0, steps=3, decode_tokens=3)


class Recorder:
    """Wraps a model; records each forward's batch, new tokens, cache length and logits_to_keep."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, input_ids, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cached = 0 if cache is None else cache.get_seq_length()
        self.calls.append((tuple(input_ids.shape), cached, kwargs.get("logits_to_keep", 0)))
        return self.model(input_ids=input_ids, **kwargs)

    @property
    def forward(self):                 # what the floor reads the cache keyword's name from
        return self.model.forward


def test_floor_runs_the_prefill_groups_and_a_decode_wave_with_a_growing_cache():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = Recorder(LlamaForCausalLM(config).eval())
    prompts = [[3] * 5, [4] * 7, [5] * 9, [6] * 11]          # mean length 8
    max_tokens = [4, 4, 6, 6]                                # mean 5: 4 decode steps per wave
    threads = torch.get_num_threads()
    out = floor_seconds(model, prompts, max_tokens, batch=3, threads=1, chunk_tokens=20)
    assert torch.get_num_threads() == threads                # restored
    prefill = [c for c in model.calls if c[2] == 1 and c[1] == 0]
    # groups by padded size <= 20: [5, 7] (2 x 7), [9, 11] (2 x 11 = 22 > 20 -> [9], [11]); warm-up first
    assert [c[0] for c in prefill] == [(2, 7), (2, 7), (1, 9), (1, 11), (3, 8)]
    decode = [c for c in model.calls if c[1] > 0]
    assert [c[0] for c in decode] == [(3, 1)] * 4 and [c[1] for c in decode] == [8, 9, 10, 11]
    assert (out["batch"], out["decode_steps"], out["output_tokens"], out["prompt_tokens"]) == (3, 4, 20, 32)
    assert out["decode_s"] == pytest.approx(out["decode_wave_s"] * (20 - 4) / (3 * 4))
    assert out["duration_s"] == pytest.approx(out["prefill_s"] + out["decode_s"]) and out["prefill_s"] > 0
    assert out["output_tok_per_s"] == pytest.approx(20 / out["duration_s"])
    model.calls.clear()
    assert floor_seconds(model, prompts, max_tokens, batch=99, threads=1, chunk_tokens=20)["batch"] == 4
