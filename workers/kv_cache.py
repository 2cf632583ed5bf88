"""This rank's paged KV shard: one preallocated tensor for every layer.

Layout (fixed by the interfaces): ``kv [num_layers, 2, num_blocks, block_size, kv_heads_local, head_dim]``;
layer l reads ``kv[l, 0]`` (K) and ``kv[l, 1]`` (V). Block ids are global, so block b on every rank
holds the same tokens for that rank's KV heads.

Capacity (``num_blocks``) is decided outside: from ``cache.num_blocks`` when set, else from the
configured GiB on CPU (``blocks_for_bytes``) or from free GPU memory after a profiling forward
(``memory_profile.py``). The engine takes the minimum over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int      # on this rank
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_bytes(self, num_bytes: float) -> int:
        return max(0, int(num_bytes // self.bytes_per_block))

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def check_block_copies(pairs: list[tuple[int, int]], num_blocks: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks):
            raise ValueError(f"block_copies: pair ({src}, {dst}) is outside [0, {num_blocks})")


def copy_blocks(kv: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: block src -> block dst in K and V of every layer, all pairs in one indexed copy.

    Pairs are applied as one gather then one scatter, so a dst that is also a src reads the old content.
    """
    if not pairs:
        return
    check_block_copies(pairs, kv.shape[2])
    index = torch.tensor(pairs, dtype=torch.long, device=kv.device)       # [pairs, 2]
    kv[:, :, index[:, 1]] = kv[:, :, index[:, 0]]
