"""Issue #37's goal alone, for a short GPU lease: ``python -m benchmarks.kv8_goal [--rounds N] [--dry-run]``.

The paged decode over an int8 and an fp8 (e4m3) cache against the same decode over the bf16 cache they
were quantized from (``kv8_kernel.quantized_copy``), at the goal's shape: batch 64, 8k context, 32 query /
8 KV heads, head_dim 128, block 16, shuffled blocks, bf16 queries. Goal: >= 1.6x the bf16 decode's calls
per second. Each 8-bit cache runs the launcher's default, the default at one split (the 2-per-SM rule's
count at this shape, against the wave-filling count the launcher now picks) and the candidates the sm_90
compile ranks best (docs/gpu.md; ``python -m benchmarks.sm90_report --kv8-candidates``): ``F16_MATH`` with K
converted before its shared copy; one-warp 32-key tiles (8 programs per SM); the keys-major decode
(``tile_keys_major_triton``: scores as K @ q^T, the 4 query heads padded to 8 columns instead of 16 rows),
alone and with ``F16_MATH``, and under ``F16_MATH`` with K converted in registers (``K_CVT`` 1, which in the
keys-major form issues fewer instructions than ``K_CVT`` 2 under the lent machines' Triton 3.6) in 128-key,
4-warp, 64-key, 2-warp and 64-key, 1-warp tiles (the last the fewest instructions per key, at 6 warps per SM
against 12). None spills registers under Triton 3.9; under the lent machines' 3.6 some
spill 8-56 bytes (the census's ``spill B``). One-stage tiles capped at 96 registers (5 programs, 20 warps per
SM), added on 2026-11-27 to isolate what occupancy buys, were dropped before any GPU ran them: they spill
300-400 bytes, so they would not measure occupancy alone. Every system is checked against the torch reference
on two sequences first; one that fails to compile or disagrees is reported and not timed.

Systems are interleaved over ``--rounds`` rounds (order rotating, ``benchmarks.rounds``); a run is one
``triton.testing.do_bench`` median. Printed: each system's ms and calls/s, median [min-max] over rounds,
and its calls/s over bf16's of the same round. JSON: the runs, the summary, the machine (GPU, torch,
Triton, commit, load average). ``--dry-run``: tiny shapes through the Triton interpreter on CPU (plumbing;
numbers meaningless), the candidates that run there.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import tempfile

import torch
import triton

from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run
from benchmarks.kernels import check_close, dry_run_or_cuda, paged_kv_case, time_ms
from benchmarks.kv8_kernel import quantized_copy
from benchmarks.rounds import Metric, Ratio, run_rounds

GOAL = dict(batch=64, context=8192, q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
            caches=("int8", "fp8_e4m3"))
DRY = dict(batch=3, context=70, q_heads=4, kv_heads=2, head_dim=32, block_size=16, dtype="float16",
           caches=("int8", "fp8_e4m3"))
F16_K2 = dict(F16_MATH=True, K_CVT=2)
KEYS_MAJOR = dict(KEYS_MAJOR=True, BLOCK_G=8)         # tile_keys_major_triton: scores as K @ q^T
CANDIDATES = (   # (name, overrides of decode_triton.decode_config, forced split count or None for automatic)
    ("default", None, None),
    ("default, 1 split", None, 1),
    ("f16 kcvt2", F16_K2, None),
    ("f16 kcvt2 32/1w", dict(F16_K2, BLOCK_N=32, num_warps=1, maxnreg=None), None),
    ("keys-major", KEYS_MAJOR, None),
    ("keys-major f16 kcvt2", dict(KEYS_MAJOR, **F16_K2), None),
    ("keys-major f16", dict(KEYS_MAJOR, F16_MATH=True), None),
    ("keys-major f16 64/2w", dict(KEYS_MAJOR, F16_MATH=True, BLOCK_N=64, num_warps=2, maxnreg=None), None),
    ("keys-major f16 64/1w", dict(KEYS_MAJOR, F16_MATH=True, BLOCK_N=64, num_warps=1, maxnreg=None), None),
)
DRY_CANDIDATES = (("default", None, None), ("default, 1 split", None, 1), ("tiles of 16", dict(BLOCK_N=16), None),
                  ("keys-major", KEYS_MAJOR, None))
BASELINE = "bf16"
GOAL_SPEEDUP = 1.6
METRICS = [Metric("calls_per_s", "decode calls/s"), Metric("ms", "ms per call", higher_is_better=False)]


def build_systems(cfg: dict, candidates, device) -> dict:
    """name -> (decode callable over the full batch, decode callable over two sequences, reference output of
    those two): the 16-bit cache's default, then each 8-bit cache under each candidate."""
    from pagedray.kernels.decode_triton import paged_decode_triton
    from pagedray.kernels.kv_quant import KV_CACHE_DTYPES
    from pagedray.kernels.reference import paged_decode_reference

    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator(device=device).manual_seed(37)
    k16, v16, tables = paged_kv_case(cfg["batch"], cfg["context"], cfg, dtype, device, gen)
    q = torch.randn((cfg["batch"], cfg["q_heads"], cfg["head_dim"]), dtype=dtype, device=device,
                    generator=gen)                                              # [B, Hq, D]
    lens = torch.full((cfg["batch"],), cfg["context"], dtype=torch.int32, device=device)
    scale, out, few = 1.0 / math.sqrt(cfg["head_dim"]), torch.empty_like(q), 2

    def system(k, v, config, splits, scales):
        full = lambda: paged_decode_triton(q, k, v, tables, lens, scale, out=out, config=config,  # noqa: E731
                                           num_splits=splits, **scales)
        small = lambda: paged_decode_triton(q[:few], k, v, tables[:few], lens[:few], scale,  # noqa: E731
                                            config=config, num_splits=splits, **scales)
        return full, small, paged_decode_reference(q[:few], k, v, tables[:few], lens[:few], scale, **scales)

    systems = {BASELINE: system(k16, v16, None, None, {})}
    for cache in cfg["caches"]:
        k8, v8, ks, vs = quantized_copy(k16, v16, KV_CACHE_DTYPES[cache])
        for name, config, splits in candidates:
            systems[f"{cache} {name}"] = system(k8, v8, config, splits, dict(k_scale=ks, v_scale=vs))
    return systems


