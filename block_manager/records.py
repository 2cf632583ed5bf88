"""Plain result records returned by the block manager."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Allocation:
    """What ``BlockManager.allocate_slots`` did.

    ``num_cached_tokens``: tokens attached from the prefix cache by this call (non-zero only for
    the call that registers a sequence); ``new_block_ids``: blocks appended to the block table by
    this call, in table order (the cached prefix blocks first, for a new sequence).
    """

    num_cached_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    # a hybrid model's registration (state_pool.py): the snapshot slot its seat starts from (-1: from zeros), and
    # the positions (block ends) at which its prefill takes snapshots for the prefix cache
    state_source: int = -1
    snapshot_points: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockManagerStats:
    num_blocks: int
    num_free_blocks: int
    usage: float  # fraction of blocks referenced by a sequence, 0..1
    prefix_query_tokens: int  # prompt tokens looked up when sequences were registered
    prefix_hit_tokens: int  # of those, tokens served from the prefix cache
    prefix_hit_rate: float  # hit / query, 0.0 when nothing was queried
    num_sequences: int = 0
    num_cached_blocks: int = 0  # blocks findable by the prefix cache (referenced or free)
    num_evictions: int = 0  # cached keys dropped because their block was handed out again
    num_pinned_blocks: int = 0  # blocks pinned by sessions (session_pins.py)
    num_pinned_sessions: int = 0
    num_pin_evictions: int = 0  # pinned blocks handed out anyway (no unpinned block was free)
    num_tier_blocks: int = 0  # blocks held by the second KV tier (offload_tier.py)
    num_tier_saves: int = 0  # evicted cached blocks saved to the tier
    num_tier_loaded: int = 0  # tier blocks loaded back into the cache (prefix hits in the second tier)
    num_tier_load_failures: int = 0  # loads that failed on a rank (a miss: computed again)
    num_state_slots: int = 0  # a hybrid model's state slots (state_pool.py; 0: none)
    num_free_state_slots: int = 0
