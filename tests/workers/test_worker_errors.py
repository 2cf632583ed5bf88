"""Bad input is rejected with a ValueError that names what to change, before any state changes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_models import save_tiny_model
from helpers.worker_setup import engine_config
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import NewSequence, RunningDelta, StepPlan
from pagedray.workers.models.model_info import model_info
from pagedray.workers.weights.weight_loader import WeightLoadError
from pagedray.workers.worker import Worker
from safetensors.torch import load_file, save_file

GREEDY = SamplingParams(temperature=0.0)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    for build in (lambda: model_info(tmp_path), lambda: Worker(engine_config(str(tmp_path)))):
        with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported architectures: LlamaForCausalLM") as err:
            build()
        assert "Qwen2ForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def test_missing_weight_files(tmp_path):
    path = save_tiny_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors weight files"):
        Worker(engine_config(path))


def test_missing_shard_of_an_index(tmp_path):
    path = save_tiny_model("llama", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(WeightLoadError, match=shard):
        Worker(engine_config(path))


def test_missing_tensor(tmp_path):
    path = save_tiny_model("qwen2", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="model.layers.1.mlp.down_proj.weight"):
        Worker(engine_config(path))


def test_a_layer_whose_load_skips_its_weight_fails_the_load(tiny_model_path, monkeypatch):
    """Linear weights are meta tensors until loaded, and F.linear would compute garbage from one: a load that
    leaves any parameter unloaded fails, naming it."""
    from pagedray.workers.layers.linear import RowParallelLinear

    monkeypatch.setattr(RowParallelLinear, "load", lambda self, reader, prefix: None)
    with pytest.raises(RuntimeError, match="parameters left unloaded: .*o_proj.weight"):
        Worker(engine_config(tiny_model_path("llama")))


def test_tensor_parallel_size_that_does_not_fit_the_heads(tiny_model_path):
    path = tiny_model_path("llama")          # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        Worker(engine_config(path, tp=3), rank=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 must divide num_attention_heads=4"):
        model_info(path).check_tensor_parallel_size(8)
    model_info(path).check_tensor_parallel_size(4)   # 4 ranks: KV heads replicated twice, accepted


def test_plans_that_contradict_the_mirror(tiny_model_path):
    worker = Worker(engine_config(tiny_model_path("llama"), num_blocks=8))
    worker.init_kv_cache(8)
    worker.execute(StepPlan(0, new_seqs=[NewSequence(0, [5, 6, 7], [], 0, 3, [0], GREEDY)]))
    bad_plans = {
        "running: seq 9": StepPlan(1, running=[RunningDelta(9, 1, [], 4)]),
        "new_seqs: seq 0": StepPlan(1, new_seqs=[NewSequence(0, [5], [], 0, 1, [1], GREEDY)]),
        "num_scheduled_tokens: seq 0": StepPlan(1, running=[RunningDelta(0, 2, [], 4)]),
        "block_ids: seq 1": StepPlan(1, new_seqs=[NewSequence(1, list(range(9)), [], 0, 9, [1], GREEDY)]),
        "block_copies": StepPlan(1, released_seq_ids=[0], block_copies=[(0, 8)]),
        "block_ids: seq 2 has a block id outside": StepPlan(1, new_seqs=[NewSequence(2, [5], [], 0, 1, [8], GREEDY)]),
        "block_ids: seq 0 has a block id outside": StepPlan(1, running=[RunningDelta(0, 1, [-1], 4)]),
    }
    kv_before = worker.runner.kv_cache.data.clone()
    for message, plan in bad_plans.items():
        with pytest.raises(ValueError, match=message):
            worker.execute(plan)
        assert worker.num_sequences() == 1 and worker.runner.mirror.state(0).num_tokens == 3
    assert torch.equal(worker.runner.kv_cache.data, kv_before)
    result = worker.execute(StepPlan(1, running=[RunningDelta(0, 1, [], 4)]))   # the mirror still works
    assert [s.seq_id for s in result.sampled] == [0]


def test_qwen_layer_types_outside_full_and_sliding_are_rejected_before_loading(tmp_path):
    from helpers.tiny_models import tiny_config

    config = tiny_config("qwen2-window")
    config.layer_types = ["full_attention", "chunked_attention"]
    config.save_pretrained(str(tmp_path))   # no weights: the check comes first
    with pytest.raises(ValueError, match="layer_types \\['chunked_attention'\\] are not supported"):
        Worker(engine_config(str(tmp_path), num_blocks=64, max_model_len=64))


def test_phi3_partial_rotary_is_rejected_before_loading(tmp_path):
    from helpers.tiny_models import tiny_config

    config = tiny_config("phi3")
    config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.75}
    config.save_pretrained(str(tmp_path))   # no weights: the check comes first
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        Worker(engine_config(str(tmp_path), num_blocks=64, max_model_len=64))


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping is not supported on this architecture"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping is not supported on this architecture"),
    ("hidden_activation", "gelu", "hidden_activation 'gelu' is not supported"),
])
def test_gemma3_settings_without_a_path_are_rejected_before_loading(tmp_path, field, value, message):
    from helpers.tiny_models import tiny_config

    config = tiny_config("gemma3")
    setattr(config, field, value)
    config.save_pretrained(str(tmp_path))   # no weights: the check comes first
    with pytest.raises(ValueError, match=message):
        Worker(engine_config(str(tmp_path), num_blocks=64, max_model_len=64))


def test_a_routing_that_picks_more_experts_than_exist_is_rejected_before_loading(tmp_path):
    from helpers.tiny_models import tiny_config

    config = tiny_config("mixtral")
    config.num_experts_per_tok = 5
    config.save_pretrained(str(tmp_path))   # no weights: the check comes first
    with pytest.raises(ValueError, match="num_experts_per_tok 5 of 4 experts is not a valid routing"):
        Worker(engine_config(str(tmp_path), num_blocks=64, max_model_len=64))
