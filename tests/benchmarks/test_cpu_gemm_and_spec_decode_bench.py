"""The plumbing of two benchmark scripts without timing anything that matters: ``benchmarks.cpu_gemm``'s
three systems compute the same products over the same weights, and ``benchmarks.spec_decode``'s
measurement reports every metric for an engine with and without speculation (tiny model)."""

from __future__ import annotations

import pytest
import torch
from pagedray.cluster import LLM
from pagedray.kernels import cpu_gemm

from benchmarks import cpu_gemm as gemm_bench
from benchmarks import spec_decode


@pytest.mark.skipif(not cpu_gemm.available(torch.bfloat16), reason="this CPU or compiler has no AVX512-BF16")
def test_cpu_gemm_systems_compute_the_same_products(monkeypatch):
    monkeypatch.setattr(gemm_bench, "LAYERS", 1)
    monkeypatch.setattr(gemm_bench, "VOCAB", 64)
    gen = torch.Generator().manual_seed(0)
    operands = gemm_bench.build(gen, torch.bfloat16)
    assert {len(v) for v in operands.values()} == {len(gemm_bench.LAYER_SHAPES) + 1}
    for index, (_, k) in enumerate(gemm_bench.LAYER_SHAPES):
        x = torch.randn(3, k, generator=gen).bfloat16()
        products = [gemm_bench.product(system, x, operands[system][index]).float() for system in gemm_bench.SYSTEMS]
        exact = x.double() @ operands["f_linear"][index].double().T
        for product in products:
            assert (product.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    inputs = {k: torch.randn(4, k, generator=gen).bfloat16() for k in (gemm_bench.HIDDEN, gemm_bench.INTERMEDIATE)}
    values = gemm_bench.measure("c_gemm", operands["c_gemm"], inputs, [1, 4], steps=1)
    assert set(values) == {"ms_1_rows", "ms_4_rows"} and all(v > 0 for v in values.values())


def test_spec_decode_measurement_reports_every_metric(tmp_path):
    from helpers.tiny_models import save_tiny_llama

    tiny_llama_path = save_tiny_llama(tmp_path)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9]]
    with LLM(tiny_llama_path, dtype="float32", num_blocks=64, block_size=8, num_speculative_tokens=3) as llm:
        values, outputs = spec_decode.measure(llm, prompts, max_tokens=6)
    assert set(values) == {metric.key for metric in spec_decode._metrics()}
    assert all(values[f"tpot_ms_b{b}"] > 0 and 0 <= values[f"acceptance_b{b}"] <= 1 for b in spec_decode.BATCHES)
    assert len(outputs) == len(prompts) + 8 and all(len(tokens) >= 1 for tokens in outputs.values())


def test_draft_models_copy_keeps_the_chosen_layers_renumbered(tmp_path):
    from helpers.hf_oracle import load_hf_model
    from helpers.tiny_models import save_tiny_llama

    from benchmarks.draft_models import layers_copy, parse_layers

    source = save_tiny_llama(tmp_path / "tiny")
    original = load_hf_model(source)
    copy = load_hf_model(str(layers_copy(source, [1], tmp_path / "draft")))
    assert copy.config.num_hidden_layers == 1 and original.config.num_hidden_layers == 2
    for name, tensor in copy.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[name.replace("layers.0.", "layers.1.")]), name
    whole = load_hf_model(str(layers_copy(source, [0, 1], tmp_path / "whole")))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(whole(ids).logits, original(ids).logits)
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="keep"):
        layers_copy(source, [1, 0], tmp_path / "bad")
