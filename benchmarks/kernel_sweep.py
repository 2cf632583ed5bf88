"""Launch-configuration sweep for the paged kernels: ``python -m benchmarks.kernel_sweep [--dry-run]``.

For a first session on a GPU: times every configuration of a small grid at the benchmark's goal shapes
and prints, per shape, each configuration against the default one (``decode_config``/``prefill_config``)
so the defaults can be set from measurements. Writes JSON (device, date, every row, the best per shape).

* Decode (bf16, 32 q / 8 KV heads, head_dim 128, block 16): batch x context in ``DECODE_SHAPES``;
  ``BLOCK_N`` x ``num_warps`` x ``num_stages`` with the automatic split count, then the default
  configuration at each forced split count in ``DECODE_SPLITS`` (to set ``choose_num_splits``).
  Metric: % of the copy bandwidth measured in the same run (bytes counted as in ``benchmarks.kernels``).
* Prefill (bf16, same heads): 8k-token chunks with history 0 and 8k; ``BLOCK_Q`` (query tokens per tile,
  so ``BLOCK_M = BLOCK_Q * group`` rows) x ``BLOCK_N`` x ``num_warps`` x ``num_stages``. Metric: TFLOP/s.
* Each configuration is first checked against the torch reference on a small slice; one that fails to
  compile (e.g. too much shared memory) or disagrees is recorded with its error and not timed.
* ``--cache-dtype int8|fp8_e4m3``: decode over an 8-bit copy of the cache (``kernels.store_kv``'s codes and
  row scales, as ``benchmarks.kv8_kernel``), bytes counted at 1 per element plus the scales; on a GPU its
  configurations (``kv8_decode_configs``) cross the 16-row and the keys-major forms' tiles with K's code
  conversion (``tile_triton.codes_to``: K_CVT 0 / 1 / 2) and float16 products (``F16_MATH``:
  ``tile_triton.queries_in_f16``) at the launcher's automatic split count (for an 8-bit cache on CUDA the one
  that fills whole waves, ``kernels/triton/occupancy.py``: 3 at batch 64 for the 16-row 128-key tiles, which fit 3 to
  an SM), and the two fastest of them then run at forced split counts (``BEST_AT_SPLITS``);
  ``--decode-shapes 64x8192,...`` and ``--decode-only`` narrow the run (issue #37's goal shape alone).
* ``--dry-run``: tiny shapes and a two-entry grid through the Triton interpreter on CPU (plumbing only).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import pathlib
import sys
import tempfile

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import (
    FULL,
    check_close,
    copy_bandwidth_gbps,
    decode_bytes,
    dry_run_or_cuda,
    paged_kv_case,
    prefill_flops,
    time_ms,
)

DECODE_SHAPES = ((64, 2048), (64, 8192), (256, 2048), (256, 8192), (8, 8192))
DECODE_GRID = dict(BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), maxnreg=(None,))   # no cap
DECODE_SPLITS = (1, 2, 3, 4, 8, 16, 32)   # 3: 512 programs at 3 per SM on 132 SMs fill 4 waves to 97%
BEST_AT_SPLITS = (2, 3, 4)                 # the two fastest 8-bit configurations again at these split counts


KV8_TILES = (   # 16 query rows: (BLOCK_N, warps, stages, K's conversions, registers): sm_90 counts in docs/gpu.md
    (32, 4, 3, (0,), 96),          # the H100's best tile with Triton's cast (5 programs per SM)
    (64, 4, 2, (1, 2), 128),
    (128, 4, 2, (0, 1, 2), 168),   # the default until 2026-11-27 (K_CVT 1)
    (128, 4, 1, (1, 2), 96),       # one stage: 40 KiB, 96 registers hold 5 programs per SM (spilling ~300 B)
    (64, 2, 2, (1, 2), 168),       # 5 programs per SM, about as few instructions per key as 128 / 4
    (64, 1, 2, (2,), None),        # one warp: no reductions across warps; 6 programs per SM
    (32, 1, 3, (2,), None),        # one warp, 8 programs per SM
    (128, 8, 2, (1,), None),
    (256, 8, 2, (1,), None),
)
KV8_KEYS_MAJOR_TILES = (   # the keys-major form (query heads padded to 8 columns), same fields
    (64, 2, 2, (1, 2), None),      # the default (K_CVT 1): 1.66-1.68x bf16 on an H100
    (64, 2, 3, (1,), None),
    (64, 1, 2, (1,), None),
    (128, 4, 2, (1,), 168),
)


def kv8_decode_configs() -> list[dict]:
    """8-bit decode settings for a GPU: ``KV8_TILES`` in the 16-row form and ``KV8_KEYS_MAJOR_TILES`` in the
    keys-major one (``tile_keys_major_triton``), each x ``F16_MATH``, with V converted before its shared copy
    (``V_CVT`` 2). K's conversions: 0 Triton's cast, 1 the asm in registers, 2 the asm before K's shared copy
    (the query then stays in registers). Registers capped where shared memory would hold more programs per SM
    than the compiler's own count allows. The sm_90 compile under the lent machines' Triton 3.6 spills
    280-390 bytes in the one-stage, 96-register tiles and 0-80 bytes in the others (``F16_MATH`` the most):
    the sweep times them as they are. Every entry names its form, so none inherits the default's."""
    forms = ((dict(KEYS_MAJOR=False, BLOCK_G=16), KV8_TILES), (dict(KEYS_MAJOR=True, BLOCK_G=8), KV8_KEYS_MAJOR_TILES))
    return [dict(form, BLOCK_N=n, num_warps=warps, num_stages=stages, K_CVT=k_cvt, V_CVT=2, F16_MATH=f16,
                 maxnreg=regs)
            for form, tiles in forms for n, warps, stages, k_cvts, regs in tiles for k_cvt in k_cvts
            for f16 in (False, True)]


