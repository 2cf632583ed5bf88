"""Scheduler: decides, every step, which tokens of which sequences are computed.

It owns the waiting and running queues and is the only caller of the BlockManager on the engine
side. One ``schedule()`` builds one batch under two limits: ``max_num_batched_tokens`` (tokens
computed this step) and ``max_num_seqs`` (sequences holding KV blocks at once).

Order within a step (each sequence at most once):
1. forks: an ``n > 1`` parent that has computed ``len(prompt) - 1`` tokens forks its siblings
   (BlockManager.fork; the block copies go into the plan).
2. running sequences with ONE token left (decodes), in queue order;
3. running sequences with more than one token left (partial prefills), each takes
   ``min(left, budget)`` tokens (chunked prefill);
   Steps 3 and 4 share at most ``max_prefill_tokens`` of the budget when it is set.
4. waiting sequences in queue order while budget and seats remain; a prefix-cache hit becomes
   ``num_computed_tokens`` and only the rest is scheduled (again chunked). Strict head-of-line: when
   the head cannot get its blocks, admission stops for this step. No admission in a step that
   preempted (the freed blocks go to the running sequences first).

Queue order: "fcfs" = arrival; "priority" = (priority, arrival) with LOWER priority value first.
Preemption by recompute: when a running sequence cannot get blocks, the victim is the last
sequence in queue order (lowest priority, then latest arrival) among those not yet scheduled this
step — possibly the sequence itself. The victim's blocks are freed at once, it keeps its output
tokens, is put back at the FRONT of the waiting queue and ``num_preemptions`` is incremented.

A sampled token that carries ``error`` (rank 0 could not sample that row: its grammar failed, its
logits were not finite) ends that request with finish_reason "error" (``request.error`` says why);
the other sequences of the step are applied as usual.

Stop rules (checked after each sampled token, in this order): EOS (unless ``ignore_eos``) or a stop
token id -> "stop", once more than ``min_tokens`` tokens are out (the Sampler bans them before);
``max_tokens`` outputs or ``max_model_len`` total tokens -> "length".
Admission: prompts must be non-empty and shorter than ``max_model_len`` (ValueError otherwise).

Async scheduling (``async_scheduling``, the engine schedules step N+1 while step N runs): a sequence
scheduled in a step in flight counts those tokens as ``num_in_flight`` and the token that step samples
as ``num_pending`` (its id unknown), so the next step can compute the pending token (its slot is
reserved with ``pending_tokens``; its block is hashed once the id is known). ``update`` applies a
step's result to sequences still in the epoch they were scheduled in: a sequence preempted since drops
that result (it recomputes, and a greedy or seeded draw repeats itself); a finished one ignores it.
A sequence whose pending token ends it by length (``max_tokens``, ``max_model_len``) is not scheduled
ahead. The synchronous engine applies each result before the next ``schedule``, so there both counts
are 0 at scheduling time.

Speculative decoding (``num_speculative_tokens`` > 0; cluster/speculation.py): a decode of a request
that allows it (``params.speculative``) also schedules up to that many draft tokens from the
proposer (with a draft model on the ranks: that many ``MODEL_DRAFT`` slots that the ranks fill in),
bounded by the step's token budget, ``max_tokens`` and ``max_model_len``, and dropped when
their blocks are not free (drafts never cause a preemption); their slots are reserved as pending
(never hashed). ``update`` takes the accepted drafts plus the step's own token
(several SampledTokens of one sequence, in position order), gives the rejected drafts' slots back
(``BlockManager.truncate``; a copy-on-write that truncation needs goes into the next step's
``block_copies``, the blocks the workers may keep into its ``kept_blocks``) and applies the stop rules
token by token (tokens after a stop are dropped).

Fair share (``SchedulerConfig.tenants``; cluster/fair_steps.py, cluster/fair_share.py): before step 2 the running
sequences of tenants over their share may be preempted for a waiting one within its share, the running set is
ordered tenant by tenant (least over its share first) instead of queue order, and steps 3 and 4 go tenant by
tenant, the one that has received the least first; each tenant's own sequences keep queue order.

Invariant: every sequence in ``running`` is registered with the BlockManager and holds exactly
``num_scheduled_through`` (computed + in flight) slots; waiting and finished sequences hold none.
"""

from __future__ import annotations

import collections
import time

from pagedray.block_manager import CannotAllocateError, namespace_root
from pagedray.workers.contract.config import SchedulerConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import MODEL_DRAFT, LoraRead, PooledPart, PromptLogprobs, SampledToken

from .fair_share import FairShare
from .fair_steps import _BLOCKED, _PASSED, FairSteps
from .lora_slots import AdapterSlots
from .outputs import QueueFullError
from .request import FinishReason, Request, Sequence, SequenceStatus
from .scheduler_output import ScheduledSequence, SchedulerOutput
from .speculation import NgramProposer, Proposer, RankDraftSlots, SpeculationStats
from .stats import QueueTimeHistogram


