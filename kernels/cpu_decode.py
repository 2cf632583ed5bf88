"""The CPU decode-attention kernel (``cpu_decode.c``): built with the machine's C compiler on first use.

Decode attention on CPU used to gather each sequence's K/V blocks into a dense tensor per layer and
call SDPA (``reference._decode_rows``); at decode sizes that is mostly per-call overhead and copies
(SmolLM2, 16 sequences of ~250 tokens, bf16: 22 of a 44 ms step). The C kernel reads K/V rows
straight from the paged cache, one sequence (or one of its KV heads) per work item, with an online
softmax in float32 (``cpu_decode.c`` has the loop structure and its measured cost).

Decisions:
- Built at run time, not at install time: ``pip install -e .`` stays a pure-Python install (a build
  step would need torch inside pip's isolated build environment, i.e. a second, CUDA, torch). The
  first call compiles ``cpu_decode.c`` with ``$CC`` (default ``cc``) ``-O3 -march=native -fopenmp``
  into ``<user cache>/pagedray/cpu_kernels/`` under a name hashed from the source, the flags, the
  compiler's version and the CPU's flags (about a second); later processes load that file. Two
  processes compiling at once each write a private file and rename it into place.
- OpenMP threads: the kernel runs on ``torch.get_num_threads()`` threads of the same libgomp torch
  uses (it is already loaded, so the kernel's ``libgomp.so.1`` resolves to it: one thread pool).
- Dtypes: float32 and bfloat16 (q, caches and output share it). float16 goes to the torch reference.
- Without a compiler, or with ``PAGEDRAY_CPU_KERNELS=0`` in the environment, ``available()`` is
  False and the torch reference runs (one warning in the log says why).
- Numerics: float32 accumulation like the reference, but another summation order and its own exp
  (relative error ~2e-7), so results differ from the reference in the last bits (the tests bound it);
  greedy tokens still equal transformers' in the HF-exact tests, which run through this kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
DISABLE_ENV = "PAGEDRAY_CPU_KERNELS"
_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _INT64, _INT64, _PTR, _PTR, _INT64, _INT64, _INT64, _INT64, _INT64, _INT64, _INT64,
             _INT64, _INT64, _PTR, _INT64, _PTR, ctypes.c_float, _PTR, _INT64, ctypes.c_int, _PTR, _INT64,
             _INT64, ctypes.c_int]


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> pathlib.Path:
    """Compile the kernel (or find it compiled) and return the shared library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode())
    import platformdirs

    folder = pathlib.Path(platformdirs.user_cache_dir("pagedray")) / "cpu_kernels"
    target = folder / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", private, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV) == "0":
        log.warning("CPU decode kernel off (%s=0): decode attention runs the torch reference", DISABLE_ENV)
        return None
    try:
        library = ctypes.CDLL(str(_build(os.environ.get("CC", "cc"))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode kernel unavailable (%s): decode attention runs the torch reference", exc)
        return None
    library.paged_decode_cpu.argtypes = _ARGTYPES
    library.paged_decode_cpu.restype = None
    return library


def available() -> bool:
    """True when the compiled kernel can run (it is built on the first call)."""
    return _library() is not None


MAX_BLOCK_SIZE = 64
MAX_GROUP = 64


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode_cpu`` takes these (validated) tensors and the kernel is built: CPU,
    float32/bfloat16, block_size a multiple of 8 up to 64, at most 64 query heads per KV head."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and block_size % 8 == 0
            and block_size <= MAX_BLOCK_SIZE and q.shape[1] // num_kv_heads <= MAX_GROUP and available())


def paged_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes=None,
                     sliding_window=None, out=None):
    """``paged_decode_reference``'s contract through the C kernel (arguments already validated).

    q [S, Hq, D] (head_dim contiguous); k/v_cache [NB, bs, Hkv, D]; block_tables [S, max_blocks] int32;
    seq_lens [S] int32 -> out [S, Hq, D] in q.dtype.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
    result = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype)
    if v_cache.stride() != k_cache.stride():                 # the kernel walks both with one set of strides
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    k_strides = k_cache.stride()
    _library().paged_decode_cpu(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_strides[0], k_strides[1], k_strides[2], num_blocks, block_size, num_kv_heads, head_dim,
        num_seqs, group, tables.data_ptr(), tables.stride(0), lens.data_ptr(), float(scale),
        None if slopes is None else slopes.data_ptr(), int(sliding_window or 0), DTYPE_CODES[q.dtype],
        result.data_ptr(), result.stride(0), result.stride(1), torch.get_num_threads())
    if out is None:
        return result
    out.copy_(result)
    return out
