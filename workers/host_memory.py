"""glibc malloc settings for a CPU worker: keep freed memory for the next step instead of handing it
back to the operating system.

Why: glibc serves an allocation at or above its mmap threshold (128 KiB at start, raised as chunks are
freed) with fresh pages from ``mmap`` and gives the top of its heap back once more than the trim
threshold is free. A CPU forward allocates its activations anew every step and of a new size every
prefill ([900 tokens, 1536] fp32 = 5.5 MB per MLP product), so much of each step's memory came back
as fresh pages, and every 4 KiB page is faulted in and zeroed on its first write (docs/design/workers.md
has the page faults and prefill times with and without these settings).

Settings (``mallopt``, process-wide, set by ``keep_freed_memory`` at each CPU Worker's start; setting
them again is harmless):
- ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's largest on 64-bit): allocations below it come from the heap,
  whose freed chunks are reused. Setting it also stops glibc's dynamic adjustment.
- ``M_TRIM_THRESHOLD`` = 1 GiB: the heap is not shrunk while less than that is free at its top.

Cost: the worker's resident memory stays at its peak activation footprint instead of shrinking
between steps. ``ModelConfig.cpu_keep_freed_memory=False`` leaves glibc's defaults. With the in-process
executor (``LLM``, ``executor="local"``) the settings apply to the caller's process. Where the C
library has no ``mallopt`` (not glibc: musl, macOS), nothing changes and the function says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1     # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def _glibc_mallopt():
    """glibc's ``mallopt`` function, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory(mallopt=None) -> bool:
    """Applies the settings of the module docstring; True when every ``mallopt`` call succeeded.

    ``mallopt``: the C function to call (default: glibc's; tests pass a recorder)."""
    mallopt = mallopt or _glibc_mallopt()
    if mallopt is None:
        log.info("no glibc mallopt in this process; malloc keeps its defaults")
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    applied = all(mallopt(param, value) == 1 for param, value in settings)   # glibc: 1 = done, 0 = refused
    if not applied:
        log.warning("glibc refused a mallopt setting; malloc may return freed memory to the OS between steps")
    return applied