PREFILL_SHAPES = ((8192, 0), (8192, 8192))
PREFILL_GRID = dict(BLOCK_Q=(16, 32, 64), BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3))
DRY = dict(decode_shapes=((3, 70),), decode_grid=dict(BLOCK_N=(16, 32), num_warps=(4,), num_stages=(2,)),
           decode_splits=(1, 3), best_at_splits=(2,),
           prefill_shapes=((40, 0), (24, 30)), prefill_grid=dict(BLOCK_Q=(8, 16), BLOCK_N=(16,), num_warps=(4,),
                                                                 num_stages=(2,)),
           heads=(4, 2), head_dim=64, dtype="float16")
GPU = dict(decode_shapes=DECODE_SHAPES, decode_grid=DECODE_GRID, decode_splits=DECODE_SPLITS,
           prefill_shapes=PREFILL_SHAPES, prefill_grid=PREFILL_GRID, heads=(FULL["q_heads"], FULL["kv_heads"]),
           head_dim=FULL["head_dim"], dtype="bfloat16")


def grid_configs(grid: dict) -> list[dict]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def decode_configs(spec: dict) -> list[dict]:
    return spec.get("decode_configs") or grid_configs(spec["decode_grid"])


def decode_variants(spec: dict) -> list[tuple[dict | None, int | None]]:
    """(config, num_splits) pairs: the default, the grid at automatic splits, the default at forced splits
    (then, with ``best_at_splits``, the two fastest configurations at those splits: ``_best_at_splits``)."""
    return ([(None, None)] + [(config, None) for config in decode_configs(spec)]
            + [(None, splits) for splits in spec["decode_splits"]])


def _best_at_splits(spec: dict, rows: list[dict]) -> list[tuple[dict, int]]:
    """The two fastest configurations of ``rows`` (automatic splits) at each count of ``best_at_splits``."""
    timed = sorted((r for r in rows if isinstance(r["config"], dict) and r["num_splits"] is None and "ms" in r),
                   key=lambda r: r["ms"])
    return [(r["config"], splits) for r in timed[:2] for splits in spec.get("best_at_splits", ())]


def _try_config(run_small, reference, run_full, on_cuda: bool, what: str) -> dict:
    """Check one configuration on a small slice, then time it; errors are recorded, not raised. Each result is
    printed as it comes, so a run cut short by a time limit still shows what it measured."""
    try:
        check_close(run_small(), reference, what)
        result = dict(ms=time_ms(run_full, on_cuda))
    except Exception as exc:   # compile failure (resources) or a wrong result: report, keep sweeping
        result = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    print(f"  {what}: {result}", flush=True)
    return result


