"""Tensor parallelism: two RayWorker actors (gloo) give the same greedy tokens as one in-process worker
and as transformers, and their logprobs match transformers' log-softmax within 1e-4.

``llama``: 4 query / 2 KV heads (one KV head per rank), odd vocabulary (uneven vocab-parallel split),
untied LM head. ``qwen3``: a single KV head, so both ranks hold a replica of it. ``phi3``: fused
``qkv_proj`` / ``gate_up_proj`` checkpoint tensors, each rank reading its rows of every segment, and a
16-token sliding window. ``gemma3``: (1 + w) norms around attention and MLP, scaled embeddings, GELU-tanh,
local and global layers with their own rope (the logprob check fails when the global layers take the local
rope, which the greedy tokens alone do not catch). ``qwen3-moe``: 6 experts, top-2, each rank holding every
expert's half of the intermediate dimension, one dense layer; ``qwen2-moe``: plus a gated shared expert;
``mixtral``: Mixtral's names and renormalised top-2. ``gpt-oss``: each rank's half of the query heads' sinks,
the interleaved gate/up columns of its half of every expert, the down bias added on one rank only.
``qwen3.5`` / ``qwen3.5-moe``: each rank's half of the linear-attention key and value heads (their rows of the
fused q/k/v projection and of the convolution, their own state slots) and of the gated attention's heads.
``gemma4``: per-layer head shapes (each rank holds one of the 2 sliding KV heads and a replica of the single
full-attention one, in a cache of two shapes), KV-shared layers reading their source's rows, per-layer inputs
(the table vocab-parallel), soft-capped logits; ``gemma4-moe``: each rank's half of every expert beside the dense
MLP, the replicated router, attention biases.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_oracle import hf_greedy_each, hf_logprobs_along
from helpers.worker_plans import PlanDriver
from helpers.worker_setup import local_driver, ray_execute, start_ray_workers, stop_ray_workers
from pagedray.workers.contract.sampling_params import SamplingParams

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

NEW_TOKENS = 64
PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4]]
TOP_N = 5


def _check_logprobs(path: str, seq) -> None:
    reference = hf_logprobs_along(path, seq.prompt, seq.output)        # [new tokens, vocab]
    assert len(seq.sampled) == reference.shape[0] == NEW_TOKENS
    for row, sampled in zip(reference, seq.sampled):
        ids = [token for token, _ in sampled.top_logprobs]
        values = torch.tensor([value for _, value in sampled.top_logprobs])
        assert len(ids) == TOP_N and ids[0] == sampled.token_id
        torch.testing.assert_close(values, row[ids], rtol=0, atol=1e-4)
        torch.testing.assert_close(values, row.topk(TOP_N).values, rtol=0, atol=1e-4)
        assert abs(sampled.logprob - row[sampled.token_id].item()) < 1e-4


def _extended(*values):
    """Parameters of the extended tier (README: -m slow): CI keeps one family of each kind of split."""
    return [pytest.param(*value if isinstance(value, tuple) else (value,), marks=pytest.mark.slow) for value in values]


# CI: a dense GQA model, sliding + global layers, an MoE, attention sinks, a hybrid, Gemma 4's shared KV
@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3-moe", "gpt-oss", "qwen3.5", "gemma4",
                                  *_extended("qwen3", "phi3", "gemma2", "qwen2-moe", "mixtral", "qwen3.5-moe",
                                             "gemma4-moe")])
def test_tp2_matches_tp1_and_transformers(kind, tiny_model_path, ray_session):
    path = tiny_model_path(kind)
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    _, local = local_driver(path, token_budget=24, max_chunk=16)
    tp1 = local.run([local.add(p, NEW_TOKENS, params) for p in PROMPTS])
    actors = start_ray_workers(ray_session, path, tp=2)
    try:
        driver = PlanDriver(ray_execute(ray_session, actors), 8, 64, token_budget=24, max_chunk=16)
        tp2 = driver.run([driver.add(p, NEW_TOKENS, params) for p in PROMPTS])
        assert ray_session.get([a.num_sequences.remote() for a in actors]) == [0, 0]
    finally:
        stop_ray_workers(ray_session, actors)
    assert [s.output for s in tp2] == [s.output for s in tp1] == hf_greedy_each(path, PROMPTS, NEW_TOKENS)
    for seq in tp2:
        _check_logprobs(path, seq)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", *_extended("fp8_e4m3", "fp8_e4m3 with checkpoint scales")])
def test_tp2_with_an_8bit_kv_cache_matches_tp1(kv_cache_dtype, tiny_model_path, ray_session, tmp_path):
    """Each rank quantizes its own KV heads' rows (llama: one KV head per rank): TP=2 gives TP=1's tokens,
    and logprobs within 1e-4 of TP=1's (both 8-bit). With checkpoint scales every rank reads the same
    per-layer scales (test_checkpoint_kv_scales.py)."""
    path = tiny_model_path("llama")
    if kv_cache_dtype.endswith("scales"):
        from test_checkpoint_kv_scales import _with_scales

        scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.02 * (i + 1))
                  for i in range(2) for kv in ("k", "v")}
        path, kv_cache_dtype = _with_scales(path, tmp_path / "model", scales), "fp8_e4m3"
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    _, local = local_driver(path, token_budget=24, max_chunk=16, kv_cache_dtype=kv_cache_dtype)
    tp1 = local.run([local.add(p, NEW_TOKENS, params) for p in PROMPTS])
    actors = start_ray_workers(ray_session, path, tp=2, kv_cache_dtype=kv_cache_dtype)
    try:
        driver = PlanDriver(ray_execute(ray_session, actors), 8, 64, token_budget=24, max_chunk=16)
        tp2 = driver.run([driver.add(p, NEW_TOKENS, params) for p in PROMPTS])
    finally:
        stop_ray_workers(ray_session, actors)
    assert [s.output for s in tp2] == [s.output for s in tp1]
    for one, two in zip(tp1, tp2):
        for a, b in zip(one.sampled, two.sampled):
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            torch.testing.assert_close(torch.tensor([v for _, v in b.top_logprobs]),
                                       torch.tensor([v for _, v in a.top_logprobs]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt, options", [("gptq", dict(group=16, desc_act=True, v2=False)),
                                          *_extended(("awq", dict(group=16)), ("fp8", dict(block=16))), ("int8", {})])
def test_tp2_splits_quantized_weights_as_the_dense_ones(fmt, options, tiny_model_path, ray_session, tmp_path):
    """GPTQ (desc_act: every rank's input rows keep their groups), AWQ, block-scaled FP8 and ``quantization``
    int8: TP=2 gives the greedy tokens of transformers on the dequantized weights, logprobs within 1e-4."""
    from helpers.quantized_checkpoints import quantize_folder, round_rows_8bit

    source = tiny_model_path("llama")
    if fmt == "int8":
        path, oracle = source, tmp_path / "rounded"
        round_rows_8bit(source, oracle, "int8")
    else:
        path, oracle = tmp_path / "quantized", tmp_path / "dequantized"
        quantize_folder(source, path, oracle, fmt, **options)
    params = SamplingParams(temperature=0.0, logprobs=TOP_N)
    actors = start_ray_workers(ray_session, str(path), tp=2, quantization="int8" if fmt == "int8" else "auto")
    try:
        driver = PlanDriver(ray_execute(ray_session, actors), 8, 64, token_budget=24, max_chunk=16)
        tp2 = driver.run([driver.add(p, NEW_TOKENS, params) for p in PROMPTS])
    finally:
        stop_ray_workers(ray_session, actors)
    assert [s.output for s in tp2] == hf_greedy_each(str(oracle), PROMPTS, NEW_TOKENS)
    for seq in tp2:
        _check_logprobs(str(oracle), seq)
