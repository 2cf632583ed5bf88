"""This checkout's CPU C kernels against git commit REF's, in one process: before and after a change to the
C sources. ``python -m benchmarks.c_kernels_ref [--ref HEAD] [--rounds 3] [--dry-run]``

Both libraries of each kernel (cpu_decode, cpu_prefill, cpu_fused, cpu_gemm) are built from their sources
(REF's from a git worktree of REF) and loaded side by side. The Python wrappers of this checkout call
either one, so REF's C functions must take this checkout's arguments. Systems ``this`` and ``REF`` take
turns by rounds (``benchmarks.rounds``); one run times every case once on its library (microseconds per
call, the mean over at least 50 ms of calls after one warm-up call).

The cases are SmolLM2-135M's shapes, in bfloat16 and float32:
- the GEMM on the four weight shapes at 1 / 16 / 128 / 512 rows (the LM head at 1 / 16);
- SiLU * up, RMSNorm with the residual, and rotary at 1 / 16 / 512 rows;
- paged decode (16 sequences x 512 tokens, 64 x 256, 16 x 4,096: 50 MB of bfloat16 KV, more than a 32 MiB L3);
- paged prefill of one prompt of 512 and of 2,048 tokens, and of 16 prompts of 100 (a serving wave).

The table gives each case's median [min-max] per system and the ratio this / REF (lower is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
from pagedray.kernels.cpu import cpu_build, cpu_decode, cpu_fused, cpu_gemm, cpu_prefill

from benchmarks.common import add_round_args, finish_rounds, print_run, ref_import_root
from benchmarks.rounds import Metric, Ratio, run_rounds

MODULES = {"cpu_decode": cpu_decode, "cpu_fused": cpu_fused, "cpu_gemm": cpu_gemm, "cpu_prefill": cpu_prefill}
THIS = "this"


def c_source(root: pathlib.Path, name: str) -> pathlib.Path:
    """``name``.c under a checkout's kernels/ (kernels/cpu/ since #62's rooms, kernels/ before)."""
    for candidate in (root / "kernels" / "cpu" / f"{name}.c", root / "kernels" / f"{name}.c"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}.c under {root / 'kernels'}")


def load_libraries(root: pathlib.Path) -> dict[str, ctypes.CDLL]:
    """Each kernel's library built from the checkout at ``root``, declared with this checkout's signatures."""
    libraries = {}
    for name, module in MODULES.items():
        library = ctypes.CDLL(str(cpu_build._build(c_source(root, name), "cc")))
        module._declare(library)
        libraries[name] = library
    return libraries


def use(libraries: dict[str, ctypes.CDLL]) -> None:
    """Points every wrapper module at ``libraries``."""
    for name, module in MODULES.items():
        module._library = lambda library=libraries[name]: library


def gemm_dtypes(systems: list[dict[str, ctypes.CDLL]]) -> tuple[torch.dtype, ...]:
    """The dtypes whose GEMM every system's library runs on this CPU (an older source may build none: before
    2026-12-02 the float32 GEMM needed AVX-512)."""
    return tuple(dtype for dtype in (torch.bfloat16, torch.float32)
                 if all(lib["cpu_gemm"].gemm_supported(cpu_build.DTYPE_CODES[dtype]) for lib in systems))


def build_cases(dry_run: bool, gemm: tuple[torch.dtype, ...] | None = None) -> dict:
    """Case name -> a call of one wrapper on fixed random inputs; GEMM cases in the dtypes ``gemm`` names
    (default: those this checkout's GEMM runs here)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype)

    cases = {}
    rows_gemm, rows_small = ((1, 16), (1, 16)) if dry_run else ((1, 16, 128, 512), (1, 16, 512))
    shapes = ((576, 576), (1536, 576)) if dry_run else ((576, 576), (1536, 576), (576, 1536), (49152, 576))
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        if (cpu_gemm.available(dtype) if gemm is None else dtype in gemm):
            for n, k in shapes:
                packed = cpu_gemm.pack(rand(n, k, dtype=dtype))
                for m in (rows_gemm[:2] if n == 49152 else rows_gemm):
                    x = rand(m, k, dtype=dtype)
                    cases[f"gemm {tag} {m}x{k}->{n}"] = lambda x=x, p=packed: cpu_gemm.linear(x, p)
        for rows in rows_small:
            gate_up = rand(rows, 3072, dtype=dtype)
            cases[f"silu {tag} {rows}x1536"] = lambda g=gate_up: cpu_fused.silu_and_mul_cpu(g)
            x, residual, weight = rand(rows, 576, dtype=dtype), rand(rows, 576, dtype=dtype), rand(576, dtype=dtype)
            cases[f"rmsnorm {tag} {rows}x576"] = (
                lambda x=x, r=residual, w=weight: cpu_fused.rms_norm_cpu(x, w, 1e-5, residual=r))
            q = rand(rows, 12, 64, dtype=dtype)
            cos, sin = rand(rows, 1, 64, dtype=dtype), rand(rows, 1, 64, dtype=dtype)
            cases[f"rotary {tag} {rows}x12x64"] = lambda q=q, c=cos, s=sin: cpu_fused.apply_rotary_cpu(q, c, s)
        block = 16
        for seqs, context in ((4, 64),) if dry_run else ((16, 512), (64, 256), (16, 4096)):
            blocks = seqs * context // block
            k_cache, v_cache = rand(blocks + 1, block, 3, 64, dtype=dtype), rand(blocks + 1, block, 3, 64, dtype=dtype)
            tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(seqs, context // block)
            lens = torch.full((seqs,), context, dtype=torch.int32)
            q = rand(seqs, 9, 64, dtype=dtype)
            cases[f"decode {tag} {seqs}x{context}"] = (
                lambda q=q, k=k_cache, v=v_cache, t=tables, n=lens: cpu_decode.paged_decode_cpu(q, k, v, t, n, 0.125))
        for tokens in (64,) if dry_run else (512, 2048):
            k_cache = rand(tokens // block, block, 3, 64, dtype=dtype)
            v_cache = rand(tokens // block, block, 3, 64, dtype=dtype)
            q = rand(tokens, 9, 64, dtype=dtype)
            cu, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
            tables = torch.arange(tokens // block, dtype=torch.int32).view(1, -1)
            cases[f"prefill {tag} {tokens}"] = (lambda q=q, k=k_cache, v=v_cache, c=cu, n=lens, t=tables:
                                                cpu_prefill.paged_prefill_cpu(q, k, v, c, n, t, 0.125))
        prompts, tokens = (2, 16) if dry_run else (16, 100)   # a serving wave: 16 prompts of 100 tokens
        blocks = prompts * ((tokens + block - 1) // block)
        k_cache, v_cache = rand(blocks, block, 3, 64, dtype=dtype), rand(blocks, block, 3, 64, dtype=dtype)
        q = rand(prompts * tokens, 9, 64, dtype=dtype)
        cu = torch.arange(0, prompts * tokens + 1, tokens, dtype=torch.int32)
        lens = torch.full((prompts,), tokens, dtype=torch.int32)
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(prompts, -1)
        cases[f"prefill {tag} {prompts}x{tokens}"] = (lambda q=q, k=k_cache, v=v_cache, c=cu, n=lens, t=tables:
                                                      cpu_prefill.paged_prefill_cpu(q, k, v, c, n, t, 0.125))
    return cases


def time_us(call, budget_s: float) -> float:
    """Mean microseconds per call over at least ``budget_s`` seconds and 3 calls, after one warm-up call."""
    call()
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s and calls >= 3:
            return elapsed / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.c_kernels_ref", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "c_kernels_ref")
    parser.add_argument("--ref", default="HEAD", help="the git commit to compare with (default: HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="a few tiny cases, to check the plumbing")
    args = parser.parse_args(argv)
    if not all(module._library() is not None for module in MODULES.values()):
        raise SystemExit("c_kernels_ref: the C kernels are unavailable here (no compiler, or PAGEDRAY_CPU_KERNELS=0)")
    budget = 0.002 if args.dry_run else 0.05
    originals = {name: module._library for name, module in MODULES.items()}
    with ref_import_root(args.ref) as root:
        libraries = {THIS: load_libraries(pathlib.Path(__file__).resolve().parents[1]),
                     args.ref: load_libraries(root / "pagedray")}
        both = gemm_dtypes(list(libraries.values()))
        for dtype in {torch.bfloat16, torch.float32} - set(both):
            if cpu_gemm.available(dtype):
                print(f"the GEMM in {dtype}: {args.ref}'s source has none for this CPU, not timed")
        cases = build_cases(args.dry_run, both)

        def measure(system: str, round_index: int) -> dict:
            use(libraries[system])
            return {name: time_us(call, budget) for name, call in cases.items()}

        try:
            runs = run_rounds([THIS, args.ref], args.rounds, measure, on_run=print_run)
        finally:                       # the wrappers call their own (cached) library loaders again
            for name, module in MODULES.items():
                module._library = originals[name]
    metrics = [Metric(name, f"{name} us", higher_is_better=False) for name in cases]
    out = "/dev/null" if args.dry_run and args.out == parser.get_default("out") else args.out
    return finish_rounds("c_kernels_ref", out, runs, metrics, [Ratio(THIS, (args.ref,), None, f"this / {args.ref}")],
                         vars(args))


if __name__ == "__main__":
    main()
