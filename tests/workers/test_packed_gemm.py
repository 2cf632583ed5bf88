"""Packed CPU weights (``layers/packed_gemm.py``): every product agrees with ``F.linear`` on random inputs
at every row count (oneDNN's bit for bit in bf16), a plan runs each row bucket on its own product, every
linear layer and the LM head get their packed copies in fp32 and bf16 (tests/kernels/test_cpu_gemm.py
checks the C GEMM's products), and greedy tokens of a batch that takes the packed path still equal
transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_oracle import hf_greedy_each
from helpers.worker_setup import engine_config
from pagedray.cluster import LLM, SamplingParams
from pagedray.kernels.cpu import cpu_choice, cpu_gemm
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS
from pagedray.workers.contract.config import ModelConfig
from pagedray.workers.layers import packed_gemm
from pagedray.workers.layers.embedding import ParallelLMHead
from pagedray.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedray.workers.layers.packed_gemm import linear, pack_weight, packed_gemm_available
from pagedray.workers.models import cpu_decode_layers
from pagedray.workers.worker import Worker

needs_onednn = pytest.mark.skipif(not packed_gemm_available(torch.float32), reason="torch has no oneDNN packed GEMM")
needs_onednn_bf16 = pytest.mark.skipif(not packed_gemm_available(torch.bfloat16),
                                       reason="oneDNN has no bf16 GEMM on this CPU")


@needs_onednn
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (251, 64), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packing", ["c", "onednn", "mkl"])
def test_packed_product_agrees_with_f_linear(out_features, in_features, with_bias, packing, torch_threads):
    if packing == "c" and not cpu_gemm.available(torch.float32):
        pytest.skip("this CPU or compiler has neither AVX-512 nor AVX2 for kernels.cpu_gemm")
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05      # [out, in]
    bias = torch.randn(out_features, generator=gen) if with_bias else None    # [out]
    packed = pack_weight(weight, packing)
    assert (packed.tile is not None) == (packing == "c") and (packed.onednn is not None) == (packing == "onednn")
    for rows in (1, 3, 16, 17, 64, 300):
        x = torch.randn(rows, in_features, generator=gen)                       # [rows, in]
        torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    x = torch.randn(16, 2 * in_features, generator=gen)[:, ::2]                 # non-contiguous
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    x = torch.randn(2, 5, in_features, generator=gen)                           # [batch, tokens, in]
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    assert linear(x, weight, bias, None).equal(F.linear(x, weight, bias))      # no packed copy: F.linear


@needs_onednn_bf16
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_product_equals_f_linear(with_bias, torch_threads):
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()          # [out, in]
    bias = torch.randn(960, generator=gen).bfloat16() if with_bias else None
    packed = pack_weight(weight, "onednn")
    for rows in (1, 16, 300):
        x = torch.randn(rows, 576, generator=gen).bfloat16()                   # [rows, in]
        out = linear(x, weight, bias, packed)
        assert out.dtype == torch.bfloat16 and out.equal(F.linear(x, weight, bias))


def test_pack_weight_names_a_bad_weight_or_plan():
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.randn(4, 4, dtype=torch.float64), "mkl")
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.randn(4, 4, dtype=torch.float16), "onednn")
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.randn(16), "mkl")
    with pytest.raises(ValueError, match="^plan"):
        pack_weight(torch.randn(4, 4).bfloat16(), "mkl")          # F.linear is a float32 product here
    with pytest.raises(ValueError, match="^plan"):
        pack_weight(torch.randn(4, 4), ("mkl",) * (len(ROW_BUCKETS) - 1))
    with pytest.raises(ValueError, match="^plan"):
        pack_weight(torch.randn(4, 4), "cublas")


@needs_onednn
def test_a_plan_runs_each_row_bucket_on_its_own_product(monkeypatch):
    """One weight, a plan that alternates products by bucket: each call goes to its bucket's product."""
    usable = packed_gemm.candidates(torch.randn(8, 8))
    plan = tuple(usable[i % len(usable)] for i in range(len(ROW_BUCKETS)))
    weight = torch.randn(40, 24)                                              # [out, in]
    packed = pack_weight(weight, plan)
    ran = []
    monkeypatch.setattr(packed_gemm.cpu_gemm, "linear", lambda x, p, b=None: ran.append("c") or x @ torch.zeros(24, 40))
    monkeypatch.setattr(packed_gemm.F, "linear", lambda x, w, b=None: ran.append("mkl") or x @ w.T)
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: ran.append("onednn") or onednn(*a),
                        raising=False)
    for rows in ROW_BUCKETS:
        assert packed_gemm.linear(torch.randn(rows, 24), weight, None, packed).shape == (rows, 40)
    assert ran == list(plan)
    ran.clear()
    packed_gemm.linear(torch.randn(3, 2, 24), weight, None, packed)    # 6 rows: the 4-row bucket
    assert ran == [plan[1]]


