"""BlockManager: the only owner of sequence -> block table in pagedray.

A sequence's table lists the blocks holding its K/V slots in order; slot ``p`` lives at
``table[p // block_size] * block_size + p % block_size``. ``num_slots`` counts the slots reserved
(tokens whose K/V are computed or scheduled this step).

Invariants (``check_invariants`` asserts them, together with the pool's):
- every block is free xor referenced, and a block's ref count equals the number of block tables
  holding it; no block appears twice in one table;
- ``len(table) == ceil(num_slots / block_size)``: a table holds exactly the blocks its slots need;
- a partially filled last block (the one the next slot is written into) is private: ref count 1
  and no cache key. Full blocks are never written again, so they can be shared freely;
- with prefix caching, the first ``num_hashed`` blocks of a table are full and their content keys
  are known (``last_key``); ``num_hashed == num_slots // block_size``, except that a full block holding
  a slot reserved for a token not known yet (``pending_tokens``, the engine's async scheduling) is
  hashed only by a later ``allocate_slots`` that is given that token: ``num_hashed <= num_slots //
  block_size``;
- freeing every sequence returns the pool to all-free with ref counts 0; cached keys stay findable
  until their block is handed out again;
- ``truncate`` (speculative decoding's rollback) only gives back slots past the hashed blocks, so a
  rejected token is never in the prefix cache, and copies a shared partial last block before it is
  written again.

Decisions: docs/design/block_manager.md, ``pagedray.block_manager.manager``.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from .block_pool import BlockPool
from .errors import CannotAllocateError, DoubleFreeError, SequenceExistsError, UnknownSequenceError
from .offload_tier import OffloadTier
from .prefix_key import BlockKey, is_namespace_root
from .records import Allocation, BlockManagerStats
from .session_pins import SessionPins
from .state_pool import StatePool

_NEVER = float("inf")  # next_hash_at when prefix caching is off


class _SeqBlocks:
    """One sequence's blocks. ``next_hash_at``: num_slots at which block ``num_hashed`` becomes full."""

    __slots__ = ("table", "num_slots", "num_hashed", "last_key", "next_hash_at")

    def __init__(self, table: list[int], num_slots: int, num_hashed: int, last_key: BlockKey | None,
                 next_hash_at: float) -> None:
        self.table = table
        self.num_slots = num_slots
        self.num_hashed = num_hashed
        self.last_key = last_key
        self.next_hash_at = next_hash_at


def _require_count(name: str, value: object) -> int:
    if type(value) is not int or value < 0:  # noqa: E721  (bool is not a count)
        raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    return value


