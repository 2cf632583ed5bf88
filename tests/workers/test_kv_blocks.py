"""A rank's blocks as bytes (workers/kv_blocks.py): reading and writing round-trip any blocks of random caches
(with 8-bit scales too), and re-sharding builds each rank's heads from the source ranks exactly as slicing the
full-head cache would."""

from __future__ import annotations

import pytest
import torch
from pagedray.workers.kv_blocks import block_bytes, read_blocks, reshard_rows, write_blocks
from pagedray.workers.kv_cache import KVCache
from pagedray.workers.layers.partition import HeadPartition

LAYERS, BLOCKS, BLOCK_SIZE, DIM = 2, 6, 4, 8


def _cache(heads: int, quantized: bool, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, heads)
    if quantized:
        data = torch.randint(-128, 127, shape + (DIM,), generator=g, dtype=torch.int8)
        return KVCache(data, torch.rand(shape, generator=g).to(torch.float16))
    return KVCache(torch.randn(shape + (DIM,), generator=g).to(torch.bfloat16))


def _heads(kv: KVCache, first: int, count: int) -> KVCache:
    """The cache a rank holding KV heads [first, first + count) would have."""
    scales = None if kv.scales is None else kv.scales[..., first:first + count].clone()
    return KVCache(kv.data[:, :, :, :, first:first + count].clone(), scales)


@pytest.mark.parametrize("quantized", [False, True])
def test_blocks_round_trip_in_any_order(quantized):
    source, target = _cache(2, quantized, 1), _cache(2, quantized, 2)
    rows = read_blocks(source, [4, 0, 2])
    assert rows.dtype == torch.uint8 and rows.shape == (3, block_bytes(source))
    write_blocks(target, [1, 5, 3], rows)
    for s, t in ((4, 1), (0, 5), (2, 3)):
        assert torch.equal(target.data[:, :, t], source.data[:, :, s])
        if quantized:
            assert torch.equal(target.scales[:, :, t], source.scales[:, :, s])
    assert torch.equal(target.data[:, :, 0], _cache(2, quantized, 2).data[:, :, 0])    # the others untouched


def test_bad_blocks_and_rows_are_refused():
    kv = _cache(2, False, 1)
    with pytest.raises(ValueError, match="read_blocks: blocks \\[6\\]"):
        read_blocks(kv, [6])
    with pytest.raises(ValueError, match="rows: expected uint8"):
        write_blocks(kv, [0], torch.zeros(1, 3, dtype=torch.uint8))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("heads,source_tp,target_tp", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 1, 4), (1, 1, 2)])
def test_resharding_matches_slicing_the_full_cache(quantized, heads, source_tp, target_tp):
    full = _cache(heads, quantized, 3)
    num_heads = 4 * max(heads, target_tp, source_tp)              # query heads: enough for every split
    sources = [HeadPartition(num_heads, heads, source_tp, s) for s in range(source_tp)]
    shards = [read_blocks(_heads(full, p.first_kv_head, p.num_local_kv_heads), [1, 4]) for p in sources]
    for rank in range(target_tp):
        own = HeadPartition(num_heads, heads, target_tp, rank)
        expected = _heads(full, own.first_kv_head, own.num_local_kv_heads)
        target = _cache(own.num_local_kv_heads, quantized, 9)
        write_blocks(target, [0, 2], reshard_rows(target, shards, sources, own))
        assert torch.equal(target.data[:, :, [0, 2]], expected.data[:, :, [1, 4]])
        if quantized:
            assert torch.equal(target.scales[:, :, [0, 2]], expected.scales[:, :, [1, 4]])


def test_a_cache_of_several_head_shapes_round_trips_copies_and_refuses_resharding():
    """Gemma 4's layout (kv_cache.py): one tensor per head shape, every layer's view contiguous, a block's bytes
    exactly its layers' rows; blocks round-trip and copy-on-write copies reach every group."""
    from pagedray.workers.kv_cache import KVCacheSpec, copy_blocks

    shapes = ((2, 8), (1, 16), (2, 8))
    spec = KVCacheSpec(3, BLOCK_SIZE, 2, 8, torch.float32, layer_shapes=shapes)
    source, target = spec.allocate(BLOCKS, torch.device("cpu")), spec.allocate(BLOCKS, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for t in source.tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    assert [tuple(t.shape) for t in source.tensors] == [(2, 2, BLOCKS, BLOCK_SIZE, 2, 8),
                                                        (1, 2, BLOCKS, BLOCK_SIZE, 1, 16)]
    views = [source.layer(i) for i in range(3)]
    assert [tuple(v.k.shape[2:]) for v in views] == list(shapes) and all(v.k.is_contiguous() for v in views)
    assert views[2].k.data_ptr() == source.data[1, 0].data_ptr()      # layer 2 is the first shape's second row
    assert block_bytes(source) == spec.bytes_per_block == 2 * BLOCK_SIZE * 4 * (16 + 16 + 16)
    write_blocks(target, [1, 5], read_blocks(source, [4, 0]))
    copy_blocks(target, [(1, 2)])
    for i in range(3):
        for s, t in ((4, 1), (0, 5), (4, 2)):
            assert torch.equal(target.layer(i).k[t], source.layer(i).k[s])
            assert torch.equal(target.layer(i).v[t], source.layer(i).v[s])
    part = HeadPartition(4, 2, 1, 0)
    with pytest.raises(ValueError, match="re-sharded"):
        reshard_rows(source, [read_blocks(source, [0])], [part], part)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCacheSpec(3, BLOCK_SIZE, 2, 8, torch.int8, layer_shapes=shapes)
