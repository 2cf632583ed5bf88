"""Fused-MoE kernel benchmark: ``python -m benchmarks.moe_kernel [--dry-run] [--out PATH]``.

The Triton grouped-GEMM MoE (``kernels/triton/moe_triton.py``) against the torch loop over experts
(``fused_moe_reference``, what the CPU path runs) on the same inputs, at a Qwen3-30B-A3B-shaped layer
(128 experts, top-8, hidden 2048, expert intermediate 768, bf16) and 1 to 4,096 tokens, routing drawn from
a random router. Prints a table and writes JSON (device, date, every row): milliseconds of each, the
fused kernel's TFLOP/s (2 x routed rows x 3 x hidden x intermediate) and GB/s (the weights of the experts
that got a token, plus x and the output), and the speed-up over the loop. Packed experts: the same layer's
experts rounded to 4 bits (round to nearest, groups of 128 along the input, zero points; GPTQ's layout, as
a quantized checkpoint's experts stay on CUDA) through the packed grouped GEMM, its ms and its speed against
the bf16 fused kernel; and the same experts in MXFP4 (e2m1 codes, a power-of-two scale per 32 inputs: how
gpt-oss's experts stay on CUDA), its ms and speed against bf16. Each row is first checked against the loop
(the packed ones on their dequantized experts). Timing: ``triton.testing.do_bench`` (median) on CUDA.
``--dry-run``: tiny shapes on CPU through the Triton interpreter (re-executes itself with
``TRITON_INTERPRET=1``) to check the plumbing; its numbers mean nothing.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, time_ms, write_report

FULL = dict(experts=128, top_k=8, hidden=2048, inter=768, tokens=(1, 16, 64, 256, 1024, 4096), dtype="bfloat16",
            group=128)
DRY = dict(experts=6, top_k=2, hidden=32, inter=32, tokens=(3, 20), dtype="float16", group=16)


def pack_4bit(w: torch.Tensor, group: int):
    """w [E, N, K] -> ``PackedExperts`` of its 4-bit round-to-nearest (asymmetric, ``group`` input rows per
    scale), on w's device."""
    from pagedray.kernels.quant_gemm import PackedExperts, pack_rows

    experts, n, k = w.shape
    wt = w.float().transpose(1, 2).reshape(experts, k // group, group, n)          # [E, G, group, N]
    low, high = wt.amin(2), wt.amax(2)                                            # [E, G, N]
    scales = ((high - low) / 15).clamp_(min=1e-8)
    zeros = torch.round(-low / scales).clamp_(0, 15)
    codes = torch.clamp(torch.round(wt / scales[:, :, None]) + zeros[:, :, None], 0, 15).reshape(experts, k, n)
    qweight = torch.stack([pack_rows(c.cpu(), 4) for c in codes]).to(w.device)
    g_idx = (torch.arange(k, device=w.device) // group).to(torch.int32)
    return PackedExperts(qweight, zeros.to(torch.int32), scales.half(), g_idx, 4, group)


def pack_mxfp4(w: torch.Tensor):
    """w [E, N, K] -> float4 ``PackedExperts``: per 32 inputs of an output row the smallest power of two that fits
    max |w| in 6, each value rounded to the nearest e2m1 value (MXFP4, as gpt-oss's checkpoints store experts)."""
    from pagedray.kernels.quant_gemm import E2M1_VALUES, PackedExperts, pack_rows

    experts, n, k = w.shape
    groups = w.float().transpose(1, 2).reshape(experts, k // 32, 32, n)              # [E, G, 32, N]
    scales = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(2).clamp_min(2.0 ** -100) / 6.0)))   # [E, G, N]
    lut = torch.tensor(E2M1_VALUES, device=w.device)
    codes = ((groups / scales[:, :, None])[..., None] - lut).abs().argmin(-1).reshape(experts, k, n)
    qweight = torch.stack([pack_rows(c.cpu(), 4) for c in codes]).to(w.device)
    g_idx = (torch.arange(k, device=w.device) // 32).to(torch.int32)
    return PackedExperts(qweight, torch.zeros(scales.shape, dtype=torch.int32, device=w.device), scales, g_idx, 4,
                         32, float4=True)


def layer(cfg: dict, device: torch.device) -> tuple:
    """The experts of one layer -> (gate_up, down, their 4-bit packed forms, their MXFP4 forms), made once per run."""
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = cfg["experts"], cfg["hidden"], cfg["inter"]
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype).to(device)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype).to(device)
    return (gate_up, down, (pack_4bit(gate_up, cfg["group"]), pack_4bit(down, cfg["group"])),
            (pack_mxfp4(gate_up), pack_mxfp4(down)))


