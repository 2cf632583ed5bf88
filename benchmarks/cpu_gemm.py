"""The CPU linear layers: pagedray's C GEMM (``kernels.cpu_gemm``) against oneDNN's packed product (what
the layers ran before, and still run without AVX-512) and plain ``F.linear``, in bfloat16 or float32.

What is timed: one "step" of SmolLM2-135M's linear layers at a given row count: 30 layers' q/k/v,
o_proj, gate/up and down_proj, each layer with its own random weights, plus the 49,152-row LM head, so
every weight comes from DRAM as in a real decode step (270 MB in bf16, 540 MB in fp32). Systems:

- ``c_gemm``: tile-packed weights, ``cpu_gemm.linear``.
- ``onednn``: oneDNN-packed weights, ``torch.ops.mkldnn._linear_pointwise``.
- ``f_linear``: ``F.linear`` on the plain weights (re-lays each weight out per call).

ratio = c_gemm / onednn time per row count (lower is better).

    python -m benchmarks.cpu_gemm [--dtype bfloat16|float32] [--rows 1,4,16,64,256,1024] [--threads 2]
        [--rounds 3]
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
from pagedray.kernels import cpu_gemm

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYER_SHAPES = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
SYSTEMS = ("c_gemm", "onednn", "f_linear")


def build(gen: torch.Generator, dtype: torch.dtype) -> dict[str, list]:
    """Per system, the weight operand of every product in one step, in step order."""
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    weights.append((torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype))
    return {"c_gemm": [cpu_gemm.pack(w) for w in weights],
            "onednn": [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights],
            "f_linear": weights}


def product(system: str, x: torch.Tensor, operand) -> torch.Tensor:
    if system == "c_gemm":
        return cpu_gemm.linear(x, operand)
    if system == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, operand, None, "none", [], "")
    return F.linear(x, operand)


def measure(system: str, operands: list, inputs: dict[int, torch.Tensor], rows_list: list[int], steps: int) -> dict:
    values = {}
    for rows in rows_list:
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            for operand, (_, k) in zip(operands, LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]):
                product(system, inputs[k][:rows], operand)
            times.append((time.perf_counter() - start) * 1e3)
        values[f"ms_{rows}_rows"] = statistics.median(times[1:])
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "cpu_gemm")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", default="1,4,16,64,256,1024", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row count and run (median)")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    if not cpu_gemm.available(dtype):
        parser.error(f"kernels.cpu_gemm has no {args.dtype} GEMM here (no AVX-512 / AVX512-BF16, no C compiler, "
                     "or PAGEDRAY_CPU_KERNELS=0)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    operands = build(gen, dtype)
    inputs = {k: torch.randn(max(rows_list), k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    metrics = [Metric(f"ms_{rows}_rows", f"ms/step {rows} rows", higher_is_better=False) for rows in rows_list]
    ratios = [Ratio("c_gemm", ("onednn",), None, "c_gemm / onednn")]
    with torch.inference_mode():
        runs = run_rounds(SYSTEMS, args.rounds,
                          lambda system, _round: measure(system, operands[system], inputs, rows_list, args.steps),
                          on_run=print_run)
    return finish_rounds("cpu_gemm", args.out, runs, metrics, ratios, vars(args))


if __name__ == "__main__":
    main()
