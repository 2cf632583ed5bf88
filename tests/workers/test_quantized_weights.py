"""Quantized weights (``workers.quantization``): GPTQ (with and without ``desc_act``, both checkpoint
formats), AWQ and FP8 checkpoints built by the tests' own quantizer (``helpers.quantized_checkpoints``)
from a random tiny Llama, and ``quantization`` int8 / fp8 rounding a full-precision checkpoint at load.
Oracle: transformers running on the dequantized weights. Greedy tokens equal token for token, logprobs
within 1e-4 (fp32, TP=1 here; TP=2 in test_worker_tp.py, packed at TP=2 in test_packed_tp2.py). Plus the
unpacking on a hand-made word, and clear errors for formats not supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import assert_top_logprobs_match, hf_greedy_each
from helpers.quantized_checkpoints import quantize_folder, round_rows_8bit
from helpers.worker_setup import engine_config, local_driver
from pagedray.kernels import quant_gemm_reference
from pagedray.kernels.quant_gemm import unpack_along_cols, unpack_along_rows
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.models.model_info import load_hf_config
from pagedray.workers.weights import quantization as quant
from pagedray.workers.worker import Worker

NEW_TOKENS = 32
PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4]]
FORMATS = {
    "gptq": dict(fmt="gptq", group=32, desc_act=False, v2=False),
    "gptq-desc-act": dict(fmt="gptq", group=32, desc_act=True, v2=False),
    "gptq-v2": dict(fmt="gptq", group=16, desc_act=True, v2=True),
    "awq": dict(fmt="awq", group=32),
    "fp8-per-row": dict(fmt="fp8"),
    "fp8-blocks": dict(fmt="fp8", block=32),
    "compressed-tensors-fp8": dict(fmt="fp8", compressed_tensors=True),
}


@pytest.fixture(scope="module")
def quantized_pair(tmp_path_factory):
    """format -> (quantized folder, dequantized folder), built once per module."""
    cache: dict[str, tuple[str, str]] = {}

    def get(name: str, source: str) -> tuple[str, str]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            spec = dict(FORMATS[name])
            quantize_folder(source, root / "quantized", root / "dequantized", spec.pop("fmt"), **spec)
            cache[name] = (str(root / "quantized"), str(root / "dequantized"))
        return cache[name]
    return get


def _assert_same_model(path: str, oracle: str, **model_kwargs) -> None:
    _, driver = local_driver(path, token_budget=24, max_chunk=16, **model_kwargs)
    params = SamplingParams(temperature=0.0, logprobs=5)
    seqs = driver.run([driver.add(p, NEW_TOKENS, params) for p in PROMPTS])
    assert [s.output for s in seqs] == hf_greedy_each(oracle, PROMPTS, NEW_TOKENS)
    assert_top_logprobs_match(oracle, seqs)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_equals_transformers_on_its_dequantized_weights(name, quantized_pair,
                                                                               tiny_model_path):
    path, oracle = quantized_pair(name, tiny_model_path("llama"))
    assert "quantization_config" in json.loads(Path(path, "config.json").read_text())
    _assert_same_model(path, oracle)


@pytest.mark.parametrize("name", ["gptq-desc-act", "gptq-v2", "awq", "int8", "fp8", "fp8-per-row", "fp8-blocks",
                                  "compressed-tensors-fp8"])
def test_packed_weights_give_the_dequantized_models_tokens(name, quantized_pair, tiny_model_path, monkeypatch,
                                                           tmp_path):
    """What CUDA does with integer formats (``keeps_packed``), forced on CPU: every decoder linear layer holds
    its rank's packed weight (no dense copy) and multiplies with ``kernels.quant_gemm``; the model is still
    the dequantized one, in under 35% of the fp32 weight bytes (this tiny model's zero points, scales and
    group indices included: 23-30%). No dense copy is allocated at any point: the layers' weights are meta
    tensors until their load finds them packed."""
    import pagedray.workers.models.model_loading as loading_module
    from pagedray.workers.layers import linear as linear_module
    from pagedray.workers.models.decoder import DecoderForCausalLM

    monkeypatch.setattr(loading_module, "keeps_packed", lambda q, device: q.method != "none")
    dense_allocations, load_weights = [], DecoderForCausalLM.load_weights
    allocate = linear_module.allocate_dense
    monkeypatch.setattr(linear_module, "allocate_dense",
                        lambda layer: dense_allocations.append(layer) or allocate(layer))

    def load_checking_meta(model, reader):
        linears = [m for m in model.modules() if isinstance(m, (linear_module.ColumnParallelLinear,
                                                                linear_module.RowParallelLinear))]
        assert len(linears) == 2 * 4 and all(m.weight.is_meta for m in linears)
        return load_weights(model, reader)

    monkeypatch.setattr(DecoderForCausalLM, "load_weights", load_checking_meta)
    source = tiny_model_path("llama")
    if name in ("int8", "fp8"):
        path, oracle, options = source, str(tmp_path / "rounded"), {"quantization": name}
        round_rows_8bit(source, tmp_path / "rounded", name)
    else:
        (path, oracle), options = quantized_pair(name, source), {}
    worker, _ = local_driver(path, **options)
    linears = [m for m in worker.model.modules() if hasattr(m, "quant") and m.quant is not None]
    assert len(linears) == 2 * 4 and all(m.weight is None for m in linears)   # qkv, o, gate_up, down per layer
    assert dense_allocations == []
    parts = [p for m in linears for p in (m.quant if isinstance(m.quant, list) else [m.quant])]
    dense = sum(p.qweight.shape[0] * (32 // p.bits) * p.qweight.shape[1] * 4 for p in parts)
    assert sum(p.nbytes for p in parts) < 0.35 * dense
    _assert_same_model(path, oracle, **options)


@pytest.mark.parametrize("name", ["awq", "fp8-blocks"])
def test_packed_layers_run_the_triton_gemm_under_the_interpreter(name, quantized_pair, tiny_model_path, monkeypatch):
    import functools

    import pagedray.workers.models.model_loading as loading_module
    from pagedray import kernels

    monkeypatch.setattr(loading_module, "keeps_packed", lambda q, device: True)
    calls = []
    triton_gemm = functools.partial(kernels.quant_gemm, use_triton=True)
    monkeypatch.setattr(kernels, "quant_gemm", lambda *a, **k: calls.append(1) or triton_gemm(*a, **k))
    path, oracle = quantized_pair(name, tiny_model_path("llama"))
    _, driver = local_driver(path, token_budget=24, max_chunk=16)
    seqs = driver.run([driver.add(p, 6, SamplingParams(temperature=0.0)) for p in PROMPTS])
    assert [s.output for s in seqs] == hf_greedy_each(oracle, PROMPTS, 6) and calls


@pytest.mark.parametrize("fmt, options", [("gptq", dict(group=16, desc_act=True, v2=False)), ("awq", dict(group=16))])
def test_quantized_moe_experts_load_dequantized(fmt, options, tiny_model_path, tmp_path):
    """Qwen3-MoE with quantized experts (``mlp.experts.N.*_proj``) next to a full-precision router and a dense
    layer: the experts' weights go through the same reader, so the model equals transformers on them."""
    quantize_folder(tiny_model_path("qwen3-moe"), tmp_path / "q", tmp_path / "dq", fmt, **options)
    assert any(".experts.0.down_proj.qweight" in name for name in _tensor_names(tmp_path / "q"))
    _assert_same_model(str(tmp_path / "q"), str(tmp_path / "dq"))


