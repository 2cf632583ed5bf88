"""A rank's KV blocks as bytes: the one layout the second tier's files and transfers between replicas share.

A block's bytes on a rank: for each cache tensor (``KVCache.tensors``: the K/V data, the other head shapes'
data, then the 8-bit row scales when the cache has them), that block's rows of every layer, K then V, in C
order: ``t[:, :, block]`` of
``data [layers, 2, blocks, block_size, kv_heads_local, head_dim]`` (and of ``scales [layers, 2, blocks,
block_size, kv_heads_local]``). ``read_blocks`` gives them block after block as ``[n, block_bytes]`` uint8 on
the host; ``write_blocks`` puts such rows back.

Re-sharding (``reshard_rows``): a replica with another TP size splits the KV heads differently
(``layers/partition.py``), so rank r of the destination builds its rows from the source ranks' rows, taking
each of its global KV heads from a source rank that holds it. A cache of several head shapes (``kv_cache.py``:
Gemma 4) is not re-sharded (ValueError): its blocks move only between replicas of one TP size.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .layers.partition import HeadPartition


def cache_tensors(kv: KVCache) -> list[torch.Tensor]:
    return list(kv.tensors)


def block_bytes(kv: KVCache) -> int:
    """Bytes of one block on this rank (its data rows and scales)."""
    return sum(t[:, :, 0].numel() * t.element_size() for t in cache_tensors(kv))


def _check_blocks(kv: KVCache, blocks: list[int], name: str) -> None:
    bad = [b for b in blocks if type(b) is not int or not 0 <= b < kv.num_blocks]  # noqa: E721
    if bad:
        raise ValueError(f"{name}: blocks {bad[:4]} are outside the cache (0..{kv.num_blocks - 1})")


def read_blocks(kv: KVCache, blocks: list[int], host: bool = True) -> torch.Tensor:
    """The bytes of ``blocks``: [n, block_bytes] uint8, one row per block in the order given (on the host, or on
    the cache's device with ``host=False``)."""
    _check_blocks(kv, blocks, "read_blocks")
    index = torch.tensor(blocks, dtype=torch.long, device=kv.data.device)
    parts = []
    for t in cache_tensors(kv):
        rows = t.index_select(2, index).movedim(2, 0).contiguous()             # [n, layers, 2, block_size, ...]
        parts.append(rows.view(torch.uint8).reshape(len(blocks), -1))       # [n, bytes of t per block]
    rows = torch.cat(parts, dim=1)                                           # [n, block_bytes]
    return rows.cpu() if host else rows


def _split_rows(kv: KVCache, rows: torch.Tensor, heads: int | None) -> list[torch.Tensor]:
    """``rows`` [n, bytes] of a rank holding ``heads`` KV heads (None: each tensor's own) -> one typed tensor per
    cache tensor, [n, layers, 2, block_size, heads, ...]."""
    n, out, offset = rows.shape[0], [], 0
    for t in cache_tensors(kv):
        shape = (t.shape[0], t.shape[1], t.shape[3], t.shape[4] if heads is None else heads) + tuple(t.shape[5:])
        size = t.element_size()
        for dim in shape:
            size *= dim
        out.append(rows[:, offset:offset + size].contiguous().view(t.dtype).reshape((n,) + shape))
        offset += size
    if offset != rows.shape[1]:
        raise ValueError(f"rows: {rows.shape[1]} bytes per block, expected {offset} for "
                         f"{'this cache' if heads is None else heads} KV heads")
    return out


def write_blocks(kv: KVCache, blocks: list[int], rows: torch.Tensor) -> None:
    """``rows`` [n, block_bytes] uint8 (``read_blocks``' layout, this rank's heads) into ``blocks``."""
    _check_blocks(kv, blocks, "write_blocks")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape != (len(blocks), block_bytes(kv)):
        raise ValueError(f"rows: expected uint8 [{len(blocks)}, {block_bytes(kv)}], got {rows.dtype} "
                         f"{list(rows.shape)}")
    index = torch.tensor(blocks, dtype=torch.long, device=kv.data.device)
    for t, typed in zip(cache_tensors(kv), _split_rows(kv, rows, None)):
        t.index_copy_(2, index, typed.movedim(0, 2).to(t.device))


def reshard_rows(kv: KVCache, shards: list[torch.Tensor], partitions: list[HeadPartition],
                 own: HeadPartition) -> torch.Tensor:
    """This rank's rows [n, block_bytes] built from the rows of every source rank (``shards[s]`` [n, bytes]
    holds the KV heads of ``partitions[s]``): each of ``own``'s KV heads comes from a source rank holding it."""
    if kv.groups:
        raise ValueError("shards: KV blocks of layers with different head shapes are not re-sharded across tensor "
                         "parallel sizes (export and import with the same tensor_parallel_size)")
    holder: dict[int, tuple[int, int]] = {}                  # global KV head -> (source rank, its local index)
    for s, part in enumerate(partitions):
        for i in range(part.num_local_kv_heads):
            holder.setdefault(part.first_kv_head + i, (s, i))
    wanted = range(own.first_kv_head, own.first_kv_head + own.num_local_kv_heads)
    missing = [g for g in wanted if g not in holder]
    if missing:
        raise ValueError(f"shards: no source rank holds KV heads {missing}")
    typed = [_split_rows(kv, rows, part.num_local_kv_heads) for rows, part in zip(shards, partitions)]
    parts = []
    for j in range(len(cache_tensors(kv))):
        heads = [typed[holder[g][0]][j][:, :, :, :, holder[g][1]] for g in wanted]
        stacked = torch.stack(heads, dim=4).contiguous()                  # [n, layers, 2, block_size, heads, ...]
        parts.append(stacked.view(torch.uint8).reshape(stacked.shape[0], -1))
    return torch.cat(parts, dim=1)