class Scheduler(FairSteps):
    def __init__(self, config: SchedulerConfig, block_manager, max_model_len: int,
                 eos_token_ids: frozenset[int] | set[int] = frozenset()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._running_sorted = True     # running is in queue order (_key); appends clear it
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.queue_time = QueueTimeHistogram()   # first admissions of requests (sample 0, not after preemption)
        self.num_prompt_tokens = 0       # prompt tokens of admitted requests (cached ones included)
        self.num_computed_tokens = 0     # tokens computed by the workers (prefill chunks + decodes)
        self.num_generated_tokens = 0
        self._next_seq_id = 0
        self._next_arrival = 0
        self._next_step_id = 0
        self._released: list[int] = []
        self._block_copies: list[tuple[int, int]] = []    # from speculative rollbacks, for the next step
        self._kept_blocks: dict[int, int] = {}             # SchedulerOutput.kept_blocks, for the next step
        self._unforked: set[Sequence] = set()     # first samples of n > 1 requests (a superset of the unforked)
        self.proposer: Proposer | None = None     # prompt lookup, or slots for the ranks' draft model
        if config.num_speculative_tokens:
            self.proposer = (RankDraftSlots() if config.speculative_model is not None
                             else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
        self.speculation = SpeculationStats()
        self.lora_slots: AdapterSlots | None = None   # set by the engine with enable_lora (cluster/lora_slots.py)
        self.clock = time.monotonic                   # session pins' time (tests set their own)
        self._tier_loads: dict[Sequence, list[int]] = {}   # waiting sequences -> their second-tier loads' slots
        self.fair: FairShare | None = None
        if config.tenants:
            bm = block_manager
            self.fair = FairShare(config.tenants, bm.num_blocks, bm.num_blocks - bm.watermark_blocks,
                                  config.max_num_seqs, config.max_num_batched_tokens)

    # -- intake -------------------------------------------------------------------------------
    def check_admission(self, request_id: str, tenant: str | None = None, num_prompt_tokens: int = 0) -> None:
        """The checks that depend on the queue state: ValueError (bad or duplicate id) / QueueFullError, and
        with fair share the tenant's quotas (TenantQuotaError: its queue limit, a prompt past its KV cap).
        The arguments' own checks are ``check_arguments`` (``Engine.validate`` runs them)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if len(self.waiting) >= self.config.max_queued_requests:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_queued_requests="
                                 f"{self.config.max_queued_requests}); retry later")
        if self.fair is not None:
            self._check_tenant_quota(tenant, num_prompt_tokens)

    def enqueue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                priority: int = 0, resume_tokens: list[int] = (), lora: LoRARequest | None = None,
                session: str | None = None, tenant: str | None = None) -> Request:
        """Adds a request whose arguments passed ``check_arguments`` and whose id passed ``check_admission``
        (``Engine.add`` does both, validating each request once). ``resume_tokens``: output tokens the request
        produced elsewhere (a continuation, ``Engine.add``). ``lora``: its adapter (checked by the engine);
        ``session``: pins sample 0's blocks when it finishes (``block_manager/session_pins.py``); ``tenant``: its
        tenant's fair share (``fair_share.py``; checked by ``check_admission``)."""
        if lora is not None and self.lora_slots is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (enable_lora is off)")
        request = Request(request_id=request_id, prompt_token_ids=[int(t) for t in prompt_token_ids],
                          params=params, arrival=self._next_arrival, priority=priority,
                          num_unforked=params.n - 1, lora=lora, session=session, tenant=tenant)
        self._next_arrival += 1
        self.num_prompt_tokens += len(request.prompt_token_ids)
        request.sequences.append(self._new_sequence(request, 0, [int(t) for t in resume_tokens]))
        self.requests[request_id] = request
        self.waiting.append(request.sequences[0])
        if self.fair is not None:
            self.fair.joined(self.fair.state(request.sequences[0]))
        if request.num_unforked:
            self._unforked.add(request.sequences[0])
        if lora is not None:
            self.lora_slots.want(lora)      # its read starts with the next plan, while the queue ahead runs
        return request

    def _new_sequence(self, request: Request, index: int, resume_tokens: list[int] = ()) -> Sequence:
        seq = Sequence(seq_id=self._next_seq_id, request=request, index=index, output_token_ids=list(resume_tokens),
                       num_resumed=len(resume_tokens))
        self._next_seq_id += 1
        return seq

    # -- queries ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_pending_releases(self) -> bool:
        """Sequences left the running set since the last schedule() (the workers must be told)."""
        return bool(self._released)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        priority = seq.request.priority if self.config.policy == "priority" else 0
        return (priority, seq.request.arrival, seq.index)

    def _seats_taken(self) -> int:
        return sum(1 + s.request.num_unforked * s.must_fork_first for s in self.running)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._next_step_id, released_seq_ids=self._released,
                              block_copies=self._block_copies, kept_blocks=self._kept_blocks)
        self._released, self._block_copies, self._kept_blocks = [], [], {}
        self._next_step_id += 1
        self.block_manager.commit_state_snapshots()    # written by the plans before this one
        if self.block_manager.pins is not None:
            self.block_manager.expire_pins(self.clock())
        self._fork_ready_parents(out)
        if self.fair is not None and self._may_preempt():
            self._sort_running_by_share()
        elif not self._running_sorted:     # only admissions and forks unsort it (removals keep the order)
            self.running.sort(key=self._key)
            self._running_sorted = True
        budget = self.config.max_num_batched_tokens
        if self.fair is not None and self.waiting:
            self._make_room_for_fair_share(out, budget)
        proposals = self._proposals()
        if proposals:
            decodes, prefills = [], []     # queue order; a preemption below changes only its victim's state
            for seq in self.running:
                left = self._computable(seq)
                if left == 1:
                    decodes.append(seq)
                elif left > 1:
                    prefills.append((seq, left))
            budget = self._schedule_speculative_decodes(decodes, proposals, budget, out)
        else:
            budget, prefills = self._schedule_decodes(budget, out)
        budget = min(budget, self.config.max_prefill_tokens or budget)   # what prefills and admissions may take
        if self.fair is not None:
            self._fair_prefills_and_admissions(prefills, budget, out)
            self.fair.charge(out.scheduled)
        else:
            budget = self._schedule_prefills(prefills, budget, out)
            if not out.preempted:
                self._admit_waiting(out, budget)
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
            out.lora_reads, out.lora_drops = self.lora_slots.take_orders()
        out.kv_saves, out.kv_loads = self.block_manager.take_transfers()   # last: every allocation is done
        return out

    def transfer_output(self) -> SchedulerOutput:
        """An output that schedules nothing, for a plan that carries blocks moving between replicas ahead of the
        next step (``Engine.step``), and the second tier's copies its allocations caused (saved before any
        imported block is written over an evicted one)."""
        out = SchedulerOutput(step_id=self._next_step_id)
        self._next_step_id += 1
        out.kv_saves, out.kv_loads = self.block_manager.take_transfers()
        return out

    def _schedule_decodes(self, budget: int, out: SchedulerOutput) -> tuple[int, list]:
        """Step 2 without drafts, in one pass over the running queue: each sequence with one computable
        token (``_computable``, inlined: this loop runs over every running sequence at every step) is
        scheduled for it at once; one with more is returned for step 3, as ``(seq, left)`` in queue order.
        A slot inside the sequence's last block is taken without a block search (``BlockManager.add_slot``),
        the rest through ``_reserve``, which may preempt a later sequence (skipped when reached) or this
        one. A hybrid model's sequence whose token this step ends a block takes a trailing state snapshot there
        (``BlockManager.trail_state_snapshot``: a conversation's next turn resumes after this output). Returns the
        budget left and the partial prefills."""
        bm = self.block_manager
        add_slot, append = bm.add_slot, out.scheduled.append
        trail = bm.trail_state_snapshot if bm.states is not None and bm.states.num_snapshots else None
        block_size = bm.block_size
        running, max_len = SequenceStatus.RUNNING, self.max_model_len
        prefills = []
        for seq in tuple(self.running):               # a preemption removes its victim from self.running
            if budget == 0:
                break
            if seq.status is not running:                 # preempted earlier in this loop
                continue
            request, pending, tokens = seq.request, seq.num_pending, seq.token_ids
            if pending and (len(seq.output_token_ids) + pending >= request.params.max_tokens
                            or len(tokens) + pending >= max_len):
                continue                                  # its pending token ends it by length
            start = seq.num_computed_tokens + seq.num_in_flight
            unforked = seq.index == 0 and request.num_unforked > 0
            left = max(0, request.fork_at - start) if unforked else len(tokens) + pending - start
            if left != 1:
                if left > 1:
                    prefills.append((seq, left))
                continue
            if not add_slot(seq.seq_id, tokens, pending) and not self._reserve(seq, 1, out):
                continue
            samples = not unforked                        # a parent one token short of forking does not sample
            seq.num_in_flight += 1
            seq.num_pending += samples
            append(ScheduledSequence(seq, 1, start, samples, seq.num_preemptions))
            budget -= 1
            if trail is not None and (start + 1) % block_size == 0:
                slot = trail(seq.seq_id, start + 1)
                if slot is not None:
                    out.state_snapshots.append((bm.state_slot(seq.seq_id), start + 1, slot))
        return budget, prefills

    def _schedule_prefills(self, prefills: list, budget: int, out: SchedulerOutput) -> int:
        """Step 3: the partial prefills ``(seq, left)`` in order, each ``min(left, budget)`` tokens. Returns the
        budget left."""
        for seq, left in prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num = min(left, budget)
            if self._reserve(seq, num, out):
                self._schedule_tokens(seq, num, out)
                budget -= num
        return budget

    def _schedule_speculative_decodes(self, decodes: list[Sequence], proposals: dict[int, list[int]], budget: int,
                                      out: SchedulerOutput) -> int:
        """Step 2 with the proposer's drafts (bounded by the budget; dropped when their blocks are not free).
        Returns the budget left."""
        for seq in decodes:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            drafts = proposals.get(seq.seq_id, [])[:budget - 1]
            if drafts and not self.block_manager.can_allocate(seq.seq_id, seq.token_ids, 1 + len(drafts),
                                                              pending_tokens=seq.num_pending + len(drafts)):
                drafts = []       # drafts never preempt anyone: without room the step decodes plainly
            num = 1 + len(drafts)
            if self._reserve(seq, num, out, len(drafts)):
                self._schedule_tokens(seq, num, out, drafts)
                budget -= num
        return budget

    def _computable(self, seq: Sequence) -> int:
        """Tokens to schedule for a running sequence; 0 for one whose pending token ends it by length."""
        if seq.num_pending and (len(seq.output_token_ids) + seq.num_pending >= seq.request.params.max_tokens
                                or seq.num_tokens + seq.num_pending >= self.max_model_len):
            return 0
        return seq.computable_tokens()

    def _proposals(self) -> dict[int, list[int]]:
        """Speculative tokens for the running sequences about to decode, from one proposer call: none when
        speculation is off or a request opts out; at most what ``max_tokens`` and
        ``max_model_len`` leave after the step's own token (the step's budget cuts them later)."""
        if self.proposer is None:
            return {}
        wanted, requests = [], []
        for seq in self.running:
            params = seq.request.params
            if (seq.status is not SequenceStatus.RUNNING or not params.speculative or seq.num_pending
                    or self._computable(seq) != 1):
                continue
            room = min(self.config.num_speculative_tokens, params.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                wanted.append(seq.seq_id)
                requests.append((seq.token_ids, room))
        if not requests:
            return {}
        return dict(zip(wanted, self.proposer.propose_batch(requests)))

    def _schedule_tokens(self, seq: Sequence, num: int, out: SchedulerOutput, drafts: list[int] = ()) -> None:
        """Adds ``num`` tokens of ``seq`` (slots already reserved; the last ``len(drafts)`` are drafts) to
        the step, with the state snapshots its tokens reach (a hybrid model's prefill)."""
        start = seq.num_scheduled_through
        samples = start + num - len(drafts) == seq.num_tokens + seq.num_pending
        seq.num_in_flight += num
        seq.num_pending += samples
        out.scheduled.append(ScheduledSequence(seq, num, start, samples, seq.num_preemptions, tuple(drafts)))
        if seq.snapshot_points:
            self._take_snapshots(seq, start + num - len(drafts), out)

    def _take_snapshots(self, seq: Sequence, end: int, out: SchedulerOutput) -> None:
        """The state snapshots at ``seq``'s points up to ``end`` (its tokens computed through this step): each
        one the block manager has a slot for is written by this step's forward (block_manager/state_pool.py)."""
        bm = self.block_manager
        for point in seq.snapshot_points:
            if point <= end:
                slot = bm.reserve_state_snapshot(seq.seq_id, point)
                if slot is not None:
                    out.state_snapshots.append((bm.state_slot(seq.seq_id), point, slot))
        seq.snapshot_points = tuple(p for p in seq.snapshot_points if p > end)

    def _reserve(self, seq: Sequence, num: int, out: SchedulerOutput,
                 num_drafts: int = 0) -> bool:
        """Gets slots for ``num`` more tokens of a running sequence (the last ``num_drafts`` of them
        speculative: pending, never hashed), preempting as needed.

        Returns False when ``seq`` itself had to be preempted."""
        bm = self.block_manager
        pending = seq.num_pending + num_drafts
        if num == 1 and seq.num_scheduled_through % bm.block_size:
            # the slot lies in the last block the sequence holds already: no block to find, nobody to preempt
            bm.allocate_slots(seq.seq_id, seq.token_ids, 1, pending_tokens=pending)
            return True
        while True:
            capped = self.fair is not None and self._passes_cap(seq, num)
            if not capped and bm.can_allocate(seq.seq_id, seq.token_ids, num, pending_tokens=pending):
                break
            scheduled = {sched.seq.seq_id for sched in out.scheduled}    # never preempted for this step
            victims = [s for s in self.running if s.seq_id not in scheduled]
            if capped:      # past its tenant's KV cap: one of the tenant's own sequences makes room
                tenant = self.fair.state(seq)
                victim = max((s for s in victims if self.fair.state(s) is tenant), key=self._key)
            else:
                victim = self._victim(victims, seq, num)
            self._preempt(victim, out)
            if victim is seq:
                return False
        bm.allocate_slots(seq.seq_id, seq.token_ids, num, pending_tokens=pending)
        self._kv_mark(seq)
        return True

    def _victim(self, candidates: list[Sequence], grower: Sequence, more_blocks: int) -> Sequence:
        """Whom ``grower``, which needs ``more_blocks`` blocks that are not free, preempts: the last candidate in
        queue order; with fair share, the last of a tenant further over its share than the grower's tenant will
        be (``FairShare.victim``) when there is one."""
        fifo = max(candidates, key=self._key)
        if self.fair is None:
            return fifo
        seats, running = self._tenant_counts()
        than = self.fair.overage(self.fair.state(grower), seats, more_blocks)
        return self.fair.victim(candidates, self._key, seats, running, than) or fifo

    def _kv_mark(self, seq: Sequence) -> None:
        """``seq``'s block count may have changed: its request's KV-block-seconds so far, its tenant's blocks."""
        blocks = self.block_manager.num_blocks_of(seq.seq_id)
        now = self.clock()
        seq.request.kv_block_seconds += seq.kv_blocks * (now - seq.kv_since)
        if self.fair is not None:
            self.fair.state(seq).blocks += blocks - seq.kv_blocks
        seq.kv_blocks, seq.kv_since = blocks, now

    def _preempt(self, seq: Sequence, out: SchedulerOutput | None, stops_admission: bool = True) -> None:
        """Frees ``seq``'s blocks and puts it back at the front of the waiting queue (``out``: the step
        being built; None between steps, from ``update``). ``stops_admission`` False: a fair-share
        preemption, made for an admission of this step."""
        self.block_manager.free(seq.seq_id)
        self._kv_mark(seq)
        self._drop_lora(seq)
        self.running.remove(seq)
        (self._released if out is None else out.released_seq_ids).append(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.reset_computed()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if out is not None and stops_admission:
            out.preempted.append(seq)

    def _next_waiting(self, passed: set[Sequence]) -> Sequence:
        """The next sequence to admit (queue order, or priority), among those not ``passed`` over this step."""
        if self.config.policy == "priority":
            return min((s for s in self.waiting if s not in passed), key=self._key)
        return self.waiting[0] if not passed else next(s for s in self.waiting if s not in passed)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        taken = self._seats_taken()
        passed: set[Sequence] = set()    # waiting for a LoRA read or slot: the sequences after them go on
        if self.lora_slots is not None:
            self.lora_slots.begin_pass()
        while len(passed) < len(self.waiting) and budget > 0:
            seq = self._next_waiting(passed)
            seats = self._seats_of(seq)
            num = self._try_admit(seq, budget, out, taken)
            if num == _PASSED:
                passed.add(seq)
                continue
            if num == _BLOCKED:
                return
            budget -= num
            taken += seats

    @staticmethod
    def _seats_of(seq: Sequence) -> int:
        return 1 + (seq.request.num_unforked if seq.must_fork_first else 0)

    def _try_admit(self, seq: Sequence, budget: int, out: SchedulerOutput, taken: int) -> int:
        """Admits the waiting ``seq`` when it can run now: the tokens it scheduled, or _PASSED (it waits for its
        adapter or its second-tier loads; the sequences behind it go on) or _BLOCKED (no seat or no blocks)."""
        lora = seq.request.lora
        if lora is not None and not self.lora_slots.can_acquire(lora):
            self.lora_slots.want(lora)
            return _PASSED
        if self._waits_for_tier(seq):
            return _PASSED
        if taken + self._seats_of(seq) > self.config.max_num_seqs:
            return _BLOCKED
        num = self._admit(seq, budget, out)
        return _BLOCKED if num is None else num

    def _waiting_in_order(self) -> list[Sequence] | collections.deque[Sequence]:
        return sorted(self.waiting, key=self._key) if self.config.policy == "priority" else self.waiting

    def _first_chunk(self, seq: Sequence, budget: int) -> tuple[int, int, bool, int | None]:
        """(cached prefix tokens, tokens of its first chunk, whether it reuses the prefix cache, its prefix root)
        for the waiting ``seq`` admitted under ``budget``."""
        lora = seq.request.lora
        root = None if lora is None else namespace_root(lora.cache_namespace)   # an adapter's own prefix chains
        reuse = seq.request.needs_every_position is False   # prompt logprobs, mean pooling: no cached position
        hit = self.block_manager.num_cached_prefix_tokens(seq.token_ids, root) if reuse else 0
        target = seq.request.fork_at if seq.must_fork_first else len(seq.token_ids)
        return hit, min(target - hit, budget), reuse, root

    def _waits_for_tier(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits for blocks of its prompt coming back from the second KV tier: the first time it
        is considered, the tier blocks right after its cached prefix are loaded (when the free blocks allow);
        it is admitted once those loads finished, with whatever they put in the prefix cache."""
        bm = self.block_manager
        if bm.tier is None or seq.request.needs_every_position:
            return False
        pending = self._tier_loads.get(seq)
        if pending is not None:
            if bm.loads_in_flight(pending):
                return True
            del self._tier_loads[seq]
            return False
        lora = seq.request.lora
        hits = bm.tier_prefix(seq.token_ids, None if lora is None else namespace_root(lora.cache_namespace))
        if not hits or bm.num_free_blocks - bm.watermark_blocks < len(hits):
            return False
        self._tier_loads[seq] = bm.start_loads(hits)
        return True

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Registers ``seq`` with the BlockManager and schedules its first chunk; None if it does not fit
        (or its LoRA adapter finds no free slot)."""
        bm = self.block_manager
        tokens = seq.token_ids
        lora = seq.request.lora
        _, num, reuse, root = self._first_chunk(seq, budget)
        if not bm.can_allocate(seq.seq_id, tokens, max(num, 1), reuse, root=root):   # num 0: fork, then 1 token
            return None
        if lora is not None:
            seq.lora_slot = self.lora_slots.acquire(lora)
            if seq.lora_slot is None:
                seq.lora_slot = -1
                return None
        allocation = bm.allocate_slots(seq.seq_id, tokens, num, reuse, root=root)
        self._kv_mark(seq)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = allocation.num_cached_tokens
        seq.snapshot_points = allocation.snapshot_points
        if allocation.state_source >= 0:     # a hybrid's prefix hit: its seat starts from the snapshot there
            out.state_copies.append((allocation.state_source, bm.state_slot(seq.seq_id)))
        if seq.index == 0 and seq.num_preemptions == 0:
            seq.request.num_cached_prompt_tokens = allocation.num_cached_tokens
            seq.request.queue_time_s = time.monotonic() - seq.request.added_at
            self.queue_time.observe(seq.request.queue_time_s)
        self.running.append(seq)
        self._running_sorted = False
        if num > 0:
            self._schedule_tokens(seq, num, out)
            return num
        # an n > 1 parent whose prompt (minus its last token) is all cached: fork now
        self._fork(seq, out)
        taken = 0
        for member in seq.request.sequences:
            if taken < budget and bm.can_allocate(member.seq_id, member.token_ids, 1):
                bm.allocate_slots(member.seq_id, member.token_ids, 1)
                self._kv_mark(member)
                self._schedule_tokens(member, 1, out)
                taken += 1
        return taken

    def _fork_ready_parents(self, out: SchedulerOutput) -> None:
        """Forks parents that reached their fork point; a partial last block needs one free block per
        child (copy-on-write), which may take preemptions (victims in the usual order)."""
        if not self._unforked:
            return
        self._unforked = {s for s in self._unforked if s.must_fork_first}   # forked, finished or aborted: gone
        parents = [s for s in self._unforked if s.status is SequenceStatus.RUNNING
                   and s.num_scheduled_through == s.request.fork_at]
        for seq in sorted(parents, key=self._key):
            if seq.status is not SequenceStatus.RUNNING:   # preempted for an earlier parent's copies
                continue
            partial = seq.num_scheduled_through % self.block_manager.block_size != 0
            needed = seq.request.num_unforked if partial else 0
            while self.block_manager.num_free_blocks < needed:
                victim = self._victim(self.running, seq, needed)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self._fork(seq, out)

    def _fork(self, parent: Sequence, out: SchedulerOutput) -> None:
        request = parent.request
        for index in range(1, request.num_unforked + 1):
            child = self._new_sequence(request, index)
            out.block_copies.extend(self.block_manager.fork(parent.seq_id, child.seq_id))
            if self.block_manager.states is not None:   # a hybrid model: the child continues from the parent's state
                out.state_copies.append((self.block_manager.state_slot(parent.seq_id),
                                         self.block_manager.state_slot(child.seq_id)))
            self._kv_mark(child)
            # the parent's in-flight prefill runs before this step's block copies and forward
            child.num_computed_tokens = parent.num_scheduled_through
            child.status = SequenceStatus.RUNNING
            if parent.lora_slot >= 0:       # the parent's adapter is resident: this cannot fail
                child.lora_slot = self.lora_slots.acquire(request.lora)
            request.sequences.append(child)
            self.running.append(child)
            self._running_sorted = False
        if self.fair is not None:
            self.fair.joined(self.fair.state(parent), request.num_unforked)
        request.num_unforked = 0

    # -- results ------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken],
               prompt_logprobs: list[PromptLogprobs] = (), pooled: list[PooledPart] = ()) -> list[Request]:
        """Applies a step's result; returns the requests that got tokens or finished (each once)."""
        if prompt_logprobs or pooled:
            scheduled = {sched.seq.seq_id: sched.seq for sched in out.scheduled}
            for entry in list(prompt_logprobs) + list(pooled):
                if entry.seq_id not in scheduled:
                    raise RuntimeError(f"step {out.step_id}: prompt results for unscheduled sequence {entry.seq_id}")
                request = scheduled[entry.seq_id].request
                if isinstance(entry, PooledPart):
                    request.record_pooled(entry)
                else:
                    request.record_prompt_logprobs(entry)
        if self.proposer is None or not any(sched.draft_token_ids for sched in out.scheduled):
            return self._update_plain(out, sampled)
        by_seq: dict[int, list[SampledToken]] = {}
        for token in sampled:
            by_seq.setdefault(token.seq_id, []).append(token)
        touched: dict[str, Request] = {}
        for sched in out.scheduled:
            seq = sched.seq
            if seq.is_finished or sched.epoch != seq.num_preemptions:   # finished, or preempted since
                continue
            seq.num_in_flight -= sched.num_tokens
            self.num_computed_tokens += sched.num_tokens
            if not sched.samples:
                seq.num_computed_tokens += sched.num_tokens
                continue
            seq.num_pending -= 1
            tokens = by_seq.get(seq.seq_id)
            if not tokens:
                raise RuntimeError(f"step {out.step_id}: no sampled token for sequence {seq.seq_id}")
            accepted = self._accepted(out.step_id, sched, tokens)
            seq.num_computed_tokens += sched.num_tokens - len(sched.draft_token_ids) + accepted
            if sched.draft_token_ids:
                self.speculation.record(len(sched.draft_token_ids), accepted)
                self._roll_back(seq)
            for token in tokens:
                if token.error is not None:
                    self._fail_request(seq, token.error)
                    break
                self._append_token(seq, token)
                if seq.is_finished:
                    break
            touched[seq.request.request_id] = seq.request
        return list(touched.values())

    def _update_plain(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[Request]:
        """``update`` of a step without drafts: one token per sampling sequence."""
        by_seq = {token.seq_id: token for token in sampled}
        if len(by_seq) != len(sampled):
            raise RuntimeError(f"step {out.step_id}: several tokens for one sequence of a step without drafts")
        touched: dict[str, Request] = {}
        finished, computed = SequenceStatus.FINISHED, 0
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is finished or sched.epoch != seq.num_preemptions:   # finished, or preempted since
                continue
            num = sched.num_tokens
            seq.num_in_flight -= num
            seq.num_computed_tokens += num
            computed += num
            if not sched.samples:
                continue
            seq.num_pending -= 1
            token = by_seq.get(seq.seq_id)
            if token is None:
                raise RuntimeError(f"step {out.step_id}: no sampled token for sequence {seq.seq_id}")
            if token.error is not None:
                self._fail_request(seq, token.error)
            else:
                self._append_token(seq, token)
            touched[seq.request.request_id] = seq.request
        self.num_computed_tokens += computed
        return list(touched.values())

    @staticmethod
    def _accepted(step_id: int, sched: ScheduledSequence, tokens: list[SampledToken]) -> int:
        """How many drafts the sampled ``tokens`` of one sequence accept: all but the last token, each equal
        to the draft at its position (a ``MODEL_DRAFT`` placeholder: whatever the ranks' draft model
        proposed; RuntimeError for a result that says otherwise)."""
        accepted = len(tokens) - 1
        drafts = sched.draft_token_ids
        if accepted > len(drafts) or any(t.token_id != d and d != MODEL_DRAFT
                                         for t, d in zip(tokens[:accepted], drafts)):
            raise RuntimeError(f"step {step_id}: sequence {sched.seq.seq_id} got {len(tokens)} tokens that do not "
                               f"extend its {len(drafts)} drafts")
        return accepted

    def _roll_back(self, seq: Sequence) -> None:
        """Gives the slots of rejected drafts back: ``seq`` keeps ``num_scheduled_through`` slots. When the
        copy-on-write that may need finds no free block, ``seq`` is preempted instead (it recomputes)."""
        bm = self.block_manager
        before = len(bm.block_table(seq.seq_id))
        try:
            copies = bm.truncate(seq.seq_id, seq.num_scheduled_through)
        except CannotAllocateError:
            self._preempt(seq, None)
            return
        self._kv_mark(seq)
        kept = len(bm.block_table(seq.seq_id)) - len(copies)      # a copied last block changed its id
        if kept < before:
            self._kept_blocks[seq.seq_id] = kept
        self._block_copies += copies

    def _append_token(self, seq: Sequence, token: SampledToken) -> None:
        token_id = token.token_id
        seq.append_token(token_id)
        self.num_generated_tokens += 1
        params = seq.request.params
        if params.logprobs is not None:
            seq.output_logprobs.append(token)
        num_output = len(seq.output_token_ids)
        if num_output > params.min_tokens and ((not params.ignore_eos and token_id in self.eos_token_ids)
                                               or token_id in params.stop_token_ids):   # min_tokens, then this one
            self._finish(seq, FinishReason.STOP)
        elif num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def apply_lora_reads(self, reads: list[LoraRead]) -> list[Request]:
        """Rank 0's finished adapter reads: each read adapter may take a slot from the next step on; a failed
        read ends every request waiting for that adapter with its error. Returns the requests ended."""
        ended = []
        for read in reads:
            error = self.lora_slots.read_done(read)
            if error is None:
                continue
            lora = LoRARequest(read.name, read.path)
            for seq in [s for s in self.waiting if s.request.lora == lora]:
                if not seq.is_finished:
                    self._fail_request(seq, error)
                    ended.append(seq.request)
        return ended

    def _drop_lora(self, seq: Sequence) -> None:
        """``seq`` leaves the running set: its reference on its adapter's slot goes."""
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._tier_loads.pop(seq, None)
        if seq.status is SequenceStatus.RUNNING:
            if seq.request.session is not None and seq.index == 0:   # its prompt and output: the next turn's prefix
                self.block_manager.pin_session(seq.request.session, seq.seq_id, self.clock())
            self.block_manager.free(seq.seq_id)
            self._kv_mark(seq)
            self._drop_lora(seq)
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.status is not SequenceStatus.FINISHED:
            seq.request.num_finished += 1
            if self.fair is not None:
                self.fair.left(self.fair.state(seq))
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    def _fail_request(self, seq: Sequence, error: str) -> None:
        """Rank 0 could not sample ``seq`` (its grammar, non-finite logits): its whole request ends with
        finish_reason "error" and ``request.error`` (every sample's blocks freed now); others go on."""
        request = seq.request
        request.error = f"sample {seq.index}: {error}"
        self.abort(request.request_id, FinishReason.ERROR)

    # -- abort / failure ----------------------------------------------------------------------
    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finishes every unfinished sample of the request and frees its blocks now."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.num_unforked = 0
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, reason)
        self.requests.pop(request_id, None)
        return request

    def reset_after_kv_loss(self, block_manager) -> list[Sequence]:
        """The workers lost every KV block (their TP group was rebuilt): each running sequence goes back
        to the front of the waiting queue as if preempted (output tokens kept, blocks freed, recomputed
        when re-admitted), pending releases are dropped (the new workers mirror nothing), and the
        scheduler adopts ``block_manager``: a fresh one, since the old prefix cache describes KV contents
        that no longer exist. Returns the re-queued sequences (queue order).

        Raises RuntimeError when the old manager still holds a block afterwards (a leak)."""
        requeued = sorted(self.running, key=self._key)
        for seq in reversed(requeued):
            self.block_manager.free(seq.seq_id)
            self._kv_mark(seq)
            self._drop_lora(seq)
            seq.status = SequenceStatus.WAITING
            seq.reset_computed()
            seq.num_preemptions += 1
            self.waiting.appendleft(seq)
        self.running = []
        self._released = []
        self._block_copies, self._kept_blocks = [], {}
        self._tier_loads = {}                     # the old manager's loads never finish; the new ranks hold no tier
        if self.lora_slots is not None:
            self.lora_slots.forget_resident()     # the new ranks hold no adapter
        old = self.block_manager
        old.check_invariants()
        if old.num_free_blocks != old.num_blocks:
            raise RuntimeError(f"{old.num_blocks - old.num_free_blocks} KV blocks still held after every "
                               "running sequence was freed")
        self.block_manager = block_manager
        return requeued

    def abort_all(self, reason: FinishReason) -> list[Request]:
        return [r for r in (self.abort(rid, reason) for rid in list(self.requests)) if r is not None]


def check_arguments(prompt_token_ids: list[int], params: SamplingParams, priority: int, resume_tokens: list[int],
                    max_model_len: int, max_num_seqs: int) -> None:
    """A request's checks that depend only on its arguments and the config (no queue state); ValueError."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids: must be a non-empty list of token ids")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"prompt_token_ids: the prompt has {len(prompt_token_ids)} tokens, which leaves no "
                         f"room for output within max_model_len={max_model_len}; shorten the prompt")
    if params.n > max_num_seqs:
        raise ValueError(f"n: {params.n} samples exceed max_num_seqs={max_num_seqs}")
    if resume_tokens:
        _check_resume(prompt_token_ids, params, resume_tokens, max_model_len)


def _check_resume(prompt_token_ids: list[int], params: SamplingParams, resume_tokens: list[int],
                  max_model_len: int) -> None:
    """A continuation's output so far must leave room for one more token, for one sample."""
    if not isinstance(resume_tokens, (list, tuple)):
        raise ValueError(f"resume_tokens: must be a list of token ids, got {type(resume_tokens).__name__}")
    if params.n != 1:
        raise ValueError(f"resume_tokens: a continuation resumes one sample (n=1), got n={params.n}")
    if len(resume_tokens) >= params.max_tokens:
        raise ValueError(f"resume_tokens: {len(resume_tokens)} tokens already reach max_tokens={params.max_tokens}")
    if len(prompt_token_ids) + len(resume_tokens) >= max_model_len:
        raise ValueError(f"resume_tokens: the prompt and {len(resume_tokens)} resumed tokens leave no room within "
                         f"max_model_len={max_model_len}")
