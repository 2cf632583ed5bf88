"""The CPU linear layers' products and the measured choice between them (``workers/layers/gemm_timing.py``):
each product's time per weight shape and row count, the product the dispatch chose, and how far the choice
is from the best.

What is timed: one "step" of SmolLM2-135M's linear layers at a given row count: 30 layers' qkv, o_proj,
gate/up (with the SiLU * up that follows it, as the engine times and runs it: the C GEMM fused, the others
then ``kernels.silu_and_mul``; "+silu" in the tables) and down_proj, each layer with its own random weights,
plus the 49,152-row LM head (up to ``--max-num-seqs`` rows, as in the engine, which runs it on sampled rows
only), so every weight comes from DRAM as in a real decode step (270 MB in bf16, 540 MB in fp32). Each call
is timed on its own and summed per shape. Systems:

- ``c``: pagedray's C GEMM on tile-packed weights (AVX-512);
- ``amx`` (bfloat16, on a CPU with AMX): pagedray's AMX product on the same tile-packed weights;
- ``onednn``: oneDNN's packed product (AMX where the CPU has it);
- ``mkl`` (float32): ``F.linear`` on the plain weights;
- ``dispatch``: each weight on the product its shape's plan names for the row count: the plan is made by
  ``gemm_timing.plan_table`` at the start of this script (timed afresh into a temporary cache, as a first
  start on this CPU would; its time is printed);
- ``int8`` (``--int8``, bfloat16 only, not a dispatch candidate): ``torch._weight_int8pack_mm`` on int8
  weights with one scale per output row (what ``quantization=int8`` keeps, dequantized today), to see
  whether a packed int8 product beats the bf16 ones at decode sizes.

How the systems are interleaved: row count by row count. At each row count every system runs once per round
(the order rotating between rounds), so the runs compared at one row count lie a second or less apart, and the
next row count starts only when every round of this one is done.

Tables: the step time per system and row count (median [min-max] of the rounds; ratio dispatch / each product),
then per shape and row count each product's median ms per call, the choice, and chosen / best (the goal:
<= 1.10 everywhere): per round, the chosen product's ms per call over each product's in the same round; the
median over the rounds; the largest over the products (1.0 when the chosen one is the fastest in that paired
sense). The ratio of the medians is kept beside it (``chosen/best unpaired``, what this script reported up to
2026-12-03). Why paired: when the products of a shape are within a few percent, the VM's drift between two
moments decides which median is smaller. On 2026-12-03 (2-core AMD EPYC, bf16), with every system running all
row counts before the next, the LM head at 64 rows measured the C GEMM 9.25 / 10.9 / 11.1 ms against oneDNN's
10.8 / 9.72 / 9.19 in the three rounds: each ahead in some round, and 1.119 as a ratio of medians.

    python -m benchmarks.cpu_gemm [--dtype bfloat16|float32] [--rows 1,4,16,32,64,128,512,1024,2048]
        [--threads 2] [--rounds 3] [--int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from pagedray import kernels
from pagedray.kernels.cpu import cpu_choice
from pagedray.kernels.cpu.cpu_choice import ChoiceCache
from pagedray.workers.layers import gemm_timing, packed_gemm
from torch import nn

from benchmarks.common import add_round_args, finish_rounds, print_run, print_table
from benchmarks.rounds import Metric, Ratio, Run, run_rounds

HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYER_SHAPES = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
GOAL = 1.10


class _Linear(nn.Module):
    """A weight with a ``packed_weight`` slot, as ``gemm_timing`` finds the model's linear layers."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.packed_weight = None
        self.silu_after = weight.shape[0] == 2 * INTERMEDIATE     # the merged gate/up projection


