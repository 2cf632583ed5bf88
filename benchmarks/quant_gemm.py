"""4- and 8-bit weight GEMM on the GPU: ``kernels.quant_gemm`` (GPTQ-packed weights, dequantized tile by tile)
against a dense bf16 ``F.linear`` over the same weight dequantized.

    python -m benchmarks.quant_gemm [--dry-run] [--out PATH]

Shapes: x [M, 4096] bf16 at M in {1, 16, 64, 256, 1024} times W^T [4096, N] for N = 4096 (attention
projections) and 14336 (a Llama-3-8B MLP), 4 bits in groups of 128 with activation order (a permuted
g_idx) and 8 bits with one group. Per row: ms (``triton.testing.do_bench`` median), TFLOP/s, weight bytes
read per second (codes + zeros + scales), and the speed-up over dense bf16 (whose weight is 4x / 2x the
bytes). Each configuration is first checked against the torch reference. ``--dry-run``: tiny shapes on
CPU through the Triton interpreter (float16), numbers meaningless. Goal (#37): report the 4-bit GEMM
throughput; at decode sizes (M <= 16) a weight-bound GEMM reading 4x fewer bytes should beat dense bf16.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, check_close, time_ms, write_report

FULL = dict(rows=(1, 16, 64, 256, 1024), k=4096, outs=(4096, 14336), variants=((4, 128), (8, 4096)),
            dtype="bfloat16")
DRY = dict(rows=(1, 20), k=64, outs=(48,), variants=((4, 32), (8, 64)), dtype="float16")


def packed_weight(k: int, n: int, bits: int, group: int, device, gen):
    """Random codes / zeros / scales packed as ``kernels.quant_gemm`` takes them (activation order)."""
    per_word = 32 // bits
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int64)
    words = (codes.view(k // per_word, per_word, n) << (bits * torch.arange(per_word))[None, :, None]).sum(1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    zeros = torch.randint(0, 1 << bits, (k // group, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.01).half()
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    return [t.to(device) for t in (qweight, zeros, scales, g_idx)]


def bench_one(m: int, n: int, bits: int, group: int, cfg: dict, device, on_cuda: bool) -> dict:
    from pagedray import kernels
    from pagedray.kernels.quant_gemm import dequantize_packed

    gen = torch.Generator().manual_seed(m * 31 + n + bits)
    dtype = getattr(torch, cfg["dtype"])
    qweight, zeros, scales, g_idx = packed_weight(cfg["k"], n, bits, group, device, gen)
    x = torch.randn(m, cfg["k"], generator=gen).to(dtype).to(device)
    dense = dequantize_packed(qweight, zeros, scales, g_idx, bits).t().to(dtype).contiguous()   # [N, K] for F.linear
    check_close(kernels.quant_gemm(x[:4], qweight, zeros, scales, g_idx, bits, use_triton=True),
                kernels.quant_gemm_reference(x[:4], qweight, zeros, scales, g_idx, bits), f"quant_gemm m={m} n={n}")
    ms = time_ms(lambda: kernels.quant_gemm(x, qweight, zeros, scales, g_idx, bits, use_triton=True), on_cuda)
    dense_ms = time_ms(lambda: torch.nn.functional.linear(x, dense), on_cuda)
    nbytes = qweight.numel() * 4 + zeros.numel() * 4 + scales.numel() * 2
    return dict(m=m, n=n, k=cfg["k"], bits=bits, group=group, ms=ms, dense_ms=dense_ms,
                tflops=2 * m * n * cfg["k"] / (ms * 1e-3) / 1e12, weight_gbps=nbytes / (ms * 1e-3) / 1e9,
                speedup_vs_dense=dense_ms / ms)


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    rows = [bench_one(m, n, bits, group, cfg, device, on_cuda)
            for bits, group in cfg["variants"] for n in cfg["outs"] for m in cfg["rows"]]
    print(f"{'bits':>4} {'group':>6} {'N':>6} {'M':>5} {'ms':>9} {'dense ms':>9} {'TFLOP/s':>8} {'GB/s':>8} "
          f"{'x dense':>8}")
    for r in rows:
        print(f"{r['bits']:>4} {r['group']:>6} {r['n']:>6} {r['m']:>5} {r['ms']:>9.4f} {r['dense_ms']:>9.4f} "
              f"{r['tflops']:>8.2f} {r['weight_gbps']:>8.1f} {r['speedup_vs_dense']:>7.2f}x")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.quant_gemm", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/quant_gemm.json", "pagedray_quant_gemm_dry_run.json")


if __name__ == "__main__":
    main()
