"""Gemma 4 specifics beyond the family runs (test_worker_greedy, test_families_engine, test_worker_tp): the KV
cache of two head shapes with KV-shared layers owning no rows, what model_info says of such a model, proportional
rope against transformers', and every config the model cannot run refused up front, naming the field."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import GEMMA4_ROPE, tiny_config
from helpers.worker_setup import local_driver
from pagedray.workers.layers.rotary import RotaryEmbedding
from pagedray.workers.models.gemma4 import Gemma4ForCausalLM
from pagedray.workers.models.model_info import model_info

SLIDING, FULL = (2, 32), (1, 64)   # (KV heads, head_dim) of the tiny gemma4's sliding and full layers


def test_kv_cache_rows_belong_to_the_layers_that_compute_kv(tiny_model_path):
    """6 layers, the last 3 KV-shared: 3 cache rows (two sliding, one full) in two tensors, the shared layers reading
    their sources' rows; a block costs exactly those rows; the one-call CPU decode is not taken."""
    path = tiny_model_path("gemma4")
    worker, _ = local_driver(path)
    model, kv = worker.model, worker.runner.kv_cache
    assert model.kv_slots == [0, 1, 2, 1, 1, 2]       # layers 3, 4 read layer 1 (sliding), 5 reads layer 2 (full)
    assert worker.kv_spec.layer_shapes == (SLIDING, SLIDING, FULL)
    assert worker.kv_spec.bytes_per_block == 2 * 8 * 4 * (2 * 32 + 2 * 32 + 64)
    assert [tuple(t.shape) for t in kv.tensors] == [(2, 2, 64, 8, 2, 32), (1, 2, 64, 8, 1, 64)]
    assert model.cpu_decode is None and model.graph_safe and model.lora is None
    info = model_info(path)
    assert info.kv_layer_shapes == (SLIDING, SLIDING, FULL)
    assert (info.num_key_value_heads, info.head_dim) == SLIDING
    info.check_tensor_parallel_size(2)                # the single full KV head is replicated
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        info.check_tensor_parallel_size(3)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_proportional_rope_equals_transformers(factor):
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**GEMMA4_ROPE, "full_attention": {**GEMMA4_ROPE["full_attention"], "partial_rotary_factor": factor}}
    config = Gemma4TextConfig(hidden_size=64, num_attention_heads=4, head_dim=32, global_head_dim=64,
                              num_hidden_layers=2, rope_parameters=rope)
    want, scale = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    got = RotaryEmbedding(64, rope["full_attention"], torch.device("cpu")).inv_freq
    assert torch.equal(got, want) and scale == 1.0
    assert int((got == 0).sum()) == 32 - int(factor * 32)      # the pairs past the factor do not rotate


def _gemma4(**changes):
    config = tiny_config("gemma4")
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def _moe(**changes):
    config = tiny_config("gemma4-moe")
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def _with_per_layer(overrides):
    config = tiny_config("gemma4")
    config.per_layer_config = overrides
    return config


def _built(**kwargs):
    from transformers import Gemma4TextConfig

    base = tiny_config("gemma4").to_dict()
    for name in ("per_layer_config", "model_type", "transformers_version"):
        base.pop(name, None)
    return Gemma4TextConfig(**{**base, "global_head_dim": 64, "num_global_key_value_heads": 1, **kwargs})


@pytest.mark.parametrize("config, tp, field", [
    (lambda: _gemma4(hidden_activation="gelu"), 1, "hidden_activation"),
    (lambda: _gemma4(use_bidirectional_attention="all"), 1, "use_bidirectional_attention"),
    (lambda: _built(global_head_dim=1024), 1, "global_head_dim"),
    (lambda: _built(head_dim=20), 1, "head_dim 20"),
    (lambda: _gemma4(num_kv_shared_layers=6), 1, "num_kv_shared_layers"),
    (lambda: _gemma4(layer_types=["sliding_attention"] * 5 + ["full_attention"], num_kv_shared_layers=1), 1,
     "num_kv_shared_layers=1 leaves no earlier"),
    (lambda: _gemma4(layer_types=["sliding_attention", "chunked_attention"] * 3), 1, "layer_types"),
    (lambda: _gemma4(rope_parameters={**GEMMA4_ROPE, "full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                                          "rope_theta": 1e6}}), 1, "rope_parameters"),
    (lambda: _gemma4(vocab_size_per_layer_input=100), 1, "vocab_size_per_layer_input"),
    (lambda: _gemma4(final_logit_softcapping=-1.0), 1, "final_logit_softcapping"),
    (lambda: _gemma4(enable_moe_block=True, num_experts=4, top_k_experts=None, moe_intermediate_size=32), 1,
     "enable_moe_block"),
    (lambda: _with_per_layer({0: {"intermediate_size": 48}}), 1, "per_layer_config"),
    (lambda: _built(num_global_key_value_heads=3), 1, "num_attention_heads=4 is not a multiple"),
    (lambda: tiny_config("gemma4"), 3, "tensor_parallel_size=3"),
    (lambda: tiny_config("gemma4"), 8, "tensor_parallel_size=8"),
    (lambda: _moe(moe_intermediate_size=30), 4, "tensor_parallel_size=4 must divide moe_intermediate_size=30"),
    (lambda: _moe(intermediate_size=90), 4, "tensor_parallel_size=4 must divide intermediate_size"),
])
def test_configs_it_cannot_run_are_refused_naming_the_field(config, tp, field):
    with pytest.raises(ValueError, match=field):
        Gemma4ForCausalLM.validate_config(config(), 512, tp)


def test_the_tiny_configs_are_accepted_at_tp_2():
    for kind in ("gemma4", "gemma4-moe"):
        Gemma4ForCausalLM.validate_config(tiny_config(kind), 512, 2)


def test_an_8bit_cache_is_refused_for_two_head_shapes(tiny_model_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        local_driver(tiny_model_path("gemma4"), kv_cache_dtype="int8")


def test_the_cuda_kernels_give_transformers_tokens_under_the_interpreter(tiny_model_path, monkeypatch):
    """Every kernel the model calls (norms, store_kv, paged decode / prefill, the KV-shared layers' reads) takes its
    Triton path, as on CUDA, run by the interpreter: still transformers' tokens past the sliding window."""
    from helpers.hf_oracle import hf_greedy_each
    from pagedray.kernels import api, fused_ops

    path, prompts = tiny_model_path("gemma4"), [list(range(3, 15))]
    want = hf_greedy_each(path, prompts, 6)
    triton = lambda use_triton, device: True if use_triton is None else bool(use_triton)   # noqa: E731
    monkeypatch.setattr(api, "_triton_wanted", triton)
    monkeypatch.setattr(fused_ops, "_triton_wanted", triton)
    calls = {}
    for name in ("store_kv_triton", "paged_decode_triton", "paged_prefill_triton"):
        kernel = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _k=kernel, _n=name, **kw: calls.update({_n: 1}) or _k(*a, **kw))
    _, driver = local_driver(path, token_budget=8, max_chunk=8, cpu_packed_weights=False)
    assert driver.generate(prompts, 6) == want
    assert len(calls) == 3                                     # the Triton kernels ran, not the references
    assert any(len(plan.new_seqs) and plan.new_seqs[0].num_scheduled_tokens < 12 for plan in driver.plans)
