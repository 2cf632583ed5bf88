"""Which of two CPU implementations of the same small op runs, chosen by timing both on this CPU.

Besides the linear products (``workers/layers/gemm_timing``), four CPU ops have a C kernel and a torch twin
that compute the same values (``cpu_fused.c`` against ``reference.fused``; ``cpu_decode.c``'s rows against
SDPA for a prefill chunk):

- ``rms_norm``, ``rotary``, ``silu_mul``: ``prefer_c(op, x)``. Both twins are timed once per (op, dtype,
  shape of a row, threads) at every ``cpu_choice.ROW_BUCKETS`` row count, on random inputs, and a call
  takes its bucket's winner. The C kernel keeps a bucket unless torch is faster by more than ``NOISE``
  (the C kernel is also what the one-call decode path runs, so it is the default).
- prefill attention: ``prefill_c_max(dtype, heads, kv_heads, head_dim, by_chunks)``, the longest prompt
  chunk that runs in C (``cpu_prefill.c`` when it takes the layout, else ``cpu_decode.c``'s rows: one C call
  for every chunk at most this long); longer chunks run per sequence through SDPA
  (``reference.paged_prefill_reference``). Timed as a prefill step of ``STEP_TOKENS`` tokens
  in chunks of each of ``CHUNK_LENGTHS`` (no history): C runs the step in one call, SDPA once per
  chunk. The answer is the longest length below the first one where SDPA is faster by more than
  ``NOISE`` (timing stops there). The same length holds for chunks with history, a sliding window, ALiBi or
  an 8-bit cache.

Decisions are made on first use (the engine's profile run reaches every op before serving), memoised for
the process and kept on disk in the ``cpu_choice.ChoiceCache`` (keyed by CPU, torch and kernel sources),
so a restart times nothing. ``PAGEDRAY_CPU_TWINS=auto|c|torch`` forces them: ``c`` is the C kernel
everywhere and ``reference.ROW_CHUNK_MAX`` for prefill attention (the tests force it, so that no test's
values depend on what a busy machine timed); ``torch`` is the torch twin everywhere and SDPA for every
chunk longer than one token.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from ..reference.attention import ROW_CHUNK_MAX, paged_prefill_reference
from ..reference.fused import apply_rotary_reference, rms_norm_reference, silu_and_mul_reference
from . import cpu_choice, cpu_decode, cpu_fused, cpu_prefill
from .cpu_choice import ROW_BUCKETS

log = logging.getLogger(__name__)

TWINS_ENV = "PAGEDRAY_CPU_TWINS"
CHOICES = ("auto", "c", "torch")
OPS = ("rms_norm", "rotary", "silu_mul")
CHUNK_LENGTHS = (16, 64, 256, 512, 1024, 2048)
NOISE = 1.1          # the other twin must be this much faster to take a bucket
REPEATS = 5
BLOCK_SIZE = 16      # the timed prefill chunks' cache blocks (the choice does not depend on it)
STEP_TOKENS = 2048   # the timed prefill step: this many tokens in chunks of each length (the default token budget)


def forced() -> str | None:
    """``PAGEDRAY_CPU_TWINS`` when it forces a side (``c`` or ``torch``); None: choose by timing."""
    value = os.environ.get(TWINS_ENV, "auto").strip() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{TWINS_ENV}: one of {', '.join(CHOICES)}, got {value!r}")
    return None if value == "auto" else value


def median_ms(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall milliseconds of ``run`` over ``repeats`` calls after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _op_pair(op: str, dtype: torch.dtype, row_shape: tuple[int, ...], rows: int) -> tuple[Callable, Callable]:
    """(C call, torch call) of ``op`` on random ``[rows, *row_shape]`` inputs."""
    gen = torch.Generator().manual_seed(rows)
    shape = (rows, *row_shape)
    x = torch.randn(shape, generator=gen).to(dtype)
    if op == "rms_norm":    # x, residual [rows, hidden]
        residual = torch.randn(shape, generator=gen).to(dtype)
        weight = torch.randn(row_shape[-1], generator=gen).to(dtype)
        return (lambda: cpu_fused.rms_norm_cpu(x, weight, 1e-6, residual),
                lambda: rms_norm_reference(x, weight, 1e-6, residual))
    if op == "rotary":      # x [rows, heads, head_dim], cos / signed_sin [rows, 1, head_dim]
        cos, sin = (torch.randn(rows, 1, row_shape[-1], generator=gen).to(dtype) for _ in range(2))
        return lambda: cpu_fused.apply_rotary_cpu(x, cos, sin), lambda: apply_rotary_reference(x, cos, sin)
    return lambda: cpu_fused.silu_and_mul_cpu(x), lambda: silu_and_mul_reference(x)   # x = gate_up [rows, 2 inter]


def plan_from_times(c_ms: list[float], torch_ms: list[float]) -> tuple[bool, ...]:
    """Per bucket: True (the C kernel) unless torch is faster by more than ``NOISE``."""
    return tuple(not t * NOISE < c for c, t in zip(c_ms, torch_ms))


@functools.lru_cache(maxsize=None)
def _op_plan(op: str, dtype: torch.dtype, row_shape: tuple[int, ...], threads: int) -> tuple[bool, ...]:
    cache = cpu_choice.ChoiceCache()
    shape = "x".join(map(str, row_shape))
    name = f"twin {op} {str(dtype).removeprefix('torch.')} row={shape} threads={threads}"
    entry = cache.get(name)
    if isinstance(entry, dict) and len(entry.get("c_ms", ())) == len(ROW_BUCKETS):
        return plan_from_times(entry["c_ms"], entry["torch_ms"])
    c_ms, torch_ms = [], []
    for rows in ROW_BUCKETS:
        c_call, torch_call = _op_pair(op, dtype, row_shape, rows)
        c_ms.append(median_ms(c_call))
        torch_ms.append(median_ms(torch_call))
    plan = plan_from_times(c_ms, torch_ms)
    cache.put({name: {"c_ms": c_ms, "torch_ms": torch_ms}})
    log.info("CPU %s (%s): C kernel / torch by rows %s: %s", op, name.partition(" ")[2],
             "/".join(map(str, ROW_BUCKETS)), " ".join(f"{c / t:.2f}" for c, t in zip(c_ms, torch_ms)))
    return plan


def prefer_c(op: str, x: torch.Tensor) -> bool:
    """Whether ``op`` (one of ``OPS``) on input ``x`` ([rows, ...]: rms_norm's x, rotary's x, silu_mul's
    gate_up) should run its C kernel; the caller has checked that the C kernel takes the layout."""
    side = forced()
    if side is not None:
        return side == "c"
    if op not in OPS:
        raise ValueError(f"op: one of {', '.join(OPS)}, got {op!r}")
    plan = _op_plan(op, x.dtype, tuple(x.shape[1:]), torch.get_num_threads())
    return plan[cpu_choice.bucket_index(x.shape[0])]


def _chunk_inputs(dtype, heads: int, kv_heads: int, head_dim: int, length: int):
    """A prefill step of ``STEP_TOKENS`` prompt tokens in chunks of ``length`` without history."""
    count = max(1, STEP_TOKENS // length)
    gen = torch.Generator().manual_seed(length)
    per_seq = math.ceil(length / BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(count * per_seq, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))                                                  # [NB, bs, Hkv, D]
    q = torch.randn(count * length, heads, head_dim, generator=gen).to(dtype)              # [tokens, Hq, D]
    cu = torch.arange(count + 1, dtype=torch.int32) * length                                # [count + 1]
    lens = torch.full((count,), length, dtype=torch.int32)                                  # [count]
    table = torch.arange(count * per_seq, dtype=torch.int32).view(count, per_seq)          # [count, per_seq]
    return q, k_cache, v_cache, cu, lens, table


def c_max_from_times(c_ms: list[float], sdpa_ms: list[float]) -> int:
    """The longest of ``CHUNK_LENGTHS`` before the first where SDPA wins by more than ``NOISE`` (1: none);
    the lists may stop early (at the first SDPA win)."""
    best = 1
    for length, c, sdpa in zip(CHUNK_LENGTHS, c_ms, sdpa_ms):
        if sdpa * NOISE < c:
            break
        best = length
    return best


@functools.lru_cache(maxsize=None)
def _c_max(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, by_chunks: bool, threads: int) -> int:
    cache = cpu_choice.ChoiceCache()
    kernel = "cpu_prefill" if by_chunks else "cpu_decode rows"
    name = (f"twin prefill {kernel} {str(dtype).removeprefix('torch.')} heads={heads}/{kv_heads}x{head_dim} "
            f"step={STEP_TOKENS} threads={threads}")
    entry = cache.get(name)
    if isinstance(entry, dict) and entry.get("c_ms") and len(entry["c_ms"]) == len(entry.get("sdpa_ms", ())):
        return c_max_from_times(entry["c_ms"], entry["sdpa_ms"])
    scale = head_dim ** -0.5
    kernels = {"decode_rows": cpu_decode.paged_decode_cpu,
               "chunk_rows": cpu_prefill.paged_prefill_cpu if by_chunks else None}
    c_ms, sdpa_ms = [], []
    for length in CHUNK_LENGTHS:   # until SDPA wins: longer chunks are not timed
        inputs = _chunk_inputs(dtype, heads, kv_heads, head_dim, length)   # q, caches, cu, lens, table
        for row_chunk_max, times in ((length, c_ms), (1, sdpa_ms)):
            step = functools.partial(paged_prefill_reference, *inputs, scale, row_chunk_max=row_chunk_max, **kernels)
            times.append(median_ms(step, repeats=3))
        if c_max_from_times(c_ms, sdpa_ms) < length:
            break
    best = c_max_from_times(c_ms, sdpa_ms)
    cache.put({name: {"c_ms": c_ms, "sdpa_ms": sdpa_ms}})
    log.info("CPU prefill attention (%s): C / SDPA by chunk length %s: %s; C up to %d tokens",
             name.partition(" ")[2].partition(" ")[2], "/".join(map(str, CHUNK_LENGTHS[:len(c_ms)])),
             " ".join(f"{c / s:.2f}" for c, s in zip(c_ms, sdpa_ms)), best)
    return best


def prefill_c_max(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, by_chunks: bool = False) -> int:
    """The longest prefill chunk the CPU path runs in C: through ``cpu_prefill`` when ``by_chunks``, else as
    ``cpu_decode`` rows (the caller has checked that the kernel takes these shapes)."""
    side = forced()
    if side is not None:
        return ROW_CHUNK_MAX if side == "c" else 1
    return _c_max(dtype, heads, kv_heads, head_dim, by_chunks, torch.get_num_threads())