def _decode_shape(spec: dict, batch: int, context: int, device, on_cuda: bool, copy_gbps: float) -> list[dict]:
    from pagedray.kernels.reference.attention import paged_decode_reference
    from pagedray.kernels.triton.decode_triton import paged_decode_triton

    dtype = getattr(torch, spec["dtype"])
    hq, hkv = spec["heads"]
    gen = torch.Generator(device=device).manual_seed(batch * 7 + context)
    k_cache, v_cache, tables = paged_kv_case(batch, context, dict(kv_heads=hkv, head_dim=spec["head_dim"],
                                                                   block_size=16), dtype, device, gen)
    q = torch.randn((batch, hq, spec["head_dim"]), dtype=dtype, device=device, generator=gen)   # [B, Hq, D]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale, few, out = 1.0 / math.sqrt(spec["head_dim"]), min(batch, 2), torch.empty_like(q)
    nbytes, scales = decode_bytes(q, context, hkv, spec["head_dim"]), {}
    if spec.get("cache_dtype"):
        from pagedray.kernels.kv_quant import KV_CACHE_DTYPES

        from benchmarks.kv8_kernel import quantized_copy, read_bytes

        cache_dtype = KV_CACHE_DTYPES[spec["cache_dtype"]]
        k_cache, v_cache, k_scale, v_scale = quantized_copy(k_cache, v_cache, cache_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        nbytes = read_bytes(batch, context, dict(kv_heads=hkv, head_dim=spec["head_dim"]), cache_dtype, q)
    args, small = (k_cache, v_cache, tables, lens, scale), (k_cache, v_cache, tables[:few], lens[:few], scale)
    reference = paged_decode_reference(q[:few], *small, **scales)
    def run(config: dict | None, splits: int | None) -> dict:
        result = _try_config(
            lambda: paged_decode_triton(q[:few], *small, config=config, num_splits=splits, **scales), reference,
            lambda: paged_decode_triton(q, *args, out=out, config=config, num_splits=splits, **scales),
            on_cuda, f"decode {config} splits={splits}")
        if "ms" in result:
            result["pct_of_copy"] = 100.0 * nbytes / (result["ms"] * 1e-3) / 1e9 / copy_gbps
        name = config or ("default" if splits is None else f"default, num_splits={splits}")
        return dict(kind="decode", shape=f"b{batch} ctx{context}", cache=spec.get("cache_dtype") or spec["dtype"],
                    config=name, num_splits=splits, **result)

    rows = [run(config, splits) for config, splits in decode_variants(spec)]
    return rows + [run(config, splits) for config, splits in _best_at_splits(spec, rows)]


def _prefill_shape(spec: dict, tokens: int, history: int, device, on_cuda: bool) -> list[dict]:
    from pagedray.kernels.reference.attention import paged_prefill_reference
    from pagedray.kernels.triton.prefill_triton import paged_prefill_triton

    dtype = getattr(torch, spec["dtype"])
    hq, hkv = spec["heads"]
    d = spec["head_dim"]
    gen = torch.Generator(device=device).manual_seed(tokens + 3 * history)
    k_cache, v_cache, tables = paged_kv_case(1, history + tokens, dict(kv_heads=hkv, head_dim=d, block_size=16),
                                             dtype, device, gen)
    q = torch.randn((tokens, hq, d), dtype=dtype, device=device, generator=gen)                 # [T, Hq, D]
    scale, out = 1.0 / math.sqrt(d), torch.empty_like(q)
    tail = min(tokens, 64)   # the check runs the last 64 queries (they see the whole history + chunk)
    seq_lens = torch.tensor([history + tokens], dtype=torch.int32, device=device)
    full_args = (k_cache, v_cache, torch.tensor([0, tokens], dtype=torch.int32, device=device), seq_lens, tables,
                 scale)
    small_args = (k_cache, v_cache, torch.tensor([0, tail], dtype=torch.int32, device=device), seq_lens, tables,
                  scale)
    reference = paged_prefill_reference(q[-tail:], *small_args)
    flops = prefill_flops(tokens, history, hq, d)
    rows = []
    for config in [None] + grid_configs(spec["prefill_grid"]):
        result = _try_config(lambda c=config: paged_prefill_triton(q[-tail:], *small_args, config=c), reference,
                             lambda c=config: paged_prefill_triton(q, *full_args, out=out, config=c), on_cuda,
                             f"prefill {config}")
        if "ms" in result:
            result["tflops"] = flops / (result["ms"] * 1e-3) / 1e12
        rows.append(dict(kind="prefill", shape=f"T{tokens} hist{history}", config=config or "default", **result))
    return rows


def sweep(spec: dict, device, on_cuda: bool, copy_gbps: float) -> list[dict]:
    rows = []
    for batch, context in spec["decode_shapes"]:
        rows += _decode_shape(spec, batch, context, device, on_cuda, copy_gbps)
        if on_cuda:
            torch.cuda.empty_cache()
    for tokens, history in () if spec.get("decode_only") else spec["prefill_shapes"]:
        rows += _prefill_shape(spec, tokens, history, device, on_cuda)
    return rows


def best_per_shape(rows: list[dict]) -> dict[str, dict]:
    best = {}
    for row in rows:
        if "ms" in row and (row["shape"] not in best or row["ms"] < best[row["shape"]]["ms"]):
            best[row["shape"]] = row
    return best


def print_tables(rows: list[dict], copy_gbps: float) -> None:
    print(f"device-to-device copy bandwidth: {copy_gbps:.1f} GB/s")
    default_ms = {r["shape"]: r["ms"] for r in rows if r["config"] == "default" and "ms" in r}
    print(f"{'kind':8} {'shape':16} {'config':58} {'ms':>9} {'metric':>9} {'vs default':>10}")
    for r in rows:
        metric = f"{r['pct_of_copy']:.1f}%" if "pct_of_copy" in r else f"{r.get('tflops', 0):.1f}TF"
        speed = f"{default_ms[r['shape']] / r['ms']:.2f}x" if "ms" in r and r["shape"] in default_ms else "-"
        text = f"{r['ms']:>9.4f} {metric:>9} {speed:>10}" if "ms" in r else r["error"][:60]
        print(f"{r['kind']:8} {r['shape']:16} {str(r['config']):58} {text}")
    print("\nbest per shape:")
    for shape, r in best_per_shape(rows).items():
        print(f"  {shape:16} {str(r['config']):58} {r['ms']:.4f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU via TRITON_INTERPRET=1")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON output path")
    parser.add_argument("--cache-dtype", choices=("int8", "fp8_e4m3"), default=None,
                        help="decode over an 8-bit copy of the cache")
    parser.add_argument("--decode-shapes", default=None, help="batch x context list, e.g. 64x8192,256x2048")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill shapes")
    args = parser.parse_args(argv)
    on_cuda = not dry_run_or_cuda(parser, args, "benchmarks.kernel_sweep")
    device = torch.device("cuda" if on_cuda else "cpu")
    spec = dict(GPU if on_cuda else DRY, cache_dtype=args.cache_dtype, decode_only=args.decode_only)
    if on_cuda and args.cache_dtype:
        spec.update(decode_configs=kv8_decode_configs(), best_at_splits=BEST_AT_SPLITS)
    if args.decode_shapes:
        shapes = args.decode_shapes.split(",")
        spec["decode_shapes"] = tuple(tuple(int(v) for v in shape.split("x")) for shape in shapes)
    copy_gbps = copy_bandwidth_gbps(device, on_cuda)
    rows = sweep(spec, device, on_cuda, copy_gbps)
    print_tables(rows, copy_gbps)
    report = dict(device=torch.cuda.get_device_name(device) if on_cuda else "cpu (TRITON_INTERPRET dry run)",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  dry_run=args.dry_run, torch=torch.__version__, copy_gbps=copy_gbps, rows=rows,
                  best={shape: row["config"] for shape, row in best_per_shape(rows).items()})
    default = pathlib.Path(tempfile.gettempdir()) / "pagedray_kernels_sweep_dry_run.json" if args.dry_run \
        else pathlib.Path("benchmarks/results/kernels_sweep.json")
    out = args.out or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
