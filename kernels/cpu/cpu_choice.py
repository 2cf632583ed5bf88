"""Choosing between CPU kernels that compute the same thing by timing them on this CPU, kept on disk.

Which of two implementations is faster depends on the CPU: an Intel Xeon with AMX multiplies bfloat16
through oneDNN's AMX tiles 3-11x faster than the C loop that beats oneDNN on an AMD EPYC without AMX. So
a choice is made by measurement on the machine that runs, never from a CPU-feature guess, and it is kept
per row bucket: the best product at 1 row (memory-bound) need not be the best at 2,048 (compute-bound).

- ``ROW_BUCKETS`` are the row counts a decision is kept for (a caller may time some of them only where it
  needs to: ``workers/layers/gemm_timing.REFINED_ROWS``). A call with ``r`` rows takes the decision of the
  bucket nearest ``r`` on a log scale (``bucket_index``; halfway goes to the larger bucket).
- ``pick`` keeps, per bucket, the candidate with the least time (ties: the first one named).
- ``ChoiceCache``: decisions live in ``<user cache>/pagedray/cpu_choice/<key>.json``. ``cache_key`` hashes
  the CPU's model name and flags, the torch version and the source of every C kernel in this folder, so a
  change of any of them opens a new file and the old decisions are never read again. Inside the file each
  entry is named by what was timed (the caller's name: kind, dtype, shape, threads). Two processes writing
  at once each write a private file and rename it into place; the last one's entries win.
- A busy machine's timings are not kept: when other work shared the cores while they were timed, a time can be
  off by several times (seen: a one-call decode step timed at 978 ms against 36 ms, which kept the slower layer
  loop and halved serving throughput at every later start). Those decisions hold for the process that made them
  (its callers have them) and the next start times again. ``CACHE_VERSION`` 7 dropped the files written before
  this rule. What says "busy":
  - on Linux, this process's own threads: the seconds they spent runnable but waiting for a CPU (each thread's
    run-queue delay, ``/proc/self/task/*/schedstat``; ``run_queue_wait_s``) from the opening of the cache to
    the put, per second of that window, above ``BUSY_WAIT_PER_S``. It counts only what delayed this timing, so
    it also holds in a container on a large shared host, where the load average is the whole host's and
    ``os.cpu_count()`` is not this process's share. Measured on the 2-core AMD EPYC VM (2026-12-03, a bf16 plan
    of ``gemm_timing``): 0.005-0.007 s per second on the quiet machine, 0.72-0.75 with one busy loop beside it.
    A loop started a second before such a plan left the 1-minute load average at 0.56 per CPU, which the
    load rule below would have let pass; the run-queue rule did not keep that plan;
  - where the kernel does not report that delay: the 1-minute load average per CPU above
    ``BUSY_LOAD_PER_CPU`` as the cache is opened (before the timing) or as the decisions are put.
- ``forced_product``: ``PAGEDRAY_CPU_GEMM=auto|c|amx|onednn|mkl`` in the environment overrides a configured
  ``auto`` (for comparing the products on one machine; a configured product wins over it).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from . import cpu_build

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)
# a row count below _EDGES[i] (the buckets' geometric midpoints) belongs to bucket i
_EDGES = tuple(math.sqrt(a * b) for a, b in zip(ROW_BUCKETS, ROW_BUCKETS[1:]))
PRODUCTS = ("auto", "c", "amx", "onednn", "mkl")
PRODUCT_ENV = "PAGEDRAY_CPU_GEMM"
# 2: the C GEMM keeps a bucket within gemm_timing.C_MARGIN of the fastest; 3: prefill buckets timed in 7 rounds;
# 4: close prefill calls timed in gemm_timing.CLOSE_ROUNDS more rounds at the end; 5: the AMX product;
# 6: buckets of 64, 256 and 1,024 rows (gemm_timing.REFINED_ROWS); 7: a busy machine's timings are not kept (older
# files may hold some)
CACHE_VERSION = 7
BUSY_LOAD_PER_CPU = 1.0   # above this 1-minute load average per CPU, timings are not kept (module doc)
BUSY_WAIT_PER_S = 0.2     # above this run-queue wait of this process's threads per second, the same (module doc)


def bucket_index(rows: int) -> int:
    """The index in ``ROW_BUCKETS`` whose decision a call with ``rows`` rows takes."""
    return bisect.bisect_right(_EDGES, rows)


def pick(times: Mapping[str, Sequence[float]]) -> tuple[str, ...]:
    """times: candidate -> milliseconds per bucket (``math.inf`` where it was not timed) -> the fastest
    candidate of each bucket (ties: the first candidate in ``times``' order)."""
    if not times:
        raise ValueError("times: at least one candidate is required")
    lengths = {len(row) for row in times.values()}
    if len(lengths) != 1:
        raise ValueError(f"times: every candidate needs one time per bucket, got lengths {sorted(lengths)}")
    names = list(times)
    return tuple(min(names, key=lambda name: (times[name][i], names.index(name))) for i in range(lengths.pop()))


def cpu_model() -> str:
    """``/proc/cpuinfo``'s first ``model name`` (else the platform's processor string)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def kernel_sources() -> list[pathlib.Path]:
    """Every C source and header of the CPU kernels (a change to any of them invalidates the decisions)."""
    folder = pathlib.Path(__file__).parent
    return sorted([*folder.glob("*.c"), *folder.glob("*.h")])


def cache_key(model: str | None = None, flags: str | None = None, torch_version: str | None = None,
              sources: Sequence[pathlib.Path] | None = None) -> str:
    """A hash of the CPU model and flags, the torch version and the kernel sources (each defaults to this
    machine's / this checkout's)."""
    parts = [str(CACHE_VERSION), cpu_model() if model is None else model,
             cpu_build._cpu_flags() if flags is None else flags, torch.__version__ if torch_version is None
             else torch_version]
    parts += [path.read_text() for path in (kernel_sources() if sources is None else sources)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def default_folder() -> pathlib.Path:
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("pagedray")) / "cpu_choice"


def run_queue_wait_s() -> float | None:
    """Seconds this process's threads, summed, have been runnable but waiting for a CPU (each thread's run-queue
    delay, the second field of ``/proc/self/task/<tid>/schedstat``, Linux); None where the kernel reports none."""
    total, seen = 0, False
    for stat in pathlib.Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, ValueError, IndexError):     # a thread that ended meanwhile
            continue
        seen = True
    return total / 1e9 if seen else None


class ChoiceCache:
    """Decisions (entry name -> any JSON value) kept in ``folder/<key>.json``; open it right before timing (what
    says busy is read from then on, module doc)."""

    def __init__(self, folder: pathlib.Path | None = None, key: str | None = None,
                 loadavg: Callable[[], tuple] = os.getloadavg,
                 run_queue_wait: Callable[[], float | None] = run_queue_wait_s,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.folder = default_folder() if folder is None else pathlib.Path(folder)
        self.path = self.folder / f"{cache_key() if key is None else key}.json"
        self._loadavg = loadavg
        self._run_queue_wait = run_queue_wait
        self._clock = clock
        self.load_at_open = self._load_per_cpu()
        self._wait_at_open = run_queue_wait()
        self._opened = clock()

    def _load_per_cpu(self) -> float:
        try:
            return self._loadavg()[0] / (os.cpu_count() or 1)
        except OSError:          # no load average on this platform: nothing says the machine is busy
            return 0.0

    def busy(self) -> str | None:
        """Why the timings since the opening cannot be trusted (module doc), or None when nothing says so."""
        wait = self._run_queue_wait()
        if self._wait_at_open is not None and wait is not None:
            per_s = max(wait - self._wait_at_open, 0.0) / max(self._clock() - self._opened, 1e-9)
            return (f"this process's threads waited {per_s:.2f} s for a CPU per second of the timing"
                    if per_s > BUSY_WAIT_PER_S else None)
        load = max(self.load_at_open, self._load_per_cpu())
        return f"1-minute load {load:.2f} per CPU" if load > BUSY_LOAD_PER_CPU else None

    def entries(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, name: str):
        return self.entries().get(name)

    def put(self, values: Mapping) -> bool:
        """Adds (or replaces) ``values``' entries, keeping the file's others; unless the machine is or was busy
        (module doc): then nothing is written. True when written."""
        why = self.busy()
        if why is not None:
            log.warning("CPU kernel choices %s timed on a busy machine (%s): used by this process, not kept; the "
                        "next start times them again", ", ".join(map(str, values)), why)
            return False
        merged = {**self.entries(), **values}
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, private = tempfile.mkstemp(suffix=".json", dir=self.folder)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(merged, out, indent=1, sort_keys=True)
            os.replace(private, self.path)
        finally:
            if os.path.exists(private):
                os.unlink(private)
        return True


def forced_product(option: str) -> str | None:
    """The product every linear layer must use: the configured ``option`` unless it is ``auto``, else
    ``PAGEDRAY_CPU_GEMM`` from the environment unless that is unset or ``auto``; None: choose by timing."""
    if option not in PRODUCTS:
        raise ValueError(f"cpu_gemm: one of {', '.join(PRODUCTS)}, got {option!r}")
    if option != "auto":
        return option
    value = os.environ.get(PRODUCT_ENV, "auto").strip() or "auto"
    if value not in PRODUCTS:
        raise ValueError(f"{PRODUCT_ENV}: one of {', '.join(PRODUCTS)}, got {value!r}")
    return None if value == "auto" else value
