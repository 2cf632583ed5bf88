"""4- and 8-bit weight GEMM on the GPU: ``kernels.quant_gemm`` (GPTQ-packed weights, dequantized tile by tile)
against a dense bf16 ``F.linear`` over the same weight dequantized.

    python -m benchmarks.quant_gemm [--dry-run] [--out PATH]

Shapes: x [M, 4096] bf16 at M in {1, 16, 64, 256, 1024} times W^T [4096, N] for N = 4096 (attention
projections) and 14336 (a Llama-3-8B MLP), 4 bits in groups of 128 with activation order (a permuted
g_idx, laid out by ``group_rows`` as the loader does), 8 bits with one group, and FP8 (e4m3 codes, one
scale per output column: an FP8 checkpoint's per-channel weights, ``float8``). Per row: ms of the default
dispatch, of dense bf16, of each path forced (``fused``: the tiled kernel at its default tiles;
``dequant``: dequantize once, then cuBLAS), and at M <= 64 a sweep of column tiles x K splits (every
timing in the JSON, the best printed); TFLOP/s and weight bytes read per second (codes + zeros + scales)
of the default, and its speed-up over dense bf16 (whose weight is 4x / 2x the bytes). On CUDA every timing
replays a CUDA graph of the call (as the engine's decode does), so Python launch overhead is not counted
on either side. Each configuration is first checked against the torch reference. ``--dry-run``: tiny
shapes on CPU through the Triton interpreter (float16, no graphs, no sweep), numbers meaningless. Goal
(#37): report the 4-bit GEMM throughput; at decode sizes (M <= 16) a weight-bound GEMM reading 4x fewer
bytes should beat dense bf16.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, check_close, time_ms, write_report

# variants: (bits, group, float8)
FULL = dict(rows=(1, 16, 64, 256, 1024), k=4096, outs=(4096, 14336),
            variants=((4, 128, False), (8, 4096, False), (8, 4096, True)), dtype="bfloat16")
DRY = dict(rows=(1, 20), k=64, outs=(48,), variants=((4, 32, False), (8, 64, False), (8, 64, True)), dtype="float16")


def packed_weight(k: int, n: int, bits: int, group: int, device, gen, float8: bool = False):
    """Random codes / zeros / scales in activation order (float8: e4m3 codes but NaN, no zero points, rows in
    order), laid out by ``group_rows`` -> (qweight, zeros, scales, g_idx, perm, group_size) on ``device``."""
    from pagedray.kernels.quant_gemm import group_rows, pack_rows

    codes = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int64)
    zeros = torch.randint(0, 1 << bits, (k // group, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.01).half()
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    if float8:
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)                           # no NaN
        zeros, scales, g_idx = zeros * 0, scales.float(), torch.sort(g_idx).values
    *tensors, perm, group_size = group_rows(pack_rows(codes, bits), zeros, scales, g_idx, bits)
    return [t.to(device) for t in tensors] + [None if perm is None else perm.to(device), group_size]


def graph_ms(fn, on_cuda: bool, rep: int = 100) -> float:
    """Median ms of ``fn``; on CUDA a replay of a CUDA graph of it (no Python launch overhead)."""
    if not on_cuda:
        return time_ms(fn, on_cuda)
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median"))


def sweep(m: int, n: int, k: int, group_size: int, bits: int) -> list[dict]:
    """Configurations around the default for decode-sized M: column tiles x K splits (K slices as the default)."""
    from pagedray.kernels.triton.quant_gemm_triton import quant_gemm_config

    base = quant_gemm_config(m, n, k, group_size, bits, torch.device("cpu"), dense_above=1 << 62)
    slice_rows = base["BLOCK_KW"] * (32 // bits)
    return [base | dict(BLOCK_N=block_n, SPLIT_K=split) for block_n in (32, 64, 128, 256)
            for split in (1, 2, 4, 8, 16, 32) if k // slice_rows // split >= 2]


def bench_one(m: int, n: int, bits: int, group: int, float8: bool, cfg: dict, device, on_cuda: bool) -> dict:
    from pagedray import kernels
    from pagedray.kernels.quant_gemm import dequantize_packed
    from pagedray.kernels.triton.quant_gemm_triton import quant_gemm_config, quant_gemm_triton

    gen = torch.Generator().manual_seed(m * 31 + n + bits)
    dtype, k = getattr(torch, cfg["dtype"]), cfg["k"]
    qweight, zeros, scales, g_idx, perm, group_size = packed_weight(k, n, bits, group, device, gen, float8)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    dense = dequantize_packed(qweight, zeros, scales, g_idx, bits, float8).t().to(dtype).contiguous()   # [N, K]
    x_dense = x if perm is None else x[:, perm.long()].contiguous()       # the dense side multiplies the same rows
    want = kernels.quant_gemm_reference(x, qweight, zeros, scales, g_idx, bits, perm, float8)

    def run_with(config):
        return lambda: quant_gemm_triton(x, qweight, zeros, scales, g_idx, bits, perm, group_size, config, float8)

    default = quant_gemm_config(m, n, k, group_size, bits, device)
    fused = quant_gemm_config(m, n, k, group_size, bits, device, dense_above=1 << 62)
    dequant = quant_gemm_config(m, n, k, group_size, bits, device, dense_above=0)
    timed = {}
    for name, config in (("ms", default), ("fused_ms", fused), ("dequant_ms", dequant)):
        check_close(run_with(config)(), want, f"quant_gemm {name} m={m} n={n} bits={bits} float8={float8}")
        timed[name] = graph_ms(run_with(config), on_cuda)
    dense_ms = graph_ms(lambda: torch.nn.functional.linear(x_dense, dense), on_cuda)
    best, swept = None, []
    if on_cuda and m <= 64:
        for config in sweep(m, n, k, group_size, bits):
            ms = graph_ms(run_with(config), on_cuda, rep=25)
            swept.append(dict(BLOCK_N=config["BLOCK_N"], SPLIT_K=config["SPLIT_K"], ms=ms))
            if best is None or ms < best[0]:
                best = (ms, config)
        check_close(run_with(best[1])(), want, f"quant_gemm best m={m} n={n} bits={bits}")
    nbytes = qweight.numel() * 4 + (0 if float8 else zeros.numel() * 4) + scales.numel() * scales.element_size()
    ms = timed["ms"]
    return dict(m=m, n=n, k=k, bits=bits, group=group, float8=float8, config=default, **timed, dense_ms=dense_ms,
                best_ms=None if best is None else best[0], best_config=None if best is None else best[1], swept=swept,
                tflops=2 * m * n * k / (ms * 1e-3) / 1e12, weight_gbps=nbytes / (ms * 1e-3) / 1e9,
                speedup_vs_dense=dense_ms / ms)


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    rows = [bench_one(m, n, bits, group, float8, cfg, device, on_cuda)
            for bits, group, float8 in cfg["variants"] for n in cfg["outs"] for m in cfg["rows"]]
    print(f"{'bits':>4} {'group':>6} {'N':>6} {'M':>5} {'ms':>8} {'dense ms':>8} {'x dense':>7} {'TFLOP/s':>7} "
          f"{'GB/s':>7} {'fused ms':>8} {'dequant':>8} {'best ms':>8}  best (BLOCK_N, BLOCK_KW, SPLIT_K)")
    for r in rows:
        best = "" if r["best_config"] is None else (f"{r['best_ms']:>8.4f}  {r['best_config']['BLOCK_N']}, "
                                                     f"{r['best_config']['BLOCK_KW']}, {r['best_config']['SPLIT_K']}")
        bits = "fp8" if r["float8"] else r["bits"]
        print(f"{bits:>4} {r['group']:>6} {r['n']:>6} {r['m']:>5} {r['ms']:>8.4f} {r['dense_ms']:>8.4f} "
              f"{r['speedup_vs_dense']:>6.2f}x {r['tflops']:>7.2f} {r['weight_gbps']:>7.1f} {r['fused_ms']:>8.4f} "
              f"{r['dequant_ms']:>8.4f} {best}")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.quant_gemm", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/quant_gemm.json", "pagedray_quant_gemm_dry_run.json")


if __name__ == "__main__":
    main()
