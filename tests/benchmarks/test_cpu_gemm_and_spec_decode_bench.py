"""The plumbing of two benchmark scripts without timing anything that matters: ``benchmarks.cpu_gemm``'s
systems compute the same products over the same weights and its choice table names the plan's product,
and ``benchmarks.spec_decode``'s measurement reports every metric for an engine with and without
speculation (tiny model)."""

from __future__ import annotations

import pytest
import torch
from pagedray.cluster import LLM
from pagedray.kernels.cpu import cpu_choice, cpu_gemm
from pagedray.workers.layers import gemm_timing, packed_gemm

from benchmarks import cpu_gemm as gemm_bench
from benchmarks import spec_decode
from benchmarks.rounds import Run


@pytest.mark.skipif(not cpu_gemm.available(torch.bfloat16), reason="this CPU or compiler has no AVX512-BF16")
def test_cpu_gemm_systems_compute_the_same_products_and_the_table_names_the_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_bench, "LAYERS", 1)
    monkeypatch.setattr(gemm_bench, "VOCAB", 64)
    monkeypatch.delenv(cpu_choice.PRODUCT_ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    model = gemm_bench.build_model(gen, torch.bfloat16)
    modules = packed_gemm.packable_modules(model)
    table = gemm_timing.plan_table(model, "auto", 8, cache=cpu_choice.ChoiceCache(tmp_path))
    products = list(packed_gemm.candidates(modules[0].weight))         # c, onednn; amx on a CPU with AMX
    systems = [*products, "dispatch", "int8"]
    ops = {system: gemm_bench.operands(system, modules, table) for system in systems}
    for index, module in enumerate(modules):
        x = torch.randn(3, module.weight.shape[1], generator=gen).bfloat16()
        exact = x.double() @ module.weight.double().T
        silu = gemm_timing.SILU in gemm_timing.plan_key(module)      # the gate/up projection: SiLU * up follows
        if silu:
            gate, up = exact.chunk(2, dim=-1)
            exact = torch.nn.functional.silu(gate) * up
        for system in systems:
            got = gemm_bench.product(system, x, ops[system][index], module.weight, silu).double()
            bound = (0.03 if system == "int8" else 0.02) * exact.abs().max()
            assert (got - exact).abs().max() <= bound, system
    inputs = {k: torch.randn(16, k, generator=gen).bfloat16() for k in (gemm_bench.HIDDEN, gemm_bench.INTERMEDIATE)}
    runs = [Run(system, r, gemm_bench.measure(system, modules, ops[system], inputs, [1, 16], 1, 8),
                (0, 0, 0), (0, 0, 0)) for r in range(2) for system in systems]
    assert all(set(run.values) == {"ms_1_rows", "ms_16_rows", "960x576_1", "576x576_1", "3072x576+silu_1",
                                   "576x1536_1", "64x576_1", "960x576_16", "576x576_16", "3072x576+silu_16",
                                   "576x1536_16"} for run in runs)    # the head's 16 rows exceed max_num_seqs=8
    rows = gemm_bench.choice_rows(runs, table, products, [1, 16], 8, ("int8",))
    assert len(rows) == 9
    keys = {gemm_timing.shape_name(key): key for key in table.shapes}
    for row in rows:
        assert row["chosen"] == table.shapes[keys[row["shape"]]].plan[
            cpu_choice.bucket_index(row["rows"])]
        assert row["chosen/best unpaired"] == row[f"{row['chosen']}_ms"] / min(row[f"{p}_ms"] for p in products)
        assert row["chosen/best unpaired"] >= 1.0 and row["chosen/best"] >= 1.0
        assert row["int8/chosen"] == row["int8_ms"] / row[f"{row['chosen']}_ms"]


def _fake_runs(times: dict[str, list[float]], key: str = "576x576_1") -> list[Run]:
    return [Run(system, r, {key: ms}, (0, 0, 0), (0, 0, 0)) for system, series in times.items()
            for r, ms in enumerate(series)]


def test_chosen_over_best_pairs_each_round_and_keeps_the_ratio_of_medians_beside_it():
    table = gemm_timing.PlanTable(torch.bfloat16, 2, {(576, 576): gemm_timing.ShapePlan(
        {}, ("c",) * len(cpu_choice.ROW_BUCKETS))}, "forced")
    # the C GEMM ahead in rounds 0 and 2, behind in round 1 by a drift that slowed only its run there
    [row] = gemm_bench.choice_rows(_fake_runs({"c": [10.0, 20.0, 12.0], "onednn": [11.0, 10.5, 13.0]}),
                                   table, ["c", "onednn"], [1], 8)
    assert row["best"] == "onednn" and row["chosen/best unpaired"] == pytest.approx(12.0 / 11.0)
    assert row["chosen/best"] == 1.0      # paired: c / onednn = 0.909, 1.90, 0.923 -> median 0.923 < 1
    # a chosen product slower in every round is slower paired too
    [row] = gemm_bench.choice_rows(_fake_runs({"c": [12.0, 12.6, 11.4], "onednn": [10.0, 10.0, 10.0]}),
                                   table, ["c", "onednn"], [1], 8)
    assert row["chosen/best"] == pytest.approx(1.2) and row["chosen/best unpaired"] == pytest.approx(1.2)


def test_merge_rounds_joins_each_systems_row_counts_per_round():
    first = [Run("c", r, {"ms_1_rows": 1.0 + r}, (0.1, 0, 0), (0.2, 0, 0)) for r in range(2)]
    second = [Run("c", r, {"ms_16_rows": 5.0 + r}, (0.3, 0, 0), (0.4, 0, 0)) for r in range(2)]
    merged = gemm_bench.merge_rounds([first, second])
    assert [(run.system, run.round, run.values) for run in merged] == [
        ("c", 0, {"ms_1_rows": 1.0, "ms_16_rows": 5.0}), ("c", 1, {"ms_1_rows": 2.0, "ms_16_rows": 6.0})]
    assert all(run.load_before == (0.1, 0, 0) and run.load_after == (0.4, 0, 0) for run in merged)
    assert first[0].values == {"ms_1_rows": 1.0}       # the inputs are not changed


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
