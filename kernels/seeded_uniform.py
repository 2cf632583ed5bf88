"""Seeded uniform noise for sampling: ``seeded_uniform(keys, vocab)`` -> ``[rows, vocab]`` in ``[0, 1)``.

The Sampler draws a seeded row's token with noise that must depend only on the request's seed and the
row's position (``noise_keys``), never on the rest of the batch: a counter-based hash of
(key, column), computed for every seeded row of a batch in one call (Triton on CUDA, this torch
reference on CPU; both give the same bits, see ``seeded_uniform_triton``). ``use_triton`` works as in
``kernels.api``. Checks read shapes and dtypes only, never values (no host sync on CUDA).
"""

from __future__ import annotations

import hashlib

import torch

from .api import _triton_wanted
from .triton.seeded_uniform_triton import GOLDEN, MIX_MUL_1, MIX_MUL_2, seeded_uniform_triton

MASK32 = 0xFFFFFFFF


def noise_keys(seeds_and_positions: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """``[(seed, position), ...]`` -> keys ``[rows, 2]`` int64: 64 bits of blake2b of ``"seed:position"``,
    as two 32-bit halves."""
    halves = []
    for seed, position in seeds_and_positions:
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        halves.append((int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")))
    return torch.tensor(halves, dtype=torch.int64).reshape(len(halves), 2).to(device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's uint32 hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL_1.value) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL_2.value) & MASK32
    return x ^ (x >> 15)


def seeded_uniform_reference(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys ``[rows, 2]`` int64 -> ``[rows, vocab]`` float32 (the Triton kernel's formula in torch)."""
    row_a = _mix32(keys[:, 0:1])                                                  # [rows, 1]
    row_b = _mix32(keys[:, 1:2] ^ GOLDEN.value)
    cols = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]   # [1, vocab]
    h = _mix32(_mix32((cols + row_a) & MASK32) ^ row_b)                           # [rows, vocab]
    return (h >> 8).to(torch.float32) * 2.0**-24


def seeded_uniform(keys: torch.Tensor, vocab: int, *, use_triton: bool | None = None) -> torch.Tensor:
    """Validated entry point: keys ``[rows, 2]`` int64 (each half in ``[0, 2**32)``) -> ``[rows, vocab]``."""
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[1] != 2:
        raise ValueError(f"keys: expected a [rows, 2] tensor, got {type(keys).__name__} "
                         f"{tuple(getattr(keys, 'shape', ()))}")
    if keys.dtype != torch.int64:
        raise ValueError(f"keys: expected dtype torch.int64, got {keys.dtype}")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"vocab: must be a positive int, got {vocab!r}")
    if not _triton_wanted(use_triton, keys.device):
        return seeded_uniform_reference(keys, vocab)
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    seeded_uniform_triton(keys.contiguous(), out)
    return out
