"""Issue #37's goal alone, for a short GPU lease: ``python -m benchmarks.kv8_goal [--rounds N] [--dry-run]``.

The paged decode over an int8 and an fp8 (e4m3) cache against the same decode over the bf16 cache they
were quantized from (``kv8_kernel.quantized_copy``), at the goal's shape: batch 64, 8k context, 32 query /
8 KV heads, head_dim 128, block 16, shuffled blocks, bf16 queries. Goal: >= 1.6x the bf16 decode's calls
per second: met on an H100 on 2026-11-27 (int8 1.66x, fp8 1.68x; docs/gpu.md), by the default this script
then chose, the keys-major decode (``tile_keys_major_triton``: scores as K @ q^T, the 4 query heads padded to
8 columns instead of 16 rows) in 64-key tiles with 2 warps. Each 8-bit cache runs that default, the default
at one split (against the wave-filling count the launcher picks), and the alternatives worth timing again
on another card or Triton, as complete settings (not changes to the default): the 16-row form as it was the
default (128-key tiles, 4 warps: 1.56x on that H100), with ``F16_MATH`` (both products in float16,
``tile_triton.queries_in_f16``) and K converted before its shared copy (``K_CVT`` 2), also in one-warp
32-key tiles (8 programs per SM); the keys-major form in 128-key 4-warp tiles, in 64-key tiles with 3
stages or 1 warp, and with ``F16_MATH`` (fewer sm_90 instructions per key, slower on the H100: 1.52x).
Every system is checked against the torch reference on two sequences first; one that fails to compile or
disagrees is reported and not timed. The sm_90 compile of each (``python -m benchmarks.sm90_report
--kv8-candidates``): registers, spills, instructions per key.

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
SIXTEEN_ROWS = dict(KEYS_MAJOR=False, BLOCK_G=16, BLOCK_N=128, num_warps=4, num_stages=2, K_CVT=1, V_CVT=2,
                    F16_MATH=False, maxnreg=168)     # the launcher's 8-bit default until 2026-11-27
KEYS_MAJOR = dict(SIXTEEN_ROWS, KEYS_MAJOR=True, BLOCK_G=8, BLOCK_N=64, num_warps=2, maxnreg=None)   # the default
CANDIDATES = (   # (name, settings over decode_triton.decode_config's, forced split count or None for automatic)
    ("default", None, None),
    ("default, 1 split", None, 1),
    ("16 rows", SIXTEEN_ROWS, None),
    ("16 rows f16 kcvt2", dict(SIXTEEN_ROWS, F16_MATH=True, K_CVT=2), None),
    ("16 rows f16 kcvt2 32/1w", dict(SIXTEEN_ROWS, F16_MATH=True, K_CVT=2, BLOCK_N=32, num_warps=1, maxnreg=None),
     None),
    ("keys-major 128/4w", dict(SIXTEEN_ROWS, KEYS_MAJOR=True, BLOCK_G=8), None),
    ("keys-major 64/2w 3 stages", dict(KEYS_MAJOR, num_stages=3), None),
    ("keys-major 64/1w", dict(KEYS_MAJOR, num_warps=1), None),
    ("keys-major f16 kcvt2", dict(SIXTEEN_ROWS, KEYS_MAJOR=True, BLOCK_G=8, F16_MATH=True, K_CVT=2), None),
    ("keys-major f16 64/2w", dict(KEYS_MAJOR, F16_MATH=True), None),
    ("keys-major f16 64/1w", dict(KEYS_MAJOR, F16_MATH=True, num_warps=1), None),
)
DRY_CANDIDATES = (("default", None, None), ("default, 1 split", None, 1), ("tiles of 16", dict(BLOCK_N=16), None),
                  ("keys-major", dict(KEYS_MAJOR=True, BLOCK_G=8), None))
BASELINE = "bf16"
GOAL_SPEEDUP = 1.6
METRICS = [Metric("calls_per_s", "decode calls/s"), Metric("ms", "ms per call", higher_is_better=False)]


def build_systems(cfg: dict, candidates, device) -> dict:
    """name -> (decode callable over the full batch, decode callable over two sequences, reference output of
    those two): the 16-bit cache's default, then each 8-bit cache under each candidate."""
    from pagedray.kernels.kv_quant import KV_CACHE_DTYPES
    from pagedray.kernels.reference.attention import paged_decode_reference
    from pagedray.kernels.triton.decode_triton import paged_decode_triton

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