def checked(systems: dict) -> tuple[dict, dict]:
    """(name -> timed callable for the systems that compile and match their reference, name -> error)."""
    good, errors = {}, {}
    for name, (full, small, reference) in systems.items():
        try:
            check_close(small(), reference, name)
            full()
            good[name] = full
        except Exception as exc:   # noqa: BLE001 - a candidate that fails to compile or disagrees: report it
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"{name}: not timed ({errors[name]})", flush=True)
    return good, errors


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "kv8_goal")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU via TRITON_INTERPRET=1")
    parser.add_argument("--candidates", nargs="+", metavar="NAME", default=None,
                        help="time only these candidates against bf16 (default: all; e.g. 'default' to rerun "
                             "the launcher's default after changing it)")
    args = parser.parse_args(argv)
    on_cuda = not dry_run_or_cuda(parser, args, "benchmarks.kv8_goal")
    cfg, candidates = (GOAL, CANDIDATES) if on_cuda else (DRY, DRY_CANDIDATES)
    if args.candidates is not None:
        unknown = sorted(set(args.candidates) - {name for name, _, _ in candidates})
        if unknown:
            parser.error(f"--candidates: unknown {unknown}; known: {[name for name, _, _ in candidates]}")
        candidates = tuple(c for c in candidates if c[0] in args.candidates)
    timed, errors = checked(build_systems(cfg, candidates, torch.device("cuda" if on_cuda else "cpu")))
    if BASELINE not in timed:
        raise SystemExit(f"the bf16 decode itself failed: {errors[BASELINE]}")

    def measure(system: str, _round: int) -> dict:
        ms = time_ms(timed[system], on_cuda)
        return {"ms": ms, "calls_per_s": 1e3 / ms}

    out = args.out
    if args.dry_run and out == parser.get_default("out"):     # a dry run never overwrites the recorded results
        out = str(pathlib.Path(tempfile.gettempdir()) / "pagedray_kv8_goal_dry_run.json")
    no_wait = {"sleep": lambda _seconds: None} if args.dry_run else {}   # a dry run's load says nothing
    runs = run_rounds(list(timed), args.rounds, measure, on_run=print_run, **no_wait)
    ratios = [Ratio(name, (BASELINE,), ("calls_per_s",), f"{name} / {BASELINE}") for name in timed
              if name != BASELINE]
    report = finish_rounds("kv8_goal", out, runs, METRICS, ratios,
                           dict(cfg, candidates=[list(c) for c in candidates], dry_run=args.dry_run),
                           {"not_timed": errors, "dry_run": args.dry_run, "triton": triton.__version__,
                            "device": torch.cuda.get_device_name() if on_cuda else "cpu (TRITON_INTERPRET dry run)"})
    for ratio in ratios:
        print_ratio(report, ratio.name, "calls_per_s", ratio.name, ">= 1.6x at batch 64, 8k")
    for cache in cfg["caches"]:
        medians = {q.system: report["summary"]["ratios"][q.name]["calls_per_s"] for q in ratios
                   if q.system.startswith(f"{cache} ")}
        medians = {system: stat["median"] for system, stat in medians.items() if stat is not None}
        if medians:
            best = max(medians, key=medians.get)
            verdict = "met" if medians[best] >= GOAL_SPEEDUP else "not met"
            print(f"fastest {cache}: {best}, {medians[best]:.2f}x bf16 (goal >= {GOAL_SPEEDUP}x: {verdict})")
    return report


if __name__ == "__main__":
    main()
