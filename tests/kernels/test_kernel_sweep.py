"""Sweep block sizes x head dims x dtypes with random lengths (drawn from the per-test seed) for the
Triton decode and prefill kernels against the float64 oracle. Lengths stay small under the interpreter
(decode up to 300 keys, prefill chunks of 1..64 over up to 150 history tokens)."""

from __future__ import annotations

import itertools
import math

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
from pagedray.kernels import paged_decode, paged_prefill

GRID = list(itertools.product((8, 16, 32, 64), (64, 96, 128), (torch.float32, torch.float16)))
HEAD_LAYOUTS = ((4, 4), (4, 2), (8, 2), (16, 2), (4, 1), (6, 2))   # GQA 1, 2, 4, 8, MQA, 3


def _layout(index: int) -> tuple[int, int]:
    return HEAD_LAYOUTS[index % len(HEAD_LAYOUTS)]


def _grid_id(params) -> str:
    block_size, head_dim, dtype = params
    return f"b{block_size}-d{head_dim}-{str(dtype)[6:]}"


@pytest.mark.parametrize("index", range(len(GRID)), ids=[_grid_id(p) for p in GRID])
def test_decode_sweep(index):
    block_size, head_dim, dtype = GRID[index]
    q_heads, kv_heads = _layout(index)
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("decode", index))
    lens = torch.randint(1, 301, (3,), generator=gen).tolist()
    case = make_paged_case(gen, lens, kv_heads, head_dim, block_size, dtype, device)
    q = torch.randn((len(lens), q_heads, head_dim), generator=gen).to(dtype).to(device)
    slopes = alibi_like_slopes(q_heads, device) if index % 2 else None
    window = 37 if index % 3 == 0 else None
    scale = 1 / math.sqrt(head_dim)
    out = nan_like(q.shape, dtype, device)
    paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, slopes, window, out,
                 use_triton=True, validate_values=True)
    expected = torch.cat([dense_attention(q[i:i + 1], case.keys[i], case.values[i], scale, slopes, window)
                          for i in range(len(lens))])
    assert_close_to_oracle(out, expected, dtype)


@pytest.mark.parametrize("index", range(len(GRID)), ids=[_grid_id(p) for p in GRID])
def test_prefill_sweep(index):
    block_size, head_dim, dtype = GRID[index]
    q_heads, kv_heads = _layout(index + 1)
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("prefill", index))
    histories = torch.randint(0, 151, (2,), generator=gen).tolist()
    histories[0] = 0 if index % 2 else histories[0]
    q_lens = torch.randint(1, 65, (2,), generator=gen).tolist()
    case = make_paged_case(gen, [h + n for h, n in zip(histories, q_lens)], kv_heads, head_dim, block_size,
                           dtype, device)
    q = torch.randn((sum(q_lens), q_heads, head_dim), generator=gen).to(dtype).to(device)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    slopes = alibi_like_slopes(q_heads, device) if index % 2 == 0 else None
    window = 29 if index % 4 == 1 else None
    scale = 1 / math.sqrt(head_dim)
    out = nan_like(q.shape, dtype, device)
    paged_prefill(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, scale, slopes, out,
                  sliding_window=window, use_triton=True, validate_values=True)
    expected = torch.cat([dense_attention(q[:q_lens[0]], case.keys[0], case.values[0], scale, slopes, window),
                          dense_attention(q[q_lens[0]:], case.keys[1], case.values[1], scale, slopes, window)])
    assert_close_to_oracle(out, expected, dtype)