def build_model(gen: torch.Generator, dtype: torch.dtype) -> nn.Module:
    """SmolLM2's linear weights in step order (``lm_head`` last), random, each layer its own."""
    model = nn.Module()
    model.layers = nn.ModuleList(_Linear((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
                                 for _ in range(LAYERS) for n, k in LAYER_SHAPES)
    model.lm_head = _Linear((torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype))
    return model


def int8_operand(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], one scale per output row [out]) for _weight_int8pack_mm."""
    scales = weight.float().abs().amax(1).clamp_min(1e-8) / 127
    return (weight.float() / scales[:, None]).round().to(torch.int8), scales.to(weight.dtype)


def operands(system: str, modules: list[nn.Module], table: gemm_timing.PlanTable):
    """Per module, what ``product`` multiplies with for ``system``."""
    if system == "int8":
        return [int8_operand(m.weight) for m in modules]
    if system == "dispatch":
        return [packed_gemm.pack_weight(m.weight, table.plan(m)) for m in modules]
    return [gemm_timing._operand(system, m.weight) for m in modules]


def product(system: str, x: torch.Tensor, operand, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """x times one module's operand for ``system``; ``silu``: then SiLU * up (fused where the C GEMM runs)."""
    if system not in ("int8", "dispatch"):
        return gemm_timing.run_product(system, x, operand, silu)
    fused = packed_gemm.linear_silu_mul(x, None, operand) if system == "dispatch" and silu else None
    if fused is not None:
        return fused
    y = torch._weight_int8pack_mm(x, *operand) if system == "int8" else packed_gemm.linear(x, weight, None, operand)
    return kernels.silu_and_mul(y) if silu else y


def shape_key(shape) -> str:
    return gemm_timing.shape_name(shape)


def measure(system: str, modules: list[nn.Module], ops: list, inputs: dict[int, torch.Tensor], rows_list: list[int],
            steps: int, max_head_rows: int) -> dict:
    """Median over ``steps`` (after one warm-up) of the step time and of each shape's ms per call."""
    values = {}
    for rows in rows_list:
        steps_ms, per_shape = [], {}
        for step in range(steps + 1):
            total, calls = 0.0, {}
            for module, operand in zip(modules, ops):
                shape = gemm_timing.plan_key(module)
                if shape == (VOCAB, HIDDEN) and rows > max_head_rows:
                    continue
                start = time.perf_counter()
                product(system, inputs[shape[1]][:rows], operand, module.weight, gemm_timing.SILU in shape)
                elapsed = (time.perf_counter() - start) * 1e3
                total += elapsed
                calls.setdefault(shape, []).append(elapsed)
            if step:
                steps_ms.append(total)
                for shape, times in calls.items():
                    per_shape.setdefault(shape, []).append(sum(times) / len(times))
        values[f"ms_{rows}_rows"] = statistics.median(steps_ms)
        for shape, times in per_shape.items():
            values[f"{shape_key(shape)}_{rows}"] = statistics.median(times)
    return values


def choice_rows(runs, table: gemm_timing.PlanTable, products: list[str], rows_list: list[int],
                max_head_rows: int, shown: tuple[str, ...] = ()) -> list[dict]:
    """Per shape and row count: each product's median ms per call over the rounds, the dispatch's choice, the
    best of ``products`` by median, chosen / best paired by round and unpaired (module doc); each of ``shown``
    (never a candidate) as its time / the chosen's."""
    out = []
    for shape in table.shapes:
        for rows in rows_list:
            if shape == (VOCAB, HIDDEN) and rows > max_head_rows:
                continue
            key = f"{shape_key(shape)}_{rows}"
            by_round = {p: {r.round: r.values[key] for r in runs if r.system == p and key in r.values}
                        for p in (*products, *shown)}
            medians = {p: statistics.median(times.values()) for p, times in by_round.items()}
            chosen = table.shapes[shape].plan[cpu_choice.bucket_index(rows)]
            best = min(products, key=medians.get)
            out.append({"shape": shape_key(shape), "rows": rows, **{f"{p}_ms": medians[p] for p in medians},
                        "chosen": chosen, "best": best,
                        "chosen/best": max(paired_ratio(by_round[chosen], by_round[p]) for p in products),
                        "chosen/best unpaired": medians[chosen] / medians[best],
                        **{f"{p}/chosen": medians[p] / medians[chosen] for p in shown}})
    return out


def paired_ratio(mine: dict[int, float], other: dict[int, float]) -> float:
    """The median over the rounds both were timed in of mine / other (round -> ms)."""
    return statistics.median(mine[r] / other[r] for r in sorted(mine.keys() & other.keys()))


def merge_rounds(runs_per_rows: list[list[Run]]) -> list[Run]:
    """One ``Run`` per system and round out of the runs of each row count (``main``): the values of all of them,
    the load before the first and after the last."""
    merged: dict[tuple[str, int], Run] = {}
    for runs in runs_per_rows:
        for run in runs:
            key = (run.system, run.round)
            if key not in merged:
                merged[key] = Run(run.system, run.round, {}, run.load_before, run.load_after)
            merged[key].values.update(run.values)
            merged[key].load_after = run.load_after
    return list(merged.values())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "cpu_gemm")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", default="1,4,16,32,64,128,512,1024,2048", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row count and run (median)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the LM head's most rows (the engine's)")
    parser.add_argument("--int8", action="store_true", help="also time torch's packed int8 product (bfloat16)")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    if not packed_gemm.packed_gemm_available(dtype):
        parser.error(f"this torch / CPU has no oneDNN {args.dtype} product")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    model = build_model(gen, dtype)
    modules = packed_gemm.packable_modules(model)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        table = gemm_timing.plan_table(model, "auto", args.max_num_seqs, cache=ChoiceCache(Path(folder)))
        planning_s = time.perf_counter() - started
    print(table.format())
    print(f"-- plan made in {planning_s:.2f} s")
    products = list(packed_gemm.candidates(modules[0].weight))
    systems = products + ["dispatch"] + (["int8"] if args.int8 and dtype == torch.bfloat16 else [])
    ops = {system: operands(system, modules, table) for system in systems}
    inputs = {k: torch.randn(max(rows_list), k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    metrics = [Metric(f"ms_{rows}_rows", f"ms/step {rows} rows", higher_is_better=False) for rows in rows_list]
    ratios = [Ratio("dispatch", (p,), None, f"dispatch / {p}") for p in products]
    with torch.inference_mode():
        runs = merge_rounds([run_rounds(systems, args.rounds,
                                        lambda system, _round, rows=rows: measure(system, modules, ops[system], inputs,
                                                                                  [rows], args.steps,
                                                                                  args.max_num_seqs),
                                        on_run=print_run)
                             for rows in rows_list])
    choices = choice_rows(runs, table, products, rows_list, args.max_num_seqs,
                          ("int8",) if "int8" in systems else ())
    worst = max(row["chosen/best"] for row in choices)
    worst_unpaired = max(row["chosen/best unpaired"] for row in choices)
    report = finish_rounds("cpu_gemm", args.out, runs, metrics, ratios, vars(args),
                           {"plan": table.format(), "planning_s": planning_s, "choices": choices,
                            "worst_chosen_over_best": worst,
                            "worst_chosen_over_best_unpaired": worst_unpaired, "cpu_model": cpu_choice.cpu_model()})
    print_table(choices, list(choices[0]))
    print(f"-- chosen / best: worst {worst:.3f} paired by round (goal <= {GOAL}), {worst_unpaired:.3f} as a ratio of "
          f"medians; {cpu_choice.cpu_model()}, {args.threads} threads, "
          f"{args.dtype}")
    return report


if __name__ == "__main__":
    main()