def _packable(worker: Worker) -> list[torch.nn.Module]:
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return [m for m in worker.model.modules() if isinstance(m, kinds)]


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qwen2"])   # untied LM head; tied LM head + qkv bias
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_worker_packs_every_linear_layer_and_the_lm_head(kind, dtype, tiny_model_path):
    if not packed_gemm_available(getattr(torch, dtype)):
        pytest.skip(f"oneDNN has no {dtype} GEMM on this CPU")
    worker = Worker(engine_config(tiny_model_path(kind), dtype=dtype))
    layers = _packable(worker)
    assert len(layers) == 2 * 4 + 1   # 2 layers x (qkv, o, gate_up, down) + LM head
    assert all(m.packed_weight is not None for m in layers)
    report = worker.pack_report
    assert report.matrices == len(layers)
    assert report.weight_bytes == sum(m.weight.numel() * m.weight.element_size() for m in layers)
    # a weight has a packed copy for every packed product its plan names (MKL, which a timed fp32 plan may pick,
    # reads the plain weight), and a decoder layer's weight keeps its tile-packed copy where the one-call decode
    # path runs (it reads that copy whatever the plan)
    assert report.packed_bytes == sum(m.packed_weight.packed_bytes for m in layers)
    one_call = {id(m) for m in cpu_decode_layers.decoder_linears(worker.model)} if worker.model.cpu_decode else set()
    for m in layers:
        own = m.weight.numel() * m.weight.element_size()
        runs_tile = bool(set(m.packed_weight.plan) & set(packed_gemm.TILE_PRODUCTS)) or id(m) in one_call
        assert (m.packed_weight.tile is not None) == runs_tile
        assert (m.packed_weight.packed_bytes >= own) == (set(m.packed_weight.plan) != {"mkl"} or runs_tile)
    assert report.table.source.startswith("forced") == (cpu_choice.forced_product("auto") is not None)
    for m in layers:
        plan = m.packed_weight.plan
        assert plan == report.table.plan(m) and len(plan) == len(ROW_BUCKETS)
        assert ("c" in plan) <= (m.packed_weight.tile is not None)
        assert ("onednn" in plan) == (m.packed_weight.onednn is not None)
        copies = [c for c in (m.packed_weight.onednn, getattr(m.packed_weight.tile, "data", None)) if c is not None]
        assert all(c.dtype == getattr(torch, dtype) for c in copies)


def test_packing_off_by_option_without_onednn_or_in_fp16(tiny_model_path, monkeypatch):
    worker = Worker(engine_config(tiny_model_path("llama"), cpu_packed_weights=False))
    assert worker.pack_report is None and all(m.packed_weight is None for m in _packable(worker))
    worker = Worker(engine_config(tiny_model_path("llama"), dtype="float16"))
    assert worker.pack_report is None and all(m.packed_weight is None for m in _packable(worker))
    monkeypatch.setattr("pagedray.workers.models.model_loading.packed_gemm_available", lambda dtype: False)
    worker = Worker(engine_config(tiny_model_path("llama")))
    assert worker.pack_report is None and all(m.packed_weight is None for m in _packable(worker))
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        ModelConfig(cpu_packed_weights="yes").validate()


def test_packed_gemm_available_needs_onednn_and_a_packable_dtype(monkeypatch):
    assert packed_gemm_available(torch.float16) is False and packed_gemm_available(torch.float64) is False
    monkeypatch.setattr(packed_gemm.torch.backends.mkldnn, "is_available", lambda: False)
    assert packed_gemm_available(torch.float32) is False


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_batch_of_twelve_matches_transformers(kind, tiny_model_path):
    """12 sequences decode together and prefill in chunks of at most 16 tokens, every product on the
    packed weights; tokens equal transformers' one-prompt-at-a-time generate."""
    path = tiny_model_path(kind)
    prompts = [[(7 * i + j) % 240 + 3 for j in range(5 + i)] for i in range(12)]
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=128, threads_per_worker=1, max_num_seqs=32,
              max_num_batched_tokens=16)
    try:
        assert llm.engine.executor.worker.pack_report is not None
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in results] == hf_greedy_each(path, prompts, 16)
