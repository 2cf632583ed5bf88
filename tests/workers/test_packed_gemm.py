"""MKL-packed CPU weights (``layers/packed_gemm.py``): the packed product agrees with ``F.linear`` on
random inputs, products outside ``PACKED_ROWS`` run ``F.linear`` itself, every linear layer and the LM
head get a packed copy, and greedy tokens of a batch that takes the packed path still equal
transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_config, hf_greedy
from pagedray.cluster import LLM, SamplingParams
from pagedray.workers.contract.config import ModelConfig
from pagedray.workers.layers import packed_gemm
from pagedray.workers.layers.embedding import ParallelLMHead
from pagedray.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedray.workers.layers.packed_gemm import PACKED_ROWS, linear, pack_weight, packed_gemm_available
from pagedray.workers.worker import Worker

needs_mkl = pytest.mark.skipif(not packed_gemm_available(), reason="this torch has no MKL packed GEMM")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_mkl
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (251, 64), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_agrees_with_f_linear(out_features, in_features, with_bias, torch_threads):
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05      # [out, in]
    bias = torch.randn(out_features, generator=gen) if with_bias else None    # [out]
    packed = pack_weight(weight)
    for rows in (PACKED_ROWS[0], 9, PACKED_ROWS[-1]):
        x = torch.randn(rows, in_features, generator=gen)                       # [rows, in]
        torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    for rows in (1, PACKED_ROWS[0] - 1, PACKED_ROWS[-1] + 1, 64, 300):   # outside: F.linear itself, bit for bit
        x = torch.randn(rows, in_features, generator=gen)
        assert torch.equal(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    x = torch.randn(PACKED_ROWS[-1], 2 * in_features, generator=gen)[:, ::2]   # non-contiguous
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))


def test_pack_weight_names_a_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.randn(16))


def _packable(worker: Worker) -> list[torch.nn.Module]:
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return [m for m in worker.model.modules() if isinstance(m, kinds)]


@needs_mkl
@pytest.mark.parametrize("kind", ["llama", "qwen2"])   # untied LM head; tied LM head + qkv bias
def test_worker_packs_every_linear_layer_and_the_lm_head(kind, tiny_model_path):
    worker = Worker(engine_config(tiny_model_path(kind)))
    layers = _packable(worker)
    assert len(layers) == 2 * 4 + 1   # 2 layers x (qkv, o, gate_up, down) + LM head
    assert all(m.packed_weight is not None for m in layers)
    report = worker.pack_report
    assert report.matrices == len(layers)
    assert report.weight_bytes == sum(m.weight.numel() * 4 for m in layers)
    assert report.packed_bytes >= report.weight_bytes


def test_packing_off_by_option_or_without_mkl(tiny_model_path, monkeypatch):
    worker = Worker(engine_config(tiny_model_path("llama"), cpu_packed_weights=False))
    assert worker.pack_report is None and all(m.packed_weight is None for m in _packable(worker))
    monkeypatch.setattr("pagedray.workers.worker.packed_gemm_available", lambda: False)
    worker = Worker(engine_config(tiny_model_path("llama")))
    assert worker.pack_report is None and all(m.packed_weight is None for m in _packable(worker))
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        ModelConfig(cpu_packed_weights="yes").validate()


def test_packed_gemm_available_needs_the_mkl_ops(monkeypatch):
    monkeypatch.setattr(packed_gemm.torch.backends.mkl, "is_available", lambda: False)
    assert packed_gemm_available() is False


@needs_mkl
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_batch_of_twelve_matches_transformers(kind, tiny_model_path):
    """12 sequences decode together and prefill in chunks of at most 16 tokens, so the products of
    most steps take the packed path; tokens equal transformers' one-prompt-at-a-time generate."""
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
    assert [r.outputs[0].token_ids for r in results] == hf_greedy(path, prompts, 16)
