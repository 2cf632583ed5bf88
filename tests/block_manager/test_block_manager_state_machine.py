"""Property test: random interleavings of admit / append / fork / free / speculate (draft slots reserved as
pending, written, then truncated back to an accepted prefix) and refused truncations into hashed blocks.

The model keeps each live sequence's tokens and slot count, plus a simulated KV store: slot ->
token written when slots are reserved (and block copies applied as the workers would).
After every step it checks, independently of ``check_invariants``:
- ref counts equal the number of block tables holding each block, free blocks are exactly those
  with ref count 0, no block appears twice in a table;
- every slot of every live sequence holds that sequence's token (so prefix hits and fork copies
  never point at foreign or stale content);
- every block findable in the prefix cache holds the tokens of its key.
Teardown frees every sequence and checks the pool is all-free with ref counts 0 and every cached key
still findable. Prefix caching is on; tokens come from a tiny alphabet so that hits, duplicates,
evictions and "cannot allocate" all happen often.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagedray.block_manager import BlockManager, CannotAllocateError

BLOCK_SIZE = 4
NUM_BLOCKS = 20
BASES = ([0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 1, 2], [2, 2, 2, 2])
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.bm = BlockManager(BLOCK_SIZE, NUM_BLOCKS, enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.kv: dict[int, tuple] = {}
        self.drafts: dict[int, int] = {}          # sequence -> its slot count before its pending drafts
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------------------------
    def snapshot(self):
        bm = self.bm
        return ({s: bm.block_table(s) for s in self.tokens}, [bm.ref_count(b) for b in range(NUM_BLOCKS)],
                bm.pool.free_block_ids(), bm.pool.cached_keys())

    def write(self, seq_id, start, end):
        """The workers store K/V of positions [start, end) into the sequence's slots."""
        slots = self.bm.slot_mapping(seq_id, start, end)
        for pos, slot in zip(range(start, end), slots):
            self.kv[slot] = self.tokens[seq_id][pos]

    def apply_copies(self, copies):
        for src, dst in copies:
            for offset in range(BLOCK_SIZE):
                value = self.kv.get(src * BLOCK_SIZE + offset)
                if value is not None:
                    self.kv[dst * BLOCK_SIZE + offset] = value
                else:
                    self.kv.pop(dst * BLOCK_SIZE + offset, None)

    def allocate_or_expect_failure(self, seq_id, tokens, num_new, pending=0):
        expected_ok = self.bm.can_allocate(seq_id, tokens, num_new, pending_tokens=pending)
        before = self.snapshot()
        try:
            alloc = self.bm.allocate_slots(seq_id, tokens, num_new, pending_tokens=pending)
        except CannotAllocateError:
            assert not expected_ok, "can_allocate said yes but allocate_slots failed"
            assert self.snapshot() == before, "a failed allocate_slots changed state"
            return None
        assert expected_ok, "can_allocate said no but allocate_slots succeeded"
        return alloc

    def live(self):
        return sorted(self.tokens)

    # -- rules ------------------------------------------------------------------------------------
    @rule(base=st.sampled_from(BASES), tail=TOKENS, chunk=st.integers(1, 16))
    def admit(self, base, tail, chunk):
        prompt = base + tail
        seq_id = self.next_id
        hit = self.bm.num_cached_prefix_tokens(prompt)
        assert hit % BLOCK_SIZE == 0 and hit < len(prompt)
        num_new = min(chunk, len(prompt) - hit)
        alloc = self.allocate_or_expect_failure(seq_id, prompt, num_new)
        if alloc is None:
            return
        assert alloc.num_cached_tokens == hit
        assert alloc.new_block_ids == self.bm.block_table(seq_id)
        self.next_id += 1
        self.tokens[seq_id], self.slots[seq_id] = list(prompt), hit + num_new
        self.write(seq_id, hit, hit + num_new)  # the hit part must already hold our tokens (invariant)

    @precondition(lambda self: [s for s in self.tokens if s not in self.drafts])
    @rule(data=st.data(), more=TOKENS, chunk=st.integers(1, 9))
    def append(self, data, more, chunk):
        seq_id = data.draw(st.sampled_from([s for s in self.live() if s not in self.drafts]))
        tokens = self.tokens[seq_id] + more
        num_new = min(chunk, len(tokens) - self.slots[seq_id])
        table_before = self.bm.block_table(seq_id)
        alloc = self.allocate_or_expect_failure(seq_id, tokens, num_new)
        if alloc is None:
            return
        assert alloc.num_cached_tokens == 0
        assert self.bm.block_table(seq_id) == table_before + alloc.new_block_ids
        start = self.slots[seq_id]
        self.tokens[seq_id], self.slots[seq_id] = tokens, start + num_new
        self.write(seq_id, start, start + num_new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live()))
        child = self.next_id
        before = self.snapshot()
        try:
            copies = self.bm.fork(parent, child)
        except CannotAllocateError:
            assert self.snapshot() == before
            return
        self.next_id += 1
        assert len(copies) == (1 if self.slots[parent] % BLOCK_SIZE else 0)
        self.apply_copies(copies)
        # the child keeps only the parent's reserved tokens (later tokens were never scheduled)
        self.tokens[child] = self.tokens[parent][:self.slots[parent]]
        self.slots[child] = self.slots[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(self.live()))
        self.bm.free(seq_id)
        for table in (self.tokens, self.slots):
            del table[seq_id]
        self.drafts.pop(seq_id, None)

    def undrafted(self):
        return [s for s in self.live() if s not in self.drafts and self.slots[s] == len(self.tokens[s])]

    @precondition(lambda self: self.undrafted())
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def draft(self, data, drafts):
        """Reserve slots for draft tokens (pending: never hashed) and write them; ``verify`` decides later."""
        seq_id = data.draw(st.sampled_from(self.undrafted()))
        start, tokens = self.slots[seq_id], self.tokens[seq_id]
        keys_before = set(self.bm.pool.cached_keys())
        if self.allocate_or_expect_failure(seq_id, tokens, len(drafts), pending=len(drafts)) is None:
            return
        table = self.bm.block_table(seq_id)
        for key in set(self.bm.pool.cached_keys()) - keys_before:
            assert self.bm.pool.lookup(key) in table[:start // BLOCK_SIZE], "a draft token reached the cache"
        self.tokens[seq_id], self.slots[seq_id] = tokens + drafts, start + len(drafts)
        self.write(seq_id, start, start + len(drafts))
        self.drafts[seq_id] = start

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def verify(self, data):
        """Keep a random prefix of a sequence's drafts (the accepted ones) and truncate the rest away; a fork
        taken since shares the drafted blocks, so a partial last block must be copied, not written in place."""
        seq_id = data.draw(st.sampled_from(sorted(self.drafts)))
        start = self.drafts.pop(seq_id)
        accepted = data.draw(st.integers(0, self.slots[seq_id] - start))
        before = self.snapshot()
        try:
            copies = self.bm.truncate(seq_id, start + accepted)
        except CannotAllocateError:
            assert self.snapshot() == before, "a failed truncate changed state"
            return                      # no block for the copy-on-write: every draft kept (as accepted)
        self.apply_copies(copies)
        self.tokens[seq_id] = self.tokens[seq_id][:start + accepted]
        self.slots[seq_id] = start + accepted

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate_into_hashed_blocks_is_refused(self, data):
        seq_id = data.draw(st.sampled_from(self.live()))
        hashed = self.bm._seqs[seq_id].num_hashed * BLOCK_SIZE
        if hashed == 0:
            return
        before = self.snapshot()
        try:
            self.bm.truncate(seq_id, hashed - 1)
        except ValueError as exc:
            assert "num_slots" in str(exc)
        else:
            raise AssertionError("truncate cut into hashed blocks")
        assert self.snapshot() == before

    # -- checks -----------------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        bm = self.bm
        bm.check_invariants()
        holders = [0] * NUM_BLOCKS
        for seq_id in self.live():
            table = bm.block_table(seq_id)
            assert len(set(table)) == len(table)
            assert bm.num_slots(seq_id) == self.slots[seq_id]
            assert len(table) == -(-self.slots[seq_id] // BLOCK_SIZE)
            for block_id in table:
                holders[block_id] += 1
            want = self.tokens[seq_id][:self.slots[seq_id]]
            have = [self.kv.get(s) for s in bm.slot_mapping(seq_id, 0, self.slots[seq_id])]
            assert have == want, f"sequence {seq_id} reads foreign or stale K/V"
        refs = [bm.ref_count(b) for b in range(NUM_BLOCKS)]
        assert refs == holders
        assert sorted(bm.pool.free_block_ids()) == [b for b in range(NUM_BLOCKS) if refs[b] == 0]
        assert bm.num_free_blocks == refs.count(0)
        for key in bm.pool.cached_keys():
            block_id = bm.pool.lookup(key)
            held = [self.kv.get(block_id * BLOCK_SIZE + i) for i in range(BLOCK_SIZE)]
            assert held == list(key.token_ids), f"cached block {block_id} is stale"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        keys = bm.pool.cached_keys()
        hits = {s: bm.num_cached_prefix_tokens(self.tokens[s]) for s in self.live()}
        for seq_id in self.live():
            bm.free(seq_id)
        bm.check_invariants()
        assert bm.num_free_blocks == NUM_BLOCKS and bm.usage == 0.0
        assert all(bm.ref_count(b) == 0 for b in range(NUM_BLOCKS))
        assert bm.pool.cached_keys() == keys
        assert all(bm.pool.lookup(key) is not None for key in keys)
        for seq_id, hit in hits.items():
            assert bm.num_cached_prefix_tokens(self.tokens[seq_id]) == hit


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
