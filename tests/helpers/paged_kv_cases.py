"""Builders and an independent float64 oracle for the paged-attention kernel tests.

A case holds, per sequence, *logical* keys/values ``[seq_len, Hkv, D]`` and scatters them into shuffled
physical blocks of a cache whose other slots hold random junk; unused block-table columns hold an
out-of-range id, so reading them would fail or corrupt the result. The oracle (``dense_attention``)
works on the logical tensors only, in float64, one head at a time: it shares no code with the kernels
or with the torch references.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def seed_of(*parts) -> int:
    """A stable per-test seed (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedCase:
    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor         # [num_seqs] int32
    keys: list                     # per sequence [seq_len, Hkv, D] (cache dtype)
    values: list


def make_paged_case(gen: torch.Generator, seq_lens: list[int], num_kv_heads: int, head_dim: int,
                    block_size: int, dtype: torch.dtype, device: torch.device,
                    spare_columns: int = 1) -> PagedCase:
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + spare_columns
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)          # junk everywhere first
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), num_blocks + 7, dtype=torch.int32)
    keys, values = [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = [physical.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
        for p in range(n):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedCase(k_cache.to(device), v_cache.to(device), tables.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values)


def alibi_like_slopes(num_q_heads: int, device: torch.device) -> torch.Tensor:
    """Distinct positive slopes (geometric, like ALiBi's) [num_q_heads] float32."""
    return torch.tensor([2.0 ** (-(h + 1) * 8.0 / num_q_heads) for h in range(num_q_heads)],
                        dtype=torch.float32, device=device)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    alibi_slopes=None, sliding_window=None, softcap=None, sinks=None) -> torch.Tensor:
    """float64 oracle. q [nq, Hq, D] are the last nq positions of k/v [nk, Hkv, D] -> [nq, Hq, D];
    ``softcap``: the scaled scores become softcap * tanh(score / softcap) (Gemma 2); ``sinks`` [Hq]: one more
    logit per head in the softmax, whose probability multiplies no value (gpt-oss)."""
    nq, num_q_heads, _ = q.shape
    nk, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    q64, k64, v64 = q.double().cpu(), k.double().cpu(), v.double().cpu()
    q_pos = torch.arange(nk - nq, nk, dtype=torch.float64)[:, None]           # [nq, 1]
    k_pos = torch.arange(nk, dtype=torch.float64)[None, :]                     # [1, nk]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    out = torch.zeros((nq, num_q_heads, q.shape[2]), dtype=torch.float64)
    for h in range(num_q_heads):
        kv = h // group
        scores = (q64[:, h] @ k64[:, kv].T) * scale                            # [nq, nk]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores + float(alibi_slopes[h]) * (k_pos - q_pos)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = torch.full((nq, 1), float(sinks[h]), dtype=torch.float64)
            out[:, h] = torch.softmax(torch.cat([scores, sink], dim=1), dim=-1)[:, :-1] @ v64[:, kv]
            continue
        out[:, h] = torch.softmax(scores, dim=-1) @ v64[:, kv]
    return out


def assert_close_to_oracle(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element written (no NaN from the poisoned buffer) and max-abs error relative to max |ref|."""
    assert out.dtype == dtype
    got = out.double().cpu()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} output elements never written"
    err = (got - expected).abs().max().item()
    ref = max(expected.abs().max().item(), 1e-6)
    assert err / ref < TOLERANCE[dtype], f"relative error {err / ref:.3e} >= {TOLERANCE[dtype]}"


def nan_like(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
