"""Does ``torch.compile`` (inductor) pay on pagedray's CPU decoder layers? Eager vs compiled, same inputs.

What is timed: the part of 30 decoder layers that a compiled forward could fuse, the post-attention
half of each layer (o_proj -> residual add + RMSNorm -> merged gate/up -> SiLU * up -> down_proj), at a
decode batch of ``--rows`` tokens, SmolLM2-135M's shapes, random weights, every layer its own weights
(so they come from DRAM, as in a real step). Systems:

- ``eager``: what the worker runs: packed linear layers (``layers/packed_gemm.py``; oneDNN's when the
  result below was measured, the C GEMM of ``kernels.cpu_gemm`` since), the
  residual add + RMSNorm in one C call and SiLU * up as torch ops (``pagedray.kernels``' CPU path).
- ``compiled``: the same module under ``torch.compile(dynamic=True)``; the packed product is a
  registered custom op so the graph has no break (dynamo cannot hand inductor the opaque oneDNN
  weight: its linear lowering wants a frozen constant), and inductor fuses the elementwise chains
  (RMSNorm written as transformers' torch ops, so that it can).
- ``compiled_inductor_gemm``: ``torch.compile`` with plain weights, so inductor picks the GEMMs
  (its own ``F.linear`` lowering; no packing).

ratio = system / eager time (lower is better). Compile time is logged per system and outside the timing.

    python -m benchmarks.compiled_layer [--dtype bfloat16|float32] [--rows 16] [--threads 2] [--rounds 3]

Result (2-core AMD EPYC VM, 2026-11-25, 2 threads, 16 rows, 3 interleaved rounds; ``benchmarks/results/
compiled_layer_{bfloat16,float32}.json``): compiled / eager = 1.07x [1.05-1.12] in bf16 and 1.07x
[1.07-1.10] in fp32 (slower), compiled_inductor_gemm / eager = 1.35x and 2.51x. Per-call guard and
wrapper costs outweigh what fusing the residual add, RMSNorm and SiLU * up saves at decode sizes of
a small model, and inductor's own GEMMs are slower than the packed oneDNN ones, so the worker stays
eager (and has no ``enforce_eager`` escape to offer on CPU). The first-call times include inductor's
on-disk cache: a cold compile of the custom-op variant took 4-14 s in the probe this script grew from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from pagedray import kernels
from pagedray.workers.layers.activation import silu_and_mul
from pagedray.workers.layers.packed_gemm import linear, pack_weight

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

HIDDEN, INTERMEDIATE, LAYERS, EPS = 576, 1536, 30, 1e-5
SYSTEMS = ("eager", "compiled", "compiled_inductor_gemm")
METRICS = [Metric("ms_per_step", "ms / 30 layers", higher_is_better=False)]
RATIOS = [Ratio(system, ("eager",), None, f"{system} / eager") for system in SYSTEMS[1:]]

_PACKED_BY_WEIGHT: dict[int, torch.Tensor] = {}   # weight data_ptr -> its packed copy (this script only)


@torch.library.custom_op("pagedray_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x [rows, in], weight [out, in] -> [rows, out] through the weight's packed copy
    return linear(x, weight, None, _PACKED_BY_WEIGHT[weight.data_ptr()])


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PostAttention(torch.nn.Module):
    """o_proj, residual add + RMSNorm, gate/up, SiLU * up, down_proj of one layer (``mode`` picks the GEMM)."""

    def __init__(self, dtype: torch.dtype, mode: str, gen: torch.Generator) -> None:
        super().__init__()
        self.mode = mode

        def weight(out_features: int, in_features: int) -> torch.nn.Parameter:
            w = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(dtype)
            _PACKED_BY_WEIGHT[w.data_ptr()] = pack_weight(w)
            return torch.nn.Parameter(w, requires_grad=False)

        self.o_proj, self.gate_up, self.down = weight(HIDDEN, HIDDEN), weight(2 * INTERMEDIATE, HIDDEN), \
            weight(HIDDEN, INTERMEDIATE)
        self.norm_weight = torch.nn.Parameter((1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
                                              requires_grad=False)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.mode == "eager":
            return linear(x, weight, None, _PACKED_BY_WEIGHT[weight.data_ptr()])
        if self.mode == "compiled":
            return packed_linear(x, weight)
        return F.linear(x, weight)

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # attn, residual [rows, hidden] -> (mlp output, new residual), both [rows, hidden]
        out = self._linear(attn, self.o_proj)
        if self.mode == "eager":
            hidden, residual = kernels.rms_norm(out, self.norm_weight, EPS, residual)
        else:
            residual = out + residual
            x = residual.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)      # RMSNorm as transformers'
            hidden = self.norm_weight * x.to(residual.dtype)
        return self._linear(silu_and_mul(self._linear(hidden, self.gate_up)), self.down), residual


def build(system: str, dtype: torch.dtype, rows: int) -> tuple[list, float]:
    """The 30 layers' callables for ``system`` and the seconds their first call took (compile time)."""
    gen = torch.Generator().manual_seed(0)
    mode = "inductor" if system == "compiled_inductor_gemm" else system
    layers = [PostAttention(dtype, mode, gen) for _ in range(LAYERS)]
    calls = layers if system == "eager" else [torch.compile(layer, dynamic=True) for layer in layers]
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    start = time.perf_counter()
    with torch.inference_mode():
        for call in calls:
            call(x, x)
    return calls, time.perf_counter() - start


def measure(calls: list, dtype: torch.dtype, rows: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    attn, residual = (torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            start = time.perf_counter()
            for call in calls:
                call(attn, residual)
            times.append((time.perf_counter() - start) * 1e3)
    return {"ms_per_step": statistics.median(times[2:])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "compiled_layer")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    built = {system: build(system, dtype, args.rows) for system in SYSTEMS}
    for system, (_, seconds) in built.items():
        print(f"{system}: first call (compile) {seconds:.1f} s", flush=True)
    runs = run_rounds(SYSTEMS, args.rounds, lambda system, _round: measure(built[system][0], dtype, args.rows,
                                                                           args.steps), on_run=print_run)
    return finish_rounds("compiled_layer", args.out, runs, METRICS, RATIOS, vars(args),
                         {"first_call_s": {system: seconds for system, (_, seconds) in built.items()}})


if __name__ == "__main__":
    main()
