"""Gated delta rule kernel benchmark: ``python -m benchmarks.gated_delta_kernel [--dry-run] [--out PATH]``.

The two Triton kernels of ``kernels/triton/gated_delta_triton.py`` on one Qwen3.5-shaped linear-attention layer
(32 value heads, key and value head dim 128, bf16 inputs, float32 states in a pool): the chunked kernel (what a
step with prompt tokens runs) against the recurrent one (token by token; what decode steps run, and what every
step ran before the chunked kernel), and the torch path (``chunked_reference`` per sequence, what the CPU runs),
on steps of ``seqs x tokens``: one long prompt, several prompts, many short ones, and a decode step (one token
each). Prints a table and writes JSON (device, date, every row): milliseconds of each and the chunked kernel's
speed against the recurrent one and against torch. Each row is first checked: the chunked kernel's outputs and
states against the recurrent kernel's from the same pool (largest difference printed). Timing:
``triton.testing.do_bench`` (median) on CUDA, each call from the same starting pool (the kernels update states in
place; the values they reach do not change the work). ``--dry-run``: tiny shapes on CPU through the Triton
interpreter (re-executes itself with ``TRITON_INTERPRET=1``) to check the plumbing; its numbers mean nothing.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, time_ms, write_report

FULL = dict(heads=32, key_dim=128, value_dim=128, dtype="bfloat16",
            steps=((1, 512), (1, 4096), (4, 2048), (16, 256), (64, 1)))
DRY = dict(heads=2, key_dim=16, value_dim=16, dtype="float16", steps=((1, 40), (3, 9), (4, 1)))


def step_inputs(seqs: int, tokens: int, cfg: dict, device: torch.device) -> tuple:
    """One step of ``seqs`` sequences of ``tokens`` each, continuing random states -> gated_delta_varlen's args."""
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(seqs * 10_000 + tokens)
    total, heads, dk, dv = seqs * tokens, cfg["heads"], cfg["key_dim"], cfg["value_dim"]
    q = torch.randn(total, heads, dk, generator=gen).to(dtype)                        # [T, H, Dk]
    k = torch.randn(total, heads, dk, generator=gen).to(dtype)
    v = torch.randn(total, heads, dv, generator=gen).to(dtype)                        # [T, H, Dv]
    g = -torch.rand(total, heads, generator=gen)                                      # log decays in (-1, 0]
    beta = torch.rand(total, heads, generator=gen)
    pool = torch.randn(seqs + 1, heads, dk, dv, generator=gen) * 0.1                  # [slots, H, Dk, Dv]
    slots = torch.arange(seqs, dtype=torch.int64)
    cu = torch.arange(0, total + 1, tokens, dtype=torch.int32)                         # [seqs + 1]
    fresh = torch.zeros(seqs, dtype=torch.bool)
    return tuple(x.to(device) for x in (q, k, v, g, beta, pool, slots, cu, fresh))


def bench(seqs: int, tokens: int, cfg: dict, device: torch.device, on_cuda: bool) -> dict:
    from pagedray.kernels.gated_delta import gated_delta_varlen

    q, k, v, g, beta, pool, slots, cu, fresh = step_inputs(seqs, tokens, cfg, device)
    start = pool.clone()

    def call(use_triton: bool, chunked: bool):
        def run():
            pool.copy_(start)
            return gated_delta_varlen(q, k, v, g, beta, pool, slots, cu, fresh, use_triton=use_triton,
                                      chunked=chunked)
        return run

    chunked, recurrent, torch_path = call(True, True), call(True, False), call(False, False)
    out_chunked = chunked()
    states_chunked = pool.clone()
    out_recurrent = recurrent()
    out_error = float((out_chunked - out_recurrent).abs().max())
    state_error = float((states_chunked - pool).abs().max())
    scale = float(out_recurrent.abs().max())
    if not out_error <= 1e-3 * max(scale, 1.0) or not state_error <= 1e-3 * max(float(pool.abs().max()), 1.0):
        raise AssertionError(f"{seqs}x{tokens}: the chunked kernel differs from the recurrent one by {out_error:.2e} "
                             f"(outputs, largest {scale:.2e}) / {state_error:.2e} (states)")
    copy_ms = time_ms(lambda: pool.copy_(start), on_cuda)                 # every timed call starts with this copy
    chunked_ms = time_ms(chunked, on_cuda) - copy_ms
    recurrent_ms = time_ms(recurrent, on_cuda) - copy_ms
    torch_ms = time_ms(torch_path, on_cuda) - copy_ms
    return dict(seqs=seqs, tokens=tokens, chunked_ms=chunked_ms, recurrent_ms=recurrent_ms, torch_ms=torch_ms,
                vs_recurrent=recurrent_ms / chunked_ms, vs_torch=torch_ms / chunked_ms,
                max_out_diff=out_error, max_state_diff=state_error)


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    rows = [bench(seqs, tokens, cfg, device, on_cuda) for seqs, tokens in cfg["steps"]]
    print(f"{'step':>9} {'chunked ms':>11} {'recurrent ms':>13} {'torch ms':>9} {'x recurrent':>12} {'x torch':>8} "
          f"{'max diff':>9}")
    for r in rows:
        print(f"{r['seqs']:>4}x{r['tokens']:<4} {r['chunked_ms']:>11.3f} {r['recurrent_ms']:>13.3f} "
              f"{r['torch_ms']:>9.3f} {r['vs_recurrent']:>12.2f} {r['vs_torch']:>8.2f} {r['max_out_diff']:>9.1e}")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.gated_delta_kernel", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/gated_delta_kernel.json", "pagedray_gated_delta_bench_dry_run.json")


if __name__ == "__main__":
    main()