@pytest.mark.parametrize("fmt, options, packed", [
    ("gptq", dict(group=16, desc_act=False, v2=False), True), ("awq", dict(group=16), True),
    ("fp8", dict(), True), ("fp8", dict(block=16), True), ("int8", dict(), True),
    ("gptq", dict(group=16, desc_act=True, v2=False), False),      # activation order: experts load dequantized
])
def test_packed_moe_experts_give_the_dequantized_models_tokens(fmt, options, packed, tiny_model_path, tmp_path,
                                                                monkeypatch):
    """What CUDA does with a quantized MoE (``keeps_packed``), forced on CPU: every MoE layer holds its experts
    packed (``PackedExperts``; the 16-bit expert tensors never allocated) when their groups are uniform, and the
    model is still the dequantized one (greedy tokens equal, logprobs within 1e-4)."""
    import pagedray.workers.models.model_loading as loading_module
    from pagedray.workers.layers.moe import SparseMoE

    monkeypatch.setattr(loading_module, "keeps_packed", lambda q, device: q.method != "none")
    source, options_out = tiny_model_path("qwen3-moe"), {}
    if fmt == "int8":
        path, oracle, options_out = source, str(tmp_path / "dq"), {"quantization": "int8"}
        round_rows_8bit(source, tmp_path / "dq", "int8")
    else:
        quantize_folder(source, tmp_path / "q", tmp_path / "dq", fmt, **options)
        path, oracle = str(tmp_path / "q"), str(tmp_path / "dq")
    worker, _ = local_driver(path, **options_out)
    moes = [m for m in worker.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all((m.packed is not None) == packed for m in moes)
    if packed:
        assert all(m.gate_up is None and m.down is None for m in moes)
        bits = moes[0].packed[0].bits
        dense_bytes = sum(4 * m.spec.num_experts * 3 * m.rows * m.hidden_size for m in moes)
        assert sum(p.nbytes for m in moes for p in m.packed) < (0.3 if bits == 4 else 0.45) * dense_bytes
    _assert_same_model(path, oracle, **options_out)


def test_packed_moe_runs_the_triton_kernel_under_the_interpreter(tiny_model_path, tmp_path, monkeypatch):
    import functools

    import pagedray.workers.models.model_loading as loading_module
    from pagedray import kernels

    monkeypatch.setattr(loading_module, "keeps_packed", lambda q, device: True)
    calls = []
    triton_moe = functools.partial(kernels.fused_moe, use_triton=True)
    monkeypatch.setattr(kernels, "fused_moe", lambda *a, **k: calls.append(1) or triton_moe(*a, **k))
    quantize_folder(tiny_model_path("qwen3-moe"), tmp_path / "q", tmp_path / "dq", "awq", group=16)
    _, driver = local_driver(str(tmp_path / "q"), token_budget=24, max_chunk=16)
    seqs = driver.run([driver.add(p, 6, SamplingParams(temperature=0.0)) for p in PROMPTS])
    assert [s.output for s in seqs] == hf_greedy_each(str(tmp_path / "dq"), PROMPTS, 6) and calls


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def test_the_quantization_changes_the_model(quantized_pair, tiny_model_path):
    """The dequantized weights differ from the originals enough to change transformers' greedy tokens, so
    the equality above could not hold if the loader read or ignored them wrongly."""
    source = tiny_model_path("llama")
    _, oracle = quantized_pair("gptq", source)
    assert hf_greedy_each(oracle, PROMPTS, NEW_TOKENS) != hf_greedy_each(source, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_option_rounds_a_full_precision_checkpoint_at_load(method, tiny_model_path, tmp_path):
    source = tiny_model_path("llama")
    round_rows_8bit(source, tmp_path / "rounded", method)
    _assert_same_model(source, str(tmp_path / "rounded"), quantization=method)


def test_unpacking_a_hand_made_word():
    word = torch.tensor([[0x76543210 - 2**32 + 2**31 * 2]], dtype=torch.int64)        # nibbles 0..7, low first
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    assert unpack_along_rows(word, 4).flatten().tolist() == list(range(8))
    assert unpack_along_cols(word, 4).flatten().tolist() == list(range(8))
    # AWQ: nibble k holds column AWQ_ORDER[k], so column c reads nibble AWQ_ORDER.index(c)
    assert unpack_along_cols(word, 4, quant.AWQ_ORDER).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    high = torch.tensor([[-1]], dtype=torch.int32)                                   # every nibble 15
    assert unpack_along_rows(high, 4).flatten().tolist() == [15] * 8
    assert unpack_along_rows(high, 8).flatten().tolist() == [255] * 4


@pytest.mark.parametrize("config, option, message", [
    ({"quant_method": "bitsandbytes"}, "auto", "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "auto", "GPTQ with 3 bits"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "auto", "version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "auto", "'pack-quantized'"),
    ({"quant_method": "gptq", "bits": 4}, "int8", "already quantized"),
])
def test_unsupported_quantizations_are_value_errors_naming_the_option(config, option, message, tiny_model_path,
                                                                      tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path("llama"), folder)
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"quantization: .*{message}"):
        Worker(engine_config(str(folder), quantization=option))


def test_the_quantization_option_is_checked_with_the_config():
    from pagedray.workers.contract.config import ModelConfig

    with pytest.raises(ValueError, match="quantization: must be one of"):
        ModelConfig(quantization="int4").validate()


def test_read_packed_slices_on_word_boundaries_only(quantized_pair, tiny_model_path):
    """A column range that splits a packed word is read dense instead (None from read_packed); an aligned one
    gives the same weight as the dense read."""
    from pagedray.workers.weights.weight_loader import CheckpointReader

    path, _ = quantized_pair("gptq", tiny_model_path("llama"))
    q = quant.resolve(load_hf_config(path), "auto")
    name, shape = "model.layers.0.mlp.down_proj.weight", [64, 96]
    with CheckpointReader(path, q, keep_packed=True) as reader:
        assert reader.read_packed(name, 1, 4, 52, shape) is None
        packed = reader.read_packed(name, 1, 48, 96, shape)
        dense = reader.read(name, 1, 48, 96, shape)
    rebuilt = quant_gemm_reference(torch.eye(48), packed.qweight, packed.zeros, packed.scales, packed.g_idx, 4)
    torch.testing.assert_close(rebuilt, dense.t(), rtol=0, atol=1e-6)          # x = I: the weight itself


@pytest.mark.parametrize("name", ["fp8-per-row", "fp8-blocks", "compressed-tensors-fp8"])
def test_read_packed_fp8_slices_equal_the_dense_reads(name, quantized_pair, tiny_model_path):
    """An FP8 weight read packed (its e4m3 bytes, per-row scales as one group, block scales as groups of the
    block's input columns) holds exactly the dense read's values, for output-row and input-column slices that
    cut through scale blocks."""
    from pagedray.workers.weights.weight_loader import CheckpointReader

    path, _ = quantized_pair(name, tiny_model_path("llama"))
    q = quant.resolve(load_hf_config(path), "auto")
    weight, shape = "model.layers.1.mlp.down_proj.weight", [64, 96]
    with CheckpointReader(path, q, keep_packed=True) as reader:
        for dim, start, end in ((0, 8, 56), (1, 20, 84), (0, 0, 64)):
            packed = reader.read_packed(weight, dim, start, end, shape).grouped()
            assert packed.float8 and packed.bits == 8
            dense = reader.read(weight, dim, start, end, shape)                      # [rows, cols] float32
            cols = dense.shape[1]
            rebuilt = quant_gemm_reference(torch.eye(cols), packed.qweight, packed.zeros, packed.scales,
                                           packed.g_idx, 8, packed.perm, float8=True)   # x = I: W^T itself
            assert torch.equal(rebuilt, dense.t()), (dim, start, end)
