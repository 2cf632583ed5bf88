"""The one-call CPU decode path (``workers/models/cpu_decode_layers.py`` over ``kernels/cpu/cpu_layers.c``):
every step's logits bit for bit those of the layer-by-layer path (``enforce_eager``), on the families
that take it, with prefill chunks, mixed steps and pure decode steps, also over an int8 KV cache; the
families and caches that do not take it fall back."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.worker_setup import local_driver
from pagedray.kernels.cpu import cpu_amx, cpu_layers
from pagedray.workers.models import cpu_decode_layers

needs_layers = pytest.mark.skipif(not cpu_layers.available(torch.float32),
                                  reason="the CPU C kernels are not built here (no compiler, no AVX-512 or AVX2)")
PROMPT_LENGTHS = (5, 17, 30, 9)


def _run(path: str, enforce_eager: bool, dtype: str, threads: int = 1, **kwargs):
    """(tokens per prompt, logits of every step, one-call runs, the worker) for a fixed set of prompts. Both
    paths run the C GEMM unless ``cpu_gemm`` says otherwise: a timed plan may give a bucket to oneDNN, which
    the layer loop would run and the one call, winning that bucket's timing, would not (other bits)."""
    kwargs.setdefault("cpu_gemm", "c")
    worker, driver = local_driver(path, token_budget=24, max_chunk=16, dtype=dtype, enforce_eager=enforce_eager,
                                  **kwargs)
    logits, calls = [], []
    run = worker.runner.run

    def recording_run(step):
        output = run(step)
        logits.append(None if output.logits is None else output.logits.clone())
        return output
    worker.runner.run = recording_run
    one_call = worker.model.cpu_decode
    if one_call is not None:
        inner = one_call.forward_layers

        def counting_run(*args):
            calls.append(args[0].shape[0])
            return inner(*args)
        one_call.forward_layers = counting_run
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)     # what each C call is handed (the worker's own setting is 1)
    try:
        tokens = driver.generate(prompts, 12)
    finally:
        torch.set_num_threads(before)
    return tokens, logits, calls, worker


@needs_layers
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-window", "mistral-window", "phi3", "phi3-longrope"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_decode_equals_the_layer_by_layer_path_bit_for_bit(kind, dtype, tiny_model_path):
    if dtype == "bfloat16" and not cpu_layers.available(torch.bfloat16):
        pytest.skip("no AVX512-BF16 here: the bf16 GEMM is oneDNN's")
    path = tiny_model_path(kind)
    eager_tokens, eager_logits, eager_calls, eager = _run(path, True, dtype)
    tokens, logits, calls, worker = _run(path, False, dtype)
    assert eager.model.cpu_decode is None and eager_calls == []
    assert worker.model.cpu_decode is not None
    assert tokens == eager_tokens
    assert len(logits) == len(eager_logits)
    for step, (got, want) in enumerate(zip(logits, eager_logits)):
        assert (got is None) == (want is None), step
        assert got is None or torch.equal(got, want), f"step {step}: max diff {(got - want).abs().max()}"
    # pure decode steps of 4, 3, 2 and 1 sequences ran through the one call; prefill and mixed steps did not
    assert len(calls) >= 12 and max(calls) == len(PROMPT_LENGTHS) and min(calls) == 1


@needs_layers
def test_one_call_decode_with_two_threads(tiny_model_path):
    path = tiny_model_path("llama")
    eager_tokens, eager_logits, _, _ = _run(path, True, "float32", threads=2)
    tokens, logits, calls, _ = _run(path, False, "float32", threads=2)
    assert tokens == eager_tokens and calls
    assert all(g is None and w is None or torch.equal(g, w) for g, w in zip(logits, eager_logits))


@needs_layers
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "qwen3-moe"])
def test_families_outside_the_path_keep_the_layer_loop(kind, tiny_model_path):
    """q/k norm, Gemma's own forward, experts: no one-call path."""
    worker, _ = local_driver(tiny_model_path(kind), dtype="float32")
    assert worker.model.cpu_decode is None


@needs_layers
@pytest.mark.parametrize("kv_cache_dtype, scaled", [("int8", False), ("fp8_e4m3", False), ("fp8_e4m3", True)],
                         ids=["int8", "fp8", "fp8-checkpoint-scales"])
def test_an_8bit_cache_takes_the_one_call(kv_cache_dtype, scaled, tiny_model_path, tmp_path):
    """8-bit rows are quantized by the decode kernel as it stores them, on both paths alike (a float8 cache
    with the checkpoint's per-layer scales where it has them): every step's logits bit for bit equal."""
    path = tiny_model_path("llama")
    if scaled:
        from pagedray.kernels.kv_quant import static_scale
        from test_checkpoint_kv_scales import _with_scales

        scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.03 * (i + 1)) for i in range(2)
                  for kv in ("k", "v")}
        path = _with_scales(path, tmp_path / "model", scales)
    eager_tokens, eager_logits, _, _ = _run(path, True, "float32", kv_cache_dtype=kv_cache_dtype)
    tokens, logits, calls, worker = _run(path, False, "float32", kv_cache_dtype=kv_cache_dtype)
    assert tokens == eager_tokens and len(calls) >= 12
    assert all(g is None and w is None or torch.equal(g, w) for g, w in zip(logits, eager_logits))
    if scaled:
        written = worker.runner.kv_cache.scales[0, 0].flatten()
        assert written.gt(0).sum() > 50 and (written[written > 0].float() == static_scale(0.03)).all()


def test_the_one_call_runs_the_tile_product_most_plans_run():
    pick = cpu_decode_layers.one_call_product
    assert pick(["c"] * 4, amx_takes_all=True) == "c"
    assert pick(["amx", "amx", "c", "onednn"], amx_takes_all=True) == "amx"
    assert pick(["amx", "c"], amx_takes_all=True) == "c"                  # a tie: the C GEMM first
    assert pick(["onednn"] * 4, amx_takes_all=True) == "amx"              # no tile plan: AMX where it runs all
    assert pick(["onednn"] * 4, amx_takes_all=False) == "c"
    assert pick(["amx", "amx", "c"], amx_takes_all=False) == "c"          # never AMX where some weight cannot


@pytest.mark.skipif(not cpu_amx.available(), reason="this CPU, its kernel or the compiler has no AMX-BF16")
def test_the_one_call_runs_the_amx_product_bit_for_bit_as_the_layer_loop(tiny_model_path):
    path = tiny_model_path("llama")
    eager_tokens, eager_logits, _, _ = _run(path, True, "bfloat16", cpu_gemm="amx")
    tokens, logits, calls, worker = _run(path, False, "bfloat16", cpu_gemm="amx")
    path_ = worker.model.cpu_decode
    assert set(path_.products.values()) == {"amx"} and path_.buckets == set(path_.products)
    assert tokens == eager_tokens and len(calls) >= 12
    assert all(g is None and w is None or torch.equal(g, w) for g, w in zip(logits, eager_logits))
