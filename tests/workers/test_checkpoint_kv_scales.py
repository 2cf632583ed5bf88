"""Checkpoint KV scales (``self_attn.k_scale`` / ``v_scale``, or one ``kv_scale``): a float8 cache stores each
layer's rows with the checkpoint's scales (``kernels.kv_quant``), an int8 cache and a full-precision one
ignore them, and a malformed scale is refused at load naming the tensor.

The scales here are "calibrated" the way a checkpoint producer would: the largest per-row scale each layer
reached with dynamic scales over the test prompts, so that no row saturates. The engine with them then stays
within the fp8 cache's logprob bounds of transformers in full precision (test_kv8_logprobs.py's bounds).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.worker_setup import local_driver
from pagedray.kernels.kv_quant import static_scale
from pagedray.workers.contract.sampling_params import SamplingParams
from safetensors.torch import load_file, save_file
from test_kv8_logprobs import BOUNDS, logprob_differences

PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4]]
NEW_TOKENS = 24


def _with_scales(source: str, target: Path, scales: dict[str, torch.Tensor]) -> str:
    """A copy of the model folder whose weights also hold ``scales`` (name -> tensor)."""
    shutil.copytree(source, target)
    files = sorted(target.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    save_file({**tensors, **scales}, str(files[0]))
    return str(target)


def _run(path: str, kv_cache_dtype: str, logprobs: int | None = None):
    worker, driver = local_driver(path, token_budget=24, max_chunk=16, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    seqs = driver.run([driver.add(p, NEW_TOKENS, params) for p in PROMPTS])
    return worker, seqs


def _written_scales(worker) -> torch.Tensor:
    """[layers, 2, rows] float16: the row scales of every slot the run wrote (a written row's scale is > 0)."""
    scales = worker.runner.kv_cache.scales                       # [layers, 2, blocks, block_size, kv_heads]
    flat = scales.flatten(2)
    return flat[:, :, flat[0, 0] > 0]


@pytest.fixture(scope="module")
def calibrated(tiny_model_path, tmp_path_factory):
    """(model folder with k_scale / v_scale per layer, the scales, the plain folder)."""
    path = tiny_model_path("llama")
    worker, _ = _run(path, "fp8_e4m3")
    largest = _written_scales(worker).float().amax(-1)           # [layers, 2]: the calibration
    scales = {}
    for layer in range(largest.shape[0]):
        scales[f"model.layers.{layer}.self_attn.k_scale"] = largest[layer, 0].reshape(())       # 0-d, as written
        scales[f"model.layers.{layer}.self_attn.v_scale"] = largest[layer, 1].reshape(1)
    return _with_scales(path, tmp_path_factory.mktemp("kvs") / "model", scales), largest, path


def test_a_float8_cache_stores_every_row_with_the_checkpoint_scales(calibrated):
    path, largest, plain = calibrated
    worker, seqs = _run(path, "fp8_e4m3", logprobs=5)
    written = _written_scales(worker)                            # [layers, 2, rows]
    assert written.shape[-1] > 50
    for layer in range(written.shape[0]):
        for kv in (0, 1):
            assert (written[layer, kv] == static_scale(float(largest[layer, kv]))).all(), (layer, kv)
    diffs = logprob_differences(plain, seqs)
    top, mean = BOUNDS["fp8_e4m3"]
    assert 0 < diffs.max() < top and diffs.mean() < mean


def test_int8_and_full_precision_caches_ignore_them(calibrated):
    path, largest, plain = calibrated
    worker, seqs = _run(path, "int8")
    written = _written_scales(worker)
    assert len(torch.unique(written[0, 0])) > 10                 # each row its own scale
    _, plain_seqs = _run(plain, "int8")
    assert [s.output for s in seqs] == [s.output for s in plain_seqs]
    worker, seqs = _run(path, "auto")
    _, plain_seqs = _run(plain, "auto")
    assert worker.runner.kv_cache.scales is None and [s.output for s in seqs] == [s.output for s in plain_seqs]


def test_one_kv_scale_serves_both(tiny_model_path, tmp_path):
    path = tiny_model_path("llama")
    layers = len({k.split(".")[2] for k in load_file(str(next(Path(path).glob("*.safetensors")))) if ".layers." in k})
    scales = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([0.75]) for i in range(layers)}
    worker, _ = _run(_with_scales(path, tmp_path / "model", scales), "fp8_e4m3")
    assert (_written_scales(worker) == static_scale(0.75)).all()


@pytest.mark.parametrize("value", [-1.0, float("nan"), 0.0])
def test_a_malformed_scale_is_refused_naming_it(value, tiny_model_path, tmp_path):
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(value), "model.layers.0.self_attn.v_scale":
              torch.tensor(1.0)}
    path = _with_scales(tiny_model_path("llama"), tmp_path / "model", scales)
    with pytest.raises(ValueError, match="KV scale 'model.layers.0.self_attn.k_scale' must be one positive"):
        _run(path, "fp8_e4m3")
