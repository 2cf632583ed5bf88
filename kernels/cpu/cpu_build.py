"""Builds pagedray's CPU C kernels (``cpu_decode.c``, ``cpu_fused.c``) with the machine's C compiler on first use.

Decisions: docs/design/kernels.md, ``pagedray.kernels.cpu.cpu_build``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import tempfile
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
DISABLE_ENV = "PAGEDRAY_CPU_KERNELS"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}   # the dtype codes every C kernel takes (cpu_vec.h)


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(source: pathlib.Path, compiler: str) -> pathlib.Path:
    """Compile ``source`` (or find it compiled) and return the shared library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]   # what the source may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS), version,
                                     _cpu_flags()]).encode())
    import platformdirs

    folder = pathlib.Path(platformdirs.user_cache_dir("pagedray")) / "cpu_kernels"
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", private, str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)
    return target


def declare(library: ctypes.CDLL, signatures: dict[str, list], restype=None) -> None:
    """Sets each named function's argument types (``signatures``: name -> ctypes argtypes) and return type."""
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype


def load(source: pathlib.Path, declare: Callable[[ctypes.CDLL], None], what: str,
         fallback: str) -> ctypes.CDLL | None:
    """The compiled ``source`` with its functions' signatures set by ``declare``, or None when kernels
    are disabled or the build fails (one warning: ``what`` is off or unavailable, why, and ``fallback``)."""
    if os.environ.get(DISABLE_ENV) == "0":
        log.warning("%s off (%s=0): %s", what, DISABLE_ENV, fallback)
        return None
    try:
        library = ctypes.CDLL(str(_build(source, os.environ.get("CC", "cc"))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s): %s", what, exc, fallback)
        return None
    declare(library)
    return library
