"""This rank's paged KV shard: one preallocated tensor for every layer (and, 8-bit, one of scales).

Layout (fixed by the interfaces): ``data [num_layers, 2, num_blocks, block_size, kv_heads_local, head_dim]``;
layer l reads ``data[l, 0]`` (K) and ``data[l, 1]`` (V). Block ids are global, so block b on every rank
holds the same tokens for that rank's KV heads. With ``kv_cache_dtype`` int8 / fp8_e4m3 the data is
8-bit and ``scales [num_layers, 2, num_blocks, block_size, kv_heads_local]`` float16 holds each row's
scale (``kernels.kv_quant``); a block's scales travel with it (copy-on-write copies both).

Layers of different KV head shapes (Gemma 4: full-attention layers with their own ``head_dim`` and KV heads
next to the sliding ones; ``KVCacheSpec.layer_shapes``): one tensor per distinct shape, ``data`` the first
shape's and ``groups`` the others', each ``[layers of that shape, 2, num_blocks, block_size, kv_heads, head_dim]``;
``layer_map`` says which tensor and row holds KV layer l. Every layer's K / V view stays contiguous (what every
attention kernel takes) and a block costs exactly its layers' bytes: no row is padded to the widest layer.
Block ids are shared by all tensors (block b of every group holds the same tokens). Such a cache is never
8-bit (``KVCacheSpec`` refuses it: the row scales would need the same grouping).

Capacity (``num_blocks``) is decided outside: from ``cache.num_blocks`` when set, else from the
configured GiB on CPU (``blocks_for_bytes``) or from free GPU memory after a profiling forward
(``memory_profile.py``). The engine takes the minimum over ranks. A block's bytes count its scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from pagedray.kernels.kv_quant import SCALE_DTYPE, is_quantized


class KVLayer(NamedTuple):
    """One layer's caches: k / v [num_blocks, block_size, kv_heads_local, head_dim], and their row scales
    [num_blocks, block_size, kv_heads_local] float16 when 8-bit (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@dataclass(frozen=True)
class KVCache:
    data: torch.Tensor                 # [layers, 2, blocks, block_size, kv_heads_local, head_dim]
    scales: torch.Tensor | None = None  # [layers, 2, blocks, block_size, kv_heads_local] float16 (8-bit data)
    groups: tuple[torch.Tensor, ...] = ()          # other head shapes' tensors, laid out as ``data``
    layer_map: tuple[tuple[int, int], ...] = ()    # KV layer -> (0: data, g > 0: groups[g - 1]; its row there)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor holding blocks, in the order a block's bytes take them: the K/V data (``data``, then the
        groups), then the 8-bit row scales."""
        return (self.data,) + self.groups + ((self.scales,) if self.scales is not None else ())

    def layer(self, index: int) -> KVLayer:
        if self.layer_map:
            tensor, row = self.layer_map[index]
            t = self.groups[tensor - 1] if tensor else self.data
            return KVLayer(t[row, 0], t[row, 1], None, None)
        if self.scales is None:
            return KVLayer(self.data[index, 0], self.data[index, 1], None, None)
        return KVLayer(self.data[index, 0], self.data[index, 1], self.scales[index, 0], self.scales[index, 1])


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int      # on this rank (with ``layer_shapes``: the first layer's)
    head_dim: int
    dtype: torch.dtype     # the cache's storage dtype: the model's, or int8 / float8_e4m3fn
    layer_shapes: tuple[tuple[int, int], ...] = ()   # per KV layer (kv_heads_local, head_dim) where they differ

    def __post_init__(self) -> None:
        if self.layer_shapes and len(self.layer_shapes) != self.num_layers:
            raise ValueError(f"layer_shapes: {len(self.layer_shapes)} shapes for {self.num_layers} KV layers")
        if self.layer_shapes and is_quantized(self.dtype):
            raise ValueError(f"kv_cache_dtype: an 8-bit KV cache needs one KV head shape in every layer; this "
                             f"model's layers have {sorted(set(self.layer_shapes))} (kv_heads, head_dim) per rank: "
                             "use kv_cache_dtype 'auto'")

    def shape_groups(self) -> list[tuple[tuple[int, int], list[int]]]:
        """(kv_heads, head_dim) -> the KV layers of that shape, shapes in order of first appearance."""
        groups: dict[tuple[int, int], list[int]] = {}
        for layer, shape in enumerate(self.layer_shapes):
            groups.setdefault(tuple(shape), []).append(layer)
        return list(groups.items())

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        if self.layer_shapes:
            return 2 * self.block_size * element * sum(heads * dim for heads, dim in self.layer_shapes)
        rows = self.num_layers * 2 * self.block_size * self.num_kv_heads
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(self.dtype) else 0
        return rows * (self.head_dim * element + scale)

    def blocks_for_bytes(self, num_bytes: float) -> int:
        return max(0, int(num_bytes // self.bytes_per_block))

    def allocate(self, num_blocks: int, device: torch.device) -> KVCache:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        if self.layer_shapes:
            return self._allocate_groups(num_blocks, device)
        rows = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads)
        data = torch.zeros(rows + (self.head_dim,), dtype=self.dtype, device=device)
        scales = torch.zeros(rows, dtype=SCALE_DTYPE, device=device) if is_quantized(self.dtype) else None
        return KVCache(data, scales)

    def _allocate_groups(self, num_blocks: int, device: torch.device) -> KVCache:
        """One tensor per head shape (module docstring), ``layer_map`` pointing each KV layer at its row."""
        tensors, layer_map = [], [(0, 0)] * self.num_layers
        for index, ((heads, dim), layers) in enumerate(self.shape_groups()):
            tensors.append(torch.zeros((len(layers), 2, num_blocks, self.block_size, heads, dim), dtype=self.dtype,
                                       device=device))
            for row, layer in enumerate(layers):
                layer_map[layer] = (index, row)
        return KVCache(tensors[0], None, tuple(tensors[1:]), tuple(layer_map))


def check_block_copies(pairs: list[tuple[int, int]], num_blocks: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks):
            raise ValueError(f"block_copies: pair ({src}, {dst}) is outside [0, {num_blocks})")


def copy_blocks(kv: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: block src -> block dst in K and V of every layer (in every head-shape group, and their
    scales), all pairs in one indexed copy per tensor.

    Pairs are applied as one gather then one scatter, so a dst that is also a src reads the old content.
    """
    if not pairs:
        return
    check_block_copies(pairs, kv.num_blocks)
    index = torch.tensor(pairs, dtype=torch.long, device=kv.data.device)  # [pairs, 2]
    for t in kv.tensors:
        t[:, :, index[:, 1]] = t[:, :, index[:, 0]]