class BlockManager:
    """Global KV block allocator: block tables, prefix cache, fork/CoW, slot mapping."""

    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.0, pin_budget: int = 0, pin_ttl_s: float = 300.0, tier_slots: int = 0,
                 num_state_slots: int = 0, num_state_snapshots: int = 0) -> None:
        """``pin_budget``: blocks session pins may hold (0: no pins; ``session_pins.py``), for ``pin_ttl_s``;
        ``tier_slots``: blocks the ranks' second KV tier holds (0: none; ``offload_tier.py``);
        ``num_state_slots``: a hybrid model's state slots (0: none; ``state_pool.py``): every registered
        sequence then holds one, taken at registration and fork, given back by ``free``; ``num_state_snapshots``:
        the states its prefix cache keeps (a hit on a hybrid model's prefix needs one: ``state_pool.py``)."""
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {block_size!r}")
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks: must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching: must be a bool, got {enable_prefix_caching!r}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark: must be a number in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = float(watermark)
        self.watermark_blocks = int(watermark * num_blocks)
        self.pool = BlockPool(num_blocks)
        self.states = StatePool(num_state_slots, num_state_snapshots if enable_prefix_caching else 0) \
            if num_state_slots else None
        self.pins = SessionPins(self.pool, pin_budget, pin_ttl_s) if pin_budget and enable_prefix_caching else None
        self.tier = OffloadTier(tier_slots) if tier_slots and enable_prefix_caching else None
        self._saves: list[tuple[int, int]] = []           # (block, slot) for the next plan
        self._loads: list[tuple[int, int]] = []           # (slot, block) for the next plan
        self._loading: dict[int, tuple[int, BlockKey]] = {}   # slot -> (block, key) of loads not yet finished
        self.num_tier_loaded = self.num_tier_load_failures = 0
        self._transfer_holds: collections.Counter[int] = collections.Counter()   # block -> exports/imports on it
        if self.tier is not None:
            self.pool.on_evict = self._save_evicted
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._recently_freed: OrderedDict[Hashable, None] = OrderedDict()
        self._recently_freed_cap = max(1024, num_blocks)
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._prefix_hits: dict[BlockKey, int] = {}   # deepest block a prefix hit reused -> hits (hot_prefixes)
        self._trailing: dict[Hashable, BlockKey] = {}  # a decoding hybrid sequence's latest state snapshot

    # -- prefix lookup ----------------------------------------------------------------------------
    def _cached_prefix(self, token_ids: Sequence[int], root: BlockKey | None = None, whole: bool = False
                       ) -> tuple[list[int], BlockKey | None]:
        """Blocks of the longest cached run of full blocks of ``token_ids`` (leaving >= 1 token, unless
        ``whole``) under ``root`` (``prefix_key.namespace_root``; None: the base model's chains), and the last
        one's key (the root itself when none is cached)."""
        blocks: list[int] = []
        key = root
        if not self.enable_prefix_caching:
            return blocks, key
        bs = self.block_size
        pool = self.pool
        for i in range(len(token_ids) // bs if whole else max(0, (len(token_ids) - 1) // bs)):
            block_id = pool.lookup(BlockKey(key, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block_id is None:
                break
            key = pool.key_of(block_id)  # the canonical object: later equality checks stop at it
            blocks.append(block_id)
        return blocks, key

    def _reusable_prefix(self, token_ids: Sequence[int], root: BlockKey | None = None
                         ) -> tuple[list[int], BlockKey | None, int]:
        """``_cached_prefix`` as a new sequence may attach it, and how many blocks the cache holds: with a state
        pool (a hybrid model) the run is cut back to its deepest block that has a state snapshot, since the
        sequence must start its linear layers from the state at that point (``state_pool.py``)."""
        blocks, key = self._cached_prefix(token_ids, root)
        num_cached = len(blocks)
        if self.states is not None:
            while blocks and not self.states.has_snapshot(key):
                blocks.pop()
                key = self.pool.key_of(blocks[-1]) if blocks else root
        return blocks, key, num_cached

    def cached_prefix_hashes(self, limit: int) -> list[int]:
        """Hashes of at most ``limit`` cached full-block keys (referenced blocks first, then the last to
        be evicted): a bounded summary of this cache for request routing. ``prefix_block_hashes`` gives
        the same hashes for a prompt's blocks."""
        _require_count("limit", limit)
        return self.pool.cached_key_hashes(limit) if self.enable_prefix_caching else []

    def tier_key_hashes(self, limit: int) -> list[int]:
        """Hashes of at most ``limit`` keys in the second tier (none without one), most recently used first: what
        a prompt reaching them would load instead of computing (``prefix_block_hashes`` gives a prompt's)."""
        _require_count("limit", limit)
        return self.tier.key_hashes(limit) if self.tier is not None else []

    def _count_hit(self, key: BlockKey) -> None:
        hits = self._prefix_hits
        hits[key] = hits.get(key, 0) + 1
        if len(hits) > 4 * self.num_blocks:       # bounded: forget the keys whose blocks were evicted
            self._prefix_hits = {k: n for k, n in hits.items() if self.pool.lookup(k) is not None}

    def hot_prefixes(self, max_tokens: int) -> list[list[int]]:
        """Token ids of the cached prefixes that prefix hits reused most, most hits first, at most
        ``max_tokens`` tokens in all: each runs from the first token to the end of the deepest block a
        hit reused (whole blocks); among equally reused ones the longest first, and a prefix inside one
        already chosen is left out. For warming another replica's cache (deploy/serve/warm_up.py)."""
        _require_count("max_tokens", max_tokens)
        chains = []
        for key, hits in self._prefix_hits.items():
            if self.pool.lookup(key) is None:
                continue                           # evicted since
            chain, node = [], key
            while node is not None:
                chain.append(node)
                node = node.parent
            if is_namespace_root(chain[-1]):
                continue                           # an adapter's prefix: warming it needs the adapter
            chains.append((hits, chain[::-1]))
        chains.sort(key=lambda item: (-item[0], -len(item[1])))   # most hits, then the longest
        covered: set[BlockKey] = set()
        prefixes, used = [], 0
        for _, chain in chains:
            tokens = [t for block in chain for t in block.token_ids]
            if chain[-1] in covered or used + len(tokens) > max_tokens:
                continue
            prefixes.append(tokens)
            used += len(tokens)
            covered.update(chain)
        return prefixes

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], root: BlockKey | None = None) -> int:
        """Tokens covered by the longest run of cached full blocks (under ``root``) a new sequence may attach
        (``_reusable_prefix``), always < len(token_ids)."""
        return len(self._reusable_prefix(token_ids, root)[0]) * self.block_size

    # -- admission / growth -----------------------------------------------------------------------
    def _blocks_to_take(self, seq: _SeqBlocks | None, token_ids: Sequence[int], num_new_tokens: int,
                        reuse_cached: bool = True, pending_tokens: int = 0, root: BlockKey | None = None
                        ) -> tuple[int, list[int], BlockKey | None, int]:
        """(free blocks the call would consume, cached prefix blocks, their last key, the blocks the cache holds
        of ``token_ids``: more than those attached when a hybrid's snapshots stop short); validates."""
        _require_count("num_new_tokens", num_new_tokens)
        _require_count("pending_tokens", pending_tokens)
        if seq is None and pending_tokens:
            raise ValueError(f"pending_tokens: a sequence being registered has every token known, got {pending_tokens}")
        bs = self.block_size
        if seq is not None:
            total = seq.num_slots + num_new_tokens
            needed, hit_blocks, last_key, num_cached = -(-total // bs) - len(seq.table), [], None, 0
        else:
            hit_blocks, last_key, num_cached = self._reusable_prefix(token_ids, root) if reuse_cached else ([], root, 0)
            total = len(hit_blocks) * bs + num_new_tokens
            revived = sum(1 for b in hit_blocks if self.pool.ref_count(b) == 0)
            needed = -(-total // bs) - len(hit_blocks) + revived
        if len(token_ids) + pending_tokens < total:
            raise ValueError(f"token_ids: {len(token_ids)} tokens given (+ {pending_tokens} pending) but {total} "
                             f"slots would be reserved (num_new_tokens={num_new_tokens})")
        return max(needed, 0), hit_blocks, last_key, num_cached

    def can_allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                     reuse_cached: bool = True, pending_tokens: int = 0, root: BlockKey | None = None) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed.

        For an unknown ``seq_id`` the prefix-cache hit is included and ``watermark_blocks`` must stay free.
        """
        seq = self._seqs.get(seq_id)
        if seq is None and self.states is not None and not self.states.num_free:
            return False
        needed = self._blocks_to_take(seq, token_ids, num_new_tokens, reuse_cached, pending_tokens, root)[0]
        reserve = 0 if seq is not None else self.watermark_blocks
        return self.pool.num_free_blocks - needed >= reserve

    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       reuse_cached: bool = True, pending_tokens: int = 0, root: BlockKey | None = None
                       ) -> Allocation:
        """Reserve ``num_new_tokens`` more slots (a prefill chunk, or 1 per decode step).

        An unknown ``seq_id`` is registered first with its cached prefix attached (none with
        ``reuse_cached=False``: a sequence that must compute every position; its own full blocks are
        still cached for others). ``token_ids`` are the
        sequence's tokens (at least ``num_slots`` after the call, counting ``pending_tokens``: trailing
        slots of a running sequence whose tokens are not known yet); blocks that become full are hashed
        from them (a block with a pending slot waits for a later call that knows its tokens). ``root``
        (registration only): the namespace its chains start from (``prefix_key.namespace_root``: a LoRA
        adapter's), so that its blocks are shared only with sequences of the same namespace.
        Raises CannotAllocateError (nothing changed) when the pool is short of blocks.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._check_state_slot(seq_id)
            allocation = self._register(seq_id, token_ids, num_new_tokens, reuse_cached, pending_tokens, root)
            if self.states is not None:
                self.states.acquire(seq_id)
            return allocation
        # decode fast path: validate, bump the slot count, touch the pool only at block boundaries
        if type(num_new_tokens) is not int or num_new_tokens < 0:  # noqa: E721
            _require_count("num_new_tokens", num_new_tokens)
        if type(pending_tokens) is not int or pending_tokens < 0:  # noqa: E721
            _require_count("pending_tokens", pending_tokens)
        total = seq.num_slots + num_new_tokens
        if len(token_ids) + pending_tokens < total:
            raise ValueError(f"token_ids: {len(token_ids)} tokens given (+ {pending_tokens} pending) but {total} "
                             f"slots would be reserved (num_new_tokens={num_new_tokens})")
        table = seq.table
        missing = -(-total // self.block_size) - len(table)
        new_ids = self.pool.allocate(missing) if missing > 0 else []
        table += new_ids
        seq.num_slots = total
        if total >= seq.next_hash_at:
            self._hash_full_blocks(seq, token_ids)
        return Allocation(0, new_ids)

    def add_slot(self, seq_id: Hashable, token_ids: Sequence[int], pending_tokens: int = 0) -> bool:
        """One more slot for a registered sequence when it lies in the sequence's last block (most decode
        steps): ``allocate_slots(seq_id, token_ids, 1, pending_tokens=...)`` without its block search. Returns
        False, changing nothing, when the slot needs a new block (call ``allocate_slots`` then)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._get(seq_id)
        total = seq.num_slots + 1
        if total > len(seq.table) * self.block_size:
            return False
        if len(token_ids) + pending_tokens < total:
            raise ValueError(f"token_ids: {len(token_ids)} tokens given (+ {pending_tokens} pending) but {total} "
                             "slots would be reserved (num_new_tokens=1)")
        seq.num_slots = total
        if total >= seq.next_hash_at:
            self._hash_full_blocks(seq, token_ids)
        return True

    def _register(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                  reuse_cached: bool, pending_tokens: int = 0, root: BlockKey | None = None) -> Allocation:
        needed, hit_blocks, last_key, num_cached = self._blocks_to_take(None, token_ids, num_new_tokens, reuse_cached,
                                                                        pending_tokens, root)
        pool = self.pool
        if needed > pool.num_free_blocks:
            raise CannotAllocateError(needed, pool.num_free_blocks, f"registering sequence {seq_id!r}")
        for block_id in hit_blocks:
            pool.touch(block_id)
        num_hit = len(hit_blocks)
        bs = self.block_size
        total = num_hit * bs + num_new_tokens
        table = hit_blocks + pool.allocate(-(-total // bs) - num_hit)
        next_hash_at = (num_hit + 1) * bs if self.enable_prefix_caching else _NEVER
        seq = _SeqBlocks(table, total, num_hit, last_key, next_hash_at)
        self._seqs[seq_id] = seq
        self._recently_freed.pop(seq_id, None)
        if self.enable_prefix_caching:
            self._prefix_query_tokens += len(token_ids)
            self._prefix_hit_tokens += num_hit * bs
            if hit_blocks:
                self._count_hit(last_key)
        if total >= next_hash_at:
            self._hash_full_blocks(seq, token_ids)
        if self.states is None or not self.states.num_snapshots:
            return Allocation(num_hit * bs, list(table))
        # a hybrid model: its seat starts from the hit's snapshot; it takes snapshots where its prompt leaves the
        # cached blocks (a branch point of prompts sharing them) and at the end of its last full block
        source = self.states.snapshot_of(last_key) if num_hit else -1
        points = sorted({p for p in (num_cached * bs, len(token_ids) // bs * bs) if p > num_hit * bs})
        return Allocation(num_hit * bs, list(table), source, tuple(points))

    def _hash_full_blocks(self, seq: _SeqBlocks, token_ids: Sequence[int]) -> None:
        """Key and cache every block of ``seq`` that became full since the last call and whose tokens
        are all in ``token_ids``."""
        bs = self.block_size
        pool = self.pool
        key = seq.last_key
        num_full = min(seq.num_slots, len(token_ids)) // bs
        for i in range(seq.num_hashed, num_full):
            key = pool.cache(seq.table[i], BlockKey(key, tuple(token_ids[i * bs:(i + 1) * bs])))
        seq.last_key = key
        seq.num_hashed = num_full
        seq.next_hash_at = (num_full + 1) * bs

    # -- fork / free -------------------------------------------------------------------------
    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """Register ``child_id`` sharing the parent's blocks; return the (src, dst) block copies.

        Full blocks are shared by ref count. A partially filled last block is copied eagerly into a
        fresh private block for the child (copy-on-write done at fork time).
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(f"child_id: sequence {child_id!r} is already registered")
        self._check_state_slot(child_id)
        bs = self.block_size
        partial = parent.num_slots % bs != 0
        copies: list[tuple[int, int]] = []
        table = list(parent.table)
        if partial:
            if self.pool.num_free_blocks < 1:
                self._no_room(1, child_id)
            dst = self.pool.allocate(1)[0]
            copies.append((table[-1], dst))
            table[-1] = dst
        for block_id in table[:-1] if partial else table:
            self.pool.touch(block_id)
        self._seqs[child_id] = _SeqBlocks(table, parent.num_slots, parent.num_hashed, parent.last_key,
                                          parent.next_hash_at)
        if self.states is not None:
            self.states.acquire(child_id)
        self._recently_freed.pop(child_id, None)
        return copies

    def _check_state_slot(self, seq_id: Hashable) -> None:
        """RuntimeError, before anything changes, when a new sequence would find no state slot: the scheduler
        runs at most ``max_num_seqs`` sequences, as many as there are slots, so this is a bug to report."""
        if self.states is not None and not self.states.num_free:
            raise RuntimeError(f"state pool: all {self.states.num_slots} state slots are held (sequence {seq_id!r})")

    def trail_state_snapshot(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """A decode step's snapshot: ``reserve_state_snapshot`` at the block ``num_tokens`` ends, when that block is
        hashed already (None when its last token is still pending: async scheduling), giving back the sequence's
        previous trailing snapshot. A finished sequence's last one stays cached, for a conversation's next turn."""
        seq = self._get(seq_id)
        if self.states is None or num_tokens % self.block_size or not 0 < num_tokens // self.block_size \
                <= seq.num_hashed:
            return None
        key = self._block_key(seq, num_tokens)
        slot = self.states.reserve_snapshot(key)
        if slot is not None:
            previous = self._trailing.get(seq_id)
            if previous is not None:
                self.states.release_snapshot(previous)
            self._trailing[seq_id] = key
        return slot

    def reserve_state_snapshot(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """A snapshot slot for the state ``seq_id`` reaches after its first ``num_tokens`` tokens (a multiple of
        the block size, within its hashed blocks), kept under the key of the block they end (``state_pool.py``):
        the step computing that token writes it. None when that key has one already or every snapshot slot is
        pending; ValueError for a position that ends no hashed block."""
        seq = self._get(seq_id)
        bs = self.block_size
        if self.states is None or type(num_tokens) is not int or num_tokens % bs \
                or not 0 < num_tokens // bs <= seq.num_hashed:  # noqa: E721
            raise ValueError(f"num_tokens: {num_tokens!r} does not end one of the {seq.num_hashed} hashed blocks of "
                             f"sequence {seq_id!r} (or this block manager keeps no states)")
        return self.states.reserve_snapshot(self._block_key(seq, num_tokens))

    def _block_key(self, seq: _SeqBlocks, num_tokens: int) -> BlockKey:
        """The key of ``seq``'s hashed block that ends at token ``num_tokens``."""
        key = seq.last_key
        for _ in range(seq.num_hashed - num_tokens // self.block_size):
            key = key.parent
        return key

    def commit_state_snapshots(self) -> None:
        """The snapshots reserved for earlier plans are written: prefix lookups may use them from now on."""
        if self.states is not None:
            self.states.commit_snapshots()

    def state_slot(self, seq_id: Hashable) -> int:
        """The sequence's state slot (a hybrid model's; ``state_pool.py``), or -1 without a state pool."""
        return -1 if self.states is None else self.states.slot_of(seq_id)

    def truncate(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]:
        """Roll ``seq_id`` back to its first ``num_slots`` slots (speculative tokens the target model rejected);
        return the (src, dst) block copies the workers must apply first.

        The slots given back must not reach into the hashed blocks (a block is hashed only once its tokens
        are accepted: speculative slots are reserved as ``pending_tokens``), so the prefix cache never holds
        a rejected token of this sequence. Blocks past the new last one are released; a new last block that is
        partial and shared with a forked sequence (ref count > 1), or cached (a fork taken while drafts were
        pending hashed them as its own tokens), is copied into a private block first (copy-on-write), so the
        sharer and the cache keep their content. Raises ValueError (``num_slots``) or CannotAllocateError for that
        copy; either leaves everything as it was.
        """
        seq = self._get(seq_id)
        _require_count("num_slots", num_slots)
        bs = self.block_size
        if num_slots > seq.num_slots:
            raise ValueError(f"num_slots: {num_slots} is more than the {seq.num_slots} slots of sequence {seq_id!r}")
        hashed = min(seq.num_hashed * bs, seq.num_slots) if self.enable_prefix_caching else 0
        if num_slots < hashed:
            raise ValueError(f"num_slots: {num_slots} would cut into the {seq.num_hashed} hashed (accepted) blocks "
                             f"of sequence {seq_id!r}")
        keep = -(-num_slots // bs)
        copies: list[tuple[int, int]] = []
        last = seq.table[keep - 1] if keep else None
        if num_slots % bs and (self.pool.ref_count(last) > 1 or self.pool.key_of(last) is not None):
            if self.pool.num_free_blocks < 1:
                self._no_room(1, seq_id)
            dst = self.pool.allocate(1)[0]
            copies.append((seq.table[keep - 1], dst))
            self.pool.release(seq.table[keep - 1])
            seq.table[keep - 1] = dst
        for block_id in reversed(seq.table[keep:]):
            self.pool.release(block_id)
        del seq.table[keep:]
        seq.num_slots = num_slots
        return copies

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id`` (last block first, so the prefix is evicted last)."""
        seq = self._get(seq_id, freeing=True)
        del self._seqs[seq_id]
        if self.states is not None:
            self.states.release(seq_id)
            self._trailing.pop(seq_id, None)
        release = self.pool.release
        for block_id in reversed(seq.table):
            release(block_id)
        self._recently_freed[seq_id] = None
        if len(self._recently_freed) > self._recently_freed_cap:
            self._recently_freed.popitem(last=False)

    # -- the second KV tier ---------------------------------------------------------------------
    def _save_evicted(self, block_id: int, key: BlockKey) -> None:
        self._saves.append((block_id, self.tier.save(key)))

    def tier_prefix(self, token_ids: Sequence[int], root: BlockKey | None = None) -> list[tuple[BlockKey, int]]:
        """The (key, tier slot) of each block of ``token_ids`` right after its cached prefix that the tier
        holds, in order (none without a tier); the same bound as the prefix cache (>= 1 token left)."""
        if self.tier is None:
            return []
        blocks, key = self._cached_prefix(token_ids, root)
        bs, hits = self.block_size, []
        for i in range(len(blocks), max(0, (len(token_ids) - 1) // bs)):
            key = BlockKey(key, tuple(token_ids[i * bs:(i + 1) * bs]))
            slot = self.tier.lookup(key)
            if slot is None:
                break
            hits.append((key, slot))
        return hits

    def start_loads(self, hits: list[tuple[BlockKey, int]]) -> list[int]:
        """Loads ``tier_prefix``'s hits into free blocks (the next plan carries them); returns their slots.
        The blocks stay referenced and uncached until ``finish_loads``. CannotAllocateError (nothing changed)
        when fewer blocks are free."""
        if len(hits) > self.pool.num_free_blocks:
            raise CannotAllocateError(len(hits), self.pool.num_free_blocks, "second-tier loads")
        slots = [self.tier.take(key) for key, _ in hits]     # first: the allocation below may save into the tier
        for (key, _), slot, block in zip(hits, slots, self.pool.allocate(len(hits))):
            self._loads.append((slot, block))
            self._loading[slot] = (block, key)
        return slots

    def loads_in_flight(self, slots: list[int]) -> bool:
        return any(slot in self._loading for slot in slots)

    def finish_loads(self, loads: list[tuple[int, int]], failed: list[int]) -> None:
        """A plan's loads ran: each loaded block joins the prefix cache under its key (then free, findable), a
        failed one is freed uncached."""
        failed_set = set(failed)
        for slot, _ in loads:
            block, key = self._loading.pop(slot)
            if slot in failed_set:
                self.num_tier_load_failures += 1
            else:
                self.pool.cache(block, key)
                self.num_tier_loaded += 1
            self.pool.release(block)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The saves and loads the next plan carries (each once); the slots its loads read are free again."""
        transfers = (self._saves, self._loads)
        self._saves, self._loads = [], []
        if self.tier is not None:
            self.tier.release_held()
        return transfers

    # -- moving blocks between replicas (cluster/kv_transfers.py) -----------------------------------
    def hold_cached_blocks(self, token_ids: Sequence[int], root: BlockKey | None = None) -> list[int]:
        """The blocks of the longest cached run of full blocks of ``token_ids`` (every full block may count),
        each held (one reference more) until ``release_transfer``: an export reads them in a later plan."""
        blocks, _ = self._cached_prefix(token_ids, root, whole=True)
        for block in blocks:
            self.pool.touch(block)
            self._transfer_holds[block] += 1
        return blocks

    def start_import(self, token_ids: Sequence[int], root: BlockKey | None, max_blocks: int
                     ) -> tuple[int, list[int], list[BlockKey]]:
        """Room for the full blocks of ``token_ids`` not cached here: (the cached leading blocks, at most
        ``max_blocks`` free blocks allocated for the next ones, held and uncached until ``finish_import``,
        and their keys). The free blocks are capped by the watermark, so that an import never takes the room
        of running sequences."""
        cached, key = self._cached_prefix(token_ids, root, whole=True)
        bs = self.block_size
        room = max(0, self.pool.num_free_blocks - self.watermark_blocks)
        count = max(0, min(max_blocks, room, len(token_ids) // bs - len(cached)))
        keys = []
        for i in range(len(cached), len(cached) + count):
            key = BlockKey(key, tuple(token_ids[i * bs:(i + 1) * bs]))
            keys.append(key)
        blocks = self.pool.allocate(count) if count else []
        for block in blocks:
            self._transfer_holds[block] += 1
        return len(cached), blocks, keys

    def finish_import(self, blocks: list[int], keys: list[BlockKey]) -> None:
        """The ranks wrote ``blocks``: each joins the prefix cache under its key (a key cached meanwhile keeps
        its block, and this one is freed uncached), then is released."""
        for block, key in zip(blocks, keys, strict=True):
            self.pool.cache(block, key)
        self.release_transfer(blocks)

    def release_transfer(self, blocks: list[int]) -> None:
        """Drops the hold of an export (or of an import that never ran) on each of ``blocks``."""
        for block in blocks:
            self._transfer_holds[block] -= 1
            if not self._transfer_holds[block]:
                del self._transfer_holds[block]
            self.pool.release(block)

    # -- session pins -----------------------------------------------------------------------------
    def pin_session(self, session: Hashable, seq_id: Hashable, now: float) -> int:
        """Pins the cached blocks of ``seq_id`` (its hashed prefix) for ``session`` in place of the session's
        earlier pins (call before ``free``); returns how many were pinned (0 without pins)."""
        seq = self._get(seq_id)
        return 0 if self.pins is None else self.pins.pin(session, seq.table[:seq.num_hashed], now)

    def expire_pins(self, now: float) -> int:
        """Unpins the sessions whose pins expired by ``now``; returns how many."""
        return 0 if self.pins is None else self.pins.expire(now)

    def _get(self, seq_id: Hashable, freeing: bool = False) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is not None:
            return seq
        if seq_id in self._recently_freed:
            error = DoubleFreeError if freeing else UnknownSequenceError
            raise error(f"sequence {seq_id!r} was already freed")
        raise UnknownSequenceError(f"sequence {seq_id!r} is not registered with the block manager")

    def _no_room(self, needed: int, seq_id: Hashable):
        raise CannotAllocateError(needed, self.pool.num_free_blocks, f"copy-on-write for sequence {seq_id!r}")

    # -- queries ----------------------------------------------------------------------------------
    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slot ids of positions [start, end): ``table[p // block_size] * block_size + p % block_size``."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._get(seq_id)
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= seq.num_slots:  # noqa: E721
            raise ValueError(f"start/end: need integers with 0 <= start <= end <= num_slots="
                             f"{seq.num_slots}, got start={start!r}, end={end!r}")
        bs = self.block_size
        table = seq.table
        if end - start == 1:
            return [table[start // bs] * bs + start % bs]
        slots: list[int] = []
        pos = start
        while pos < end:
            base = table[pos // bs] * bs
            stop = min(end, (pos // bs + 1) * bs)
            slots.extend(range(base + pos % bs, base + pos % bs + (stop - pos)))
            pos = stop
        return slots

    def num_slots(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_slots

    def num_blocks_of(self, seq_id: Hashable) -> int:
        """How many blocks the sequence holds (0 for one that is not registered)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else len(seq.table)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._get(seq_id).table)

    def blocks_from(self, seq_id: Hashable, start: int) -> list[int]:
        """A copy of the sequence's block table from entry ``start`` on (the blocks a reader holding the
        first ``start`` lacks; a decode step's plan asks this of every sequence, so no whole-table copy)."""
        return self._get(seq_id).table[start:]

    def sequence_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def ref_count(self, block_id: int) -> int:
        return self.pool.ref_count(block_id)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self) -> BlockManagerStats:
        query, hit = self._prefix_query_tokens, self._prefix_hit_tokens
        return BlockManagerStats(
            num_blocks=self.num_blocks, num_free_blocks=self.pool.num_free_blocks, usage=self.pool.usage,
            prefix_query_tokens=query, prefix_hit_tokens=hit, prefix_hit_rate=hit / query if query else 0.0,
            num_sequences=len(self._seqs), num_cached_blocks=self.pool.num_cached_blocks,
            num_evictions=self.pool.num_evictions,
            num_pinned_blocks=0 if self.pins is None else self.pins.num_pinned,
            num_pinned_sessions=0 if self.pins is None else self.pins.num_sessions,
            num_pin_evictions=self.pool.num_pin_evictions,
            num_tier_blocks=0 if self.tier is None else len(self.tier),
            num_tier_saves=0 if self.tier is None else self.tier.num_saved,
            num_tier_loaded=self.num_tier_loaded, num_tier_load_failures=self.num_tier_load_failures,
            num_state_slots=0 if self.states is None else self.states.num_slots,
            num_free_state_slots=0 if self.states is None else self.states.num_free)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violated invariant (module and pool docstrings)."""
        self.pool.check_invariants()
        if self.states is not None:
            self.states.check_invariants(self._seqs)
        holders = [0] * self.num_blocks
        for block_id, _ in self._loading.values():        # a second-tier load holds its block until it finishes
            holders[block_id] += 1
        for block_id, count in self._transfer_holds.items():   # so do exports and imports
            holders[block_id] += count
        if self.tier is not None:
            self.tier.check_invariants()
        bs = self.block_size
        for seq_id, seq in self._seqs.items():
            table = seq.table
            assert len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice: {table}"
            assert len(table) == -(-seq.num_slots // bs), (
                f"sequence {seq_id!r}: {len(table)} blocks for {seq.num_slots} slots")
            for block_id in table:
                holders[block_id] += 1
            if seq.num_slots % bs:
                last = table[-1]
                assert self.pool.ref_count(last) == 1 and self.pool.key_of(last) is None, (
                    f"sequence {seq_id!r}: partial last block {last} is shared or cached")
            if self.enable_prefix_caching:
                assert seq.num_hashed <= seq.num_slots // bs, (
                    f"sequence {seq_id!r}: {seq.num_hashed} hashed blocks, {seq.num_slots // bs} full")
                depth = 0 if seq.last_key is None else seq.last_key.depth()
                assert depth == seq.num_hashed, f"sequence {seq_id!r}: key chain depth {depth}"
        for block_id, count in enumerate(holders):
            ref = self.pool.ref_count(block_id)
            assert ref == count, f"block {block_id}: ref count {ref} but held by {count} block tables"

