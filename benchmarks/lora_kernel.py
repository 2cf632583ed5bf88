"""The LoRA product of a mixed batch against the dense-merged product (#63):
``python -m benchmarks.lora_kernel [--device cuda] [--tokens 64] [--adapters 8] [--rank 16] [--rounds 3]``

One linear layer of each ``--shape`` (in x out), ``--tokens`` rows spread round-robin over ``--adapters`` random
adapters of rank ``--rank`` (every row with one), in the device's serving dtype (bf16 on CUDA, the CPU's
choice on CPU). Systems, interleaved by rounds, each timed over ``--repeats`` calls (CUDA: synchronized):

- ``base``: ``x @ W^T``, the layer alone;
- ``lora``: the base product, then the adapters' product added in place by the engine's kernel for the device
  (``LoraLinearSlots.add_delta``: two Triton launches on CUDA, one C call on CPU);
- ``merged``: ``x @ (W + scale * B @ A)^T`` for one adapter merged into the weight ahead of time (what serving
  a single fine-tune as its own model runs: the product LoRA serving is compared with).

Before timing, the ``lora`` rows are checked against the dense reference ``x @ (W + scale_s B_s A_s)^T`` per
row in float32 (max error printed and written). Reported: microseconds per call, median [min-max], and the
ratios lora / base and lora / merged.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np
import torch

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

# SmolLM2-135M's q and down projections, a 7-8B model's q/o, gate/up and down
SHAPES = ("576x576", "1536x576", "4096x4096", "4096x14336", "14336x4096")


def build(shape: str, tokens: int, adapters: int, rank: int, device: torch.device, dtype: torch.dtype, seed: int):
    """(x, W, merged W, the layer's LoRA slots with their batch set) for one shape."""
    from pagedray.workers.lora.slots import LoraBatch, LoraLinearSlots

    fan_in, fan_out = map(int, shape.split("x"))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, fan_in, generator=gen).to(device, dtype)                       # [tokens, in]
    w = (torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5).to(device, dtype)    # [out, in]
    batch = LoraBatch(device, adapters)
    slots = LoraLinearSlots(["q_proj"], [fan_out], [None], fan_in, None, adapters, rank, dtype, device, batch)
    pairs = []
    for slot in range(adapters):
        a = torch.randn(rank, fan_in, generator=gen) * 0.02                                 # [r, in]
        b = torch.randn(fan_out, rank, generator=gen) * 0.02                                # [out, r]
        slots.a[slot, :rank].copy_(a)
        slots.e[slot, :rank].copy_(b.T)
        batch.set_scale(slot, 2.0)
        pairs.append((a, b))
    batch.set(np.arange(tokens, dtype=np.int64) % adapters)
    a0, b0 = pairs[0]
    merged = (w.float() + 2.0 * (b0 @ a0).to(device)).to(dtype)                            # [out, in]
    return x, w, merged, slots, pairs


def max_error(x, w, slots, pairs) -> float:
    """Largest |lora - dense reference| over the rows, relative to the reference's largest magnitude."""
    y = x @ w.T
    slots.add_delta(x, y)
    xf, wf = x.float().cpu(), w.float().cpu()
    worst, scale = 0.0, 0.0
    for row, slot in enumerate(slots.batch.slots.cpu().tolist()):
        a, b = pairs[slot]
        expected = xf[row] @ (wf + 2.0 * b @ a).T                                           # [out]
        worst = max(worst, float((y[row].float().cpu() - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
    return worst / scale


def time_us(fn, repeats: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.lora_kernel", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "lora_kernel")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from pagedray.workers.weights.dtype_choice import resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device).dtype
    cases = {shape: build(shape, args.tokens, args.adapters, args.rank, device, dtype, args.seed + i)
             for i, shape in enumerate(args.shapes)}
    errors = {shape: max_error(x, w, slots, pairs) for shape, (x, w, _, slots, pairs) in cases.items()}
    for shape, error in errors.items():
        print(f"{shape}: lora against the dense reference, max relative error {error:.2e} ({dtype})")

    def measure(system: str, _round: int) -> dict:
        values = {}
        for shape, (x, w, merged, slots, _) in cases.items():
            if system == "base":
                fn = lambda x=x, w=w: x @ w.T                                             # noqa: E731
            elif system == "merged":
                fn = lambda x=x, merged=merged: x @ merged.T                              # noqa: E731
            else:
                def fn(x=x, w=w, slots=slots):
                    slots.add_delta(x, x @ w.T)
            values[f"us_{shape}"] = time_us(fn, args.repeats, device)
        return values

    runs = run_rounds(["base", "lora", "merged"], args.rounds, measure, on_run=print_run)
    metrics = [Metric(f"us_{shape}", f"{shape} us", higher_is_better=False) for shape in args.shapes]
    ratios = [Ratio("lora", (peer,), (f"us_{shape}",), f"{shape} lora / {peer}")
              for shape in args.shapes for peer in ("base", "merged")]
    return finish_rounds("lora_kernel", args.out, runs, metrics, ratios, {**vars(args), "dtype": str(dtype)},
                         {"max_relative_error": errors})


if __name__ == "__main__":
    main()
