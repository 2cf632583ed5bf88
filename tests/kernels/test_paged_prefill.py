"""Paged prefill (Triton kernel and torch reference) against the float64 dense oracle.

Each chunk is ``(history, q_len)``: the sequence has ``history + q_len`` keys in the cache and the chunk
queries are its last ``q_len`` positions (history 0 = a fresh prompt; > 0 = prefix hit / chunked prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from helpers.paged_kv_cases import (
    alibi_like_slopes,
    assert_close_to_oracle,
    dense_attention,
    kernel_device,
    make_paged_case,
    nan_like,
    seed_of,
)
from pagedray.kernels import paged_prefill, paged_prefill_reference
from pagedray.kernels.cpu import cpu_decode
from pagedray.kernels.reference.attention import ROW_CHUNK_MAX


@dataclass(frozen=True)
class PrefillSpec:
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    chunks: tuple            # ((history, q_len), ...)
    alibi: bool = False
    window: int | None = None


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU_SPECS = [
    PrefillSpec(4, 4, 64, 16, F32, ((0, 37), (0, 1), (0, 64))),                       # fresh prompts
    PrefillSpec(9, 3, 64, 16, F16, ((0, 40), (0, 1), (0, 17), (5, 3))),               # fresh, GQA 3
    PrefillSpec(4, 2, 96, 8, F16, ((50, 13), (3, 1), (120, 64)), alibi=True),         # history > 0
    PrefillSpec(8, 2, 128, 32, F32, ((17, 30), (0, 20)), window=16),                  # sliding window
    PrefillSpec(16, 2, 64, 64, F16, ((64, 16), (0, 5), (100, 0)), alibi=True),        # GQA 8, empty chunk
    PrefillSpec(4, 1, 128, 16, F16, ((200, 9), (31, 33))),                            # MQA
    PrefillSpec(6, 2, 64, 16, F32, ((10, 25),), alibi=True, window=7),                # group 3
    PrefillSpec(2, 1, 512, 16, F32, ((9, 20), (0, 5))),                               # Gemma 4's head_dim 512
]
GPU_SPECS = [
    PrefillSpec(32, 8, 128, 16, BF16, ((0, 2048), (1000, 512), (5, 1), (3000, 17), (0, 300))),
    PrefillSpec(32, 8, 128, 16, F16, ((4096, 1000), (0, 64), (77, 1)), alibi=True),
    PrefillSpec(32, 4, 96, 32, F32, ((0, 1500), (700, 129)), window=256),
    PrefillSpec(16, 1, 64, 64, BF16, ((129, 1023), (0, 0), (1, 2)), alibi=True, window=100),
    PrefillSpec(12, 4, 128, 8, F16, ((2000, 333), (0, 2500))),
    PrefillSpec(16, 2, 512, 16, BF16, ((0, 700), (1500, 90), (3, 1)), window=1024),  # Gemma 4's full layers
]


def _cu_seqlens(q_lens: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _run_prefill(spec: PrefillSpec, impl: str, seed: int) -> None:
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed)
    k_lens = [h + n for h, n in spec.chunks]
    q_lens = [n for _, n in spec.chunks]
    case = make_paged_case(gen, k_lens, spec.kv_heads, spec.head_dim, spec.block_size, spec.dtype, device)
    q = torch.randn((sum(q_lens), spec.q_heads, spec.head_dim), generator=gen).to(spec.dtype).to(device)
    cu = _cu_seqlens(q_lens, device)
    scale = 1.0 / math.sqrt(spec.head_dim)
    slopes = alibi_like_slopes(spec.q_heads, device) if spec.alibi else None
    out = nan_like(q.shape, spec.dtype, device)
    args = (q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, scale, slopes, out)
    if impl == "reference":
        result = paged_prefill_reference(*args, sliding_window=spec.window)
    elif impl == "reference_decode_rows":   # the CPU path: short chunks as rows of the C decode kernel
        result = paged_prefill_reference(*args, sliding_window=spec.window, decode_rows=cpu_decode.paged_decode_cpu)
    else:
        result = paged_prefill(*args, sliding_window=spec.window, use_triton=True, validate_values=True)
    assert result is out
    starts = cu.tolist()
    expected = torch.cat([
        dense_attention(q[starts[i]:starts[i + 1]], case.keys[i], case.values[i], scale, slopes, spec.window)
        for i in range(len(q_lens))
    ])
    assert_close_to_oracle(out, expected, spec.dtype)


def _spec_id(s: PrefillSpec) -> str:
    return f"g{s.q_heads // s.kv_heads}-d{s.head_dim}-b{s.block_size}-{str(s.dtype)[6:]}-n{len(s.chunks)}"


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("spec", CPU_SPECS, ids=_spec_id)
def test_prefill_matches_dense_oracle(spec, impl):
    _run_prefill(spec, impl, seed=seed_of(spec, impl))


# chunks of 1..ROW_CHUNK_MAX tokens, with and without history (speculative steps, prompts, chunked
# prefill): all of them decode rows of one call; the last spec mixes rows with a chunk longer than that
SHORT_SPECS = [
    PrefillSpec(9, 3, 64, 16, F32, ((37, 5), (0, 1), (100, 2), (3, 40), (15, ROW_CHUNK_MAX))),
    PrefillSpec(8, 2, 128, 8, BF16, ((250, 4), (7, 9), (1, 3))),
    PrefillSpec(4, 4, 64, 32, F32, ((60, 6), (20, 2)), window=24),
    PrefillSpec(4, 2, 96, 8, BF16, ((50, 13), (3, 1), (100, 0), (0, 117)), alibi=True),
    PrefillSpec(6, 2, 64, 16, F32, ((0, 45), (0, 18), (9, 93)), window=20),
    PrefillSpec(4, 2, 64, 16, F32, ((0, ROW_CHUNK_MAX + 3), (20, 7), (0, 30))),
]


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler to build cpu_decode.c")
@pytest.mark.parametrize("spec", SHORT_SPECS, ids=_spec_id)
def test_short_chunks_as_decode_rows_match_dense_oracle(spec):
    q = torch.empty((1, spec.q_heads, spec.head_dim), dtype=spec.dtype)
    assert cpu_decode.supports(q, torch.empty((1, spec.block_size, spec.kv_heads, spec.head_dim), dtype=spec.dtype))
    _run_prefill(spec, "reference_decode_rows", seed=seed_of(spec))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("spec", GPU_SPECS, ids=_spec_id)
def test_prefill_matches_dense_oracle_gpu(spec, impl):
    _run_prefill(spec, impl, seed=seed_of(spec, impl))


def test_prefill_leaves_padding_rows_of_out_untouched():
    """Only the rows of real query tokens are written: a larger ``out`` viewed as q's shape keeps the
    sentinel outside the view (the kernel must not store padded tile rows)."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(5)
    case = make_paged_case(gen, [19, 3], 2, 64, 16, F32, device)
    q = torch.randn((7, 4, 64), generator=gen).to(device)
    backing = torch.full((10, 4, 64), 123.0, device=device)
    out = backing[:7]
    out.fill_(float("nan"))
    cu = _cu_seqlens([5, 2], device)
    paged_prefill(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, 0.125, None, out,
                  use_triton=True)
    assert torch.equal(backing[7:].cpu(), torch.full((3, 4, 64), 123.0))
    expected = torch.cat([dense_attention(q[:5], case.keys[0], case.values[0], 0.125),
                          dense_attention(q[5:], case.keys[1], case.values[1], 0.125)])
    assert_close_to_oracle(out, expected, F32)
