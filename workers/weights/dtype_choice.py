"""What ``dtype: auto`` means on a rank: bfloat16 on CUDA, and on a CPU with a fast bfloat16 path; else float32.

A CPU has a fast bfloat16 path when it has AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``) in
``/proc/cpuinfo``'s flags: oneDNN then multiplies bfloat16 matrices natively, several times faster
than float32 (docs/design/workers.md). Without either, bfloat16 is emulated and slower than float32, so
``auto`` stays float32 there (vLLM for CPU chooses the same way). Other systems than Linux: float32.

float32 is the exact oracle path (greedy tokens equal transformers' float32 ``generate``); pass
``dtype="float32"`` for it on any machine. Every rank resolves ``auto`` on its own machine; the
executors check that all ranks of a replica agree (a TP group across CPUs that differ must name its
dtype).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from types import MappingProxyType

import torch

DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str          # one line for the start-up log

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``), as a set; empty when unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_dtype(dtype: str, device: torch.device, flags: frozenset[str] | None = None) -> DtypeChoice:
    """``dtype`` (a ``ModelConfig.dtype`` value) on ``device``; ``flags`` overrides this CPU's flags."""
    if dtype != "auto":
        return DtypeChoice(DTYPES[dtype], f"dtype {dtype} (as configured)")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "dtype auto: bfloat16 on CUDA")
    flags = cpu_flags() if flags is None else flags
    fast = [flag for flag in FAST_BF16_FLAGS if flag in flags]
    if fast:
        return DtypeChoice(torch.bfloat16, f"dtype auto: bfloat16 (this CPU has {' and '.join(fast)}; "
                                           "dtype float32 for the exact path)")
    return DtypeChoice(torch.float32, "dtype auto: float32 (this CPU has neither AMX nor AVX512-BF16)")
