"""The Triton kernels compile for a CUDA target (sm_90) on a machine without a GPU (see
``cuda_compile_check.py``; it runs in a subprocess because this session uses the interpreter)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("cuda_compile_check.py")


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert len([line for line in lines if line.startswith("OK ")]) == 8, proc.stdout
