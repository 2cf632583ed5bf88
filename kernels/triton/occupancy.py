"""How many programs of a compiled Triton kernel one SM holds at once, and the split count that fills whole waves.

A program (one CTA of ``num_warps`` warps) takes registers per thread and shared memory; an SM holds as many
programs as its registers, its shared memory and its warp slots allow. The NVIDIA limits used here (sm_80 /
sm_90): registers are given to a warp in units of 256, each program reserves 1 KiB of shared memory beyond its
own, at most 32 programs. ``benchmarks.sm90_report`` applies the same rule to the sm_90 compile (no GPU);
``resident_programs`` to a kernel compiled for the GPU in use.
"""

from __future__ import annotations

import math

REGISTER_UNIT = 256          # registers are allocated per warp in units of this many
SHARED_RESERVED = 1024       # bytes of shared memory each resident program reserves beyond its own
MOST_PROGRAMS = 32           # resident programs per SM at most
SM90 = dict(registers=65536, shared=228 * 1024, warps=64)   # per SM (H100 / H200)


def programs_per_sm(registers: int, shared: int, num_warps: int, registers_per_sm: int = SM90["registers"],
                    shared_per_sm: int = SM90["shared"], warps_per_sm: int = SM90["warps"]) -> int:
    """Resident programs per SM for a kernel of ``registers`` per thread and ``shared`` bytes of shared memory
    (0 registers: not known, the other limits decide)."""
    by_warps = warps_per_sm // num_warps
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = registers_per_sm // (per_warp * num_warps) if registers else by_warps
    by_shared = shared_per_sm // (shared + SHARED_RESERVED)
    return max(0, min(MOST_PROGRAMS, by_warps, by_registers, by_shared))


def resident_programs(compiled, num_warps: int, device) -> int:
    """``programs_per_sm`` of a Triton ``CompiledKernel`` on CUDA ``device``: its register count (known once the
    binary is loaded, as Triton's fused-softmax tutorial reads it) and shared memory, the device's limits
    (shared memory per SM = the per-block opt-in maximum + the 1 KiB reserve)."""
    import torch
    import triton

    limits = triton.runtime.driver.active.utils.get_device_properties(device.index)
    compiled._init_handles()
    threads = getattr(torch.cuda.get_device_properties(device), "max_threads_per_multi_processor", 2048)
    return programs_per_sm(compiled.n_regs, compiled.metadata.shared, num_warps,
                           registers_per_sm=limits["max_num_regs"],
                           shared_per_sm=limits["max_shared_mem"] + SHARED_RESERVED, warps_per_sm=threads // 32)


WAVE_SLACK = 0.05   # split counts whose waves cost within this of the best: the fewest splits is taken


def wave_num_splits(programs: int, slots: int, most: int) -> int:
    """Splits per program for ``programs`` equal programs on a device holding ``slots`` at once (SMs x programs
    per SM), from 1 to ``most``. A wave model: programs run in waves of ``slots``, and a program split s ways
    does 1/s of the work, so s splits take ``ceil(programs * s / slots) / s`` of one unsplit program's time.
    The fewest splits within ``WAVE_SLACK`` of the least such time: more splits also cost partial results and
    a reduction. E.g. 512 programs on 132 SMs x 3: 1 split fills 2 waves (the second 29% full), 3 splits 4
    waves 97% full."""
    if programs < 1 or slots < 1 or most < 1:
        raise ValueError(f"programs, slots, most: must be >= 1, got {programs}, {slots}, {most}")
    cost = {s: math.ceil(programs * s / slots) / s for s in range(1, most + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * (1 + WAVE_SLACK))
