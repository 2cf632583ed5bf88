"""The block manager's side of moving blocks between replicas: an export holds the cached run (it survives
pressure until released), an import allocates uncached blocks above the watermark and caches them under the
export's chain, and adapter namespaces keep their chains apart."""

from __future__ import annotations

from pagedray.block_manager import BlockManager, namespace_root

BS = 4


def _cache_prompt(bm: BlockManager, seq_id: str, tokens: list[int]) -> None:
    bm.allocate_slots(seq_id, tokens, len(tokens))
    bm.free(seq_id)


def test_an_export_hold_keeps_its_blocks_through_pressure_until_released():
    bm = BlockManager(BS, 6)
    tokens = list(range(10, 22))                       # 3 full blocks
    _cache_prompt(bm, "a", tokens)
    held = bm.hold_cached_blocks(tokens)
    assert len(held) == 3 and bm.num_free_blocks == 3
    bm.allocate_slots("b", list(range(100, 112)), 12)  # takes the 3 other blocks: the held ones stay
    assert bm.hold_cached_blocks(tokens[:8]) == held[:2]
    bm.release_transfer(held[:2])
    bm.check_invariants()
    bm.release_transfer(held)
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 6 and bm.num_cached_prefix_tokens(tokens + [1]) == 12


def test_an_import_caches_its_blocks_under_the_chain_and_respects_the_watermark():
    bm = BlockManager(BS, 10, watermark=0.2)           # 2 blocks kept free
    tokens = list(range(40, 60))                        # 5 full blocks
    _cache_prompt(bm, "a", tokens[:4])                  # the first is cached here already
    cached, blocks, keys = bm.start_import(tokens, None, 5)
    assert cached == 1 and len(blocks) == 4 and bm.num_free_blocks == 6
    bm.check_invariants()
    bm.finish_import(blocks, keys)
    assert bm.num_cached_prefix_tokens(tokens + [1]) == 20 and bm.num_free_blocks == 10
    full = BlockManager(BS, 5, watermark=0.2)
    full.allocate_slots("x", list(range(200, 212)), 12)           # 3 of 5 blocks in use, 1 kept free
    cached, blocks, keys = full.start_import(tokens, None, 5)
    assert cached == 0 and len(blocks) == 1
    full.release_transfer(blocks)                                  # an import that never ran
    full.check_invariants()


def test_namespaces_keep_imported_chains_apart():
    bm = BlockManager(BS, 8)
    tokens = list(range(8))
    adapter = namespace_root(77)
    _, blocks, keys = bm.start_import(tokens, adapter, 2)
    bm.finish_import(blocks, keys)
    assert bm.num_cached_prefix_tokens(tokens + [1], adapter) == 8
    assert bm.num_cached_prefix_tokens(tokens + [1]) == 0 and bm.hold_cached_blocks(tokens) == []
