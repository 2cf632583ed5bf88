"""Fused-MoE kernel benchmark: ``python -m benchmarks.moe_kernel [--dry-run] [--out PATH]``.

The Triton grouped-GEMM MoE (``kernels/moe_triton.py``) against the torch loop over experts
(``fused_moe_reference``, what the CPU path runs) on the same inputs, at a Qwen3-30B-A3B-shaped layer
(128 experts, top-8, hidden 2048, expert intermediate 768, bf16) and 1 to 4,096 tokens, routing drawn from
a random router. Prints a table and writes JSON (device, date, every row): milliseconds of each, the
fused kernel's TFLOP/s (2 x routed rows x 3 x hidden x intermediate) and GB/s (the weights of the experts
that got a token, plus x and the output), and the speed-up over the loop. Each row is first checked
against the loop. Timing: ``triton.testing.do_bench`` (median) on CUDA. ``--dry-run``: tiny shapes on CPU
through the Triton interpreter (re-executes itself with ``TRITON_INTERPRET=1``) to check the plumbing; its
numbers mean nothing.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, time_ms, write_report

FULL = dict(experts=128, top_k=8, hidden=2048, inter=768, tokens=(1, 16, 64, 256, 1024, 4096), dtype="bfloat16")
DRY = dict(experts=6, top_k=2, hidden=32, inter=16, tokens=(3, 20), dtype="float16")


def bench(tokens: int, cfg: dict, device: torch.device, on_cuda: bool) -> dict:
    from pagedray import kernels

    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["inter"]
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).to(device)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype).to(device)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype).to(device)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=gen).softmax(-1), top_k, dim=-1)
    args = (x, gate_up, down, weights.to(dtype).to(device), ids.to(device))
    fused = lambda: kernels.fused_moe(*args, use_triton=True)     # noqa: E731
    loop = lambda: kernels.fused_moe(*args, use_triton=False)     # noqa: E731
    tolerance = 5e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(fused().float(), loop().float(), rtol=0, atol=tolerance)
    fused_ms, loop_ms = time_ms(fused, on_cuda), time_ms(loop, on_cuda)
    hit = int(torch.unique(ids).numel())
    elem = x.element_size()
    flops = 2 * tokens * top_k * 3 * hidden * inter
    bytes_moved = hit * 3 * hidden * inter * elem + 2 * tokens * hidden * elem
    return dict(tokens=tokens, experts_hit=hit, fused_ms=fused_ms, loop_ms=loop_ms,
                tflops=flops / fused_ms / 1e9, gbps=bytes_moved / fused_ms / 1e6, speedup=loop_ms / fused_ms)


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    rows = [bench(tokens, cfg, device, on_cuda) for tokens in cfg["tokens"]]
    print(f"{'tokens':>6} {'hit':>4} {'fused ms':>9} {'loop ms':>9} {'TFLOP/s':>8} {'GB/s':>8} {'x loop':>7}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>4} {r['fused_ms']:>9.3f} {r['loop_ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['gbps']:>8.0f} {r['speedup']:>7.2f}")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.moe_kernel", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/moe_kernel.json", "pagedray_moe_bench_dry_run.json")


if __name__ == "__main__":
    main()