def bench(tokens: int, cfg: dict, device: torch.device, on_cuda: bool, experts_of_layer: tuple) -> dict:
    from pagedray import kernels

    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["inter"]
    gate_up, down, packed, mxfp4 = experts_of_layer
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).to(device)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=gen).softmax(-1), top_k, dim=-1)
    args = (x, gate_up, down, weights.to(dtype).to(device), ids.to(device))
    fused = lambda: kernels.fused_moe(*args, use_triton=True)     # noqa: E731
    loop = lambda: kernels.fused_moe(*args, use_triton=False)     # noqa: E731
    tolerance = 5e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(fused().float(), loop().float(), rtol=0, atol=tolerance)
    fused_ms, loop_ms = time_ms(fused, on_cuda), time_ms(loop, on_cuda)

    def packed_ms(pair) -> float:     # checked against the loop on the same experts dequantized, then timed
        fused_packed = lambda: kernels.fused_moe(x, *pair, *args[3:], use_triton=True)     # noqa: E731
        on_dequantized = kernels.fused_moe(x, pair[0].dequantized(dtype), pair[1].dequantized(dtype), *args[3:],
                                           use_triton=False)
        torch.testing.assert_close(fused_packed().float(), on_dequantized.float(), rtol=0, atol=tolerance)
        return time_ms(fused_packed, on_cuda)

    packed4_ms, mxfp4_ms = packed_ms(packed), packed_ms(mxfp4)
    hit = int(torch.unique(ids).numel())
    elem = x.element_size()
    flops = 2 * tokens * top_k * 3 * hidden * inter
    bytes_moved = hit * 3 * hidden * inter * elem + 2 * tokens * hidden * elem
    return dict(tokens=tokens, experts_hit=hit, fused_ms=fused_ms, loop_ms=loop_ms,
                tflops=flops / fused_ms / 1e9, gbps=bytes_moved / fused_ms / 1e6, speedup=loop_ms / fused_ms,
                packed4_ms=packed4_ms, packed4_vs_fused=fused_ms / packed4_ms, mxfp4_ms=mxfp4_ms,
                mxfp4_vs_fused=fused_ms / mxfp4_ms)


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    experts_of_layer = layer(cfg, device)
    rows = [bench(tokens, cfg, device, on_cuda, experts_of_layer) for tokens in cfg["tokens"]]
    print(f"{'tokens':>6} {'hit':>4} {'fused ms':>9} {'loop ms':>9} {'TFLOP/s':>8} {'GB/s':>8} {'x loop':>7} "
          f"{'4-bit ms':>9} {'x bf16':>7} {'mxfp4 ms':>9} {'x bf16':>7}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>4} {r['fused_ms']:>9.3f} {r['loop_ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['gbps']:>8.0f} {r['speedup']:>7.2f} {r['packed4_ms']:>9.3f} {r['packed4_vs_fused']:>7.2f} "
              f"{r['mxfp4_ms']:>9.3f} {r['mxfp4_vs_fused']:>7.2f}")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.moe_kernel", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/moe_kernel.json", "pagedray_moe_bench_dry_run.json")


if __name__ == "__main__":
    main()
