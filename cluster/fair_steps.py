"""FairSteps: the Scheduler's steps with fair share among tenants (``SchedulerConfig.tenants``).

A mixin of ``Scheduler`` (cluster/scheduler.py): what the scheduler does differently when ``self.fair`` (a
``FairShare``, cluster/fair_share.py, which holds the accounting and the policy) is set. Nothing here runs
without tenants. Order of a step with tenants: ``_make_room_for_fair_share``, ``_sort_running_by_share``, the
decodes, ``_fair_prefills_and_admissions``, then ``FairShare.charge``.
"""

from __future__ import annotations

from pagedray.workers.contract.config import DEFAULT_TENANT

from .fair_share import TenantQuotaError
from .request import Sequence, SequenceStatus
from .scheduler_output import SchedulerOutput

_PASSED = -1    # Scheduler._try_admit: the sequence waits for its adapter or its tier loads; those behind it go on
_BLOCKED = -2   # Scheduler._try_admit: no seat or no blocks for it


class FairSteps:
    def _check_tenant_quota(self, tenant: str | None, num_prompt_tokens: int) -> None:
        state = self.fair.tenants.get(tenant or DEFAULT_TENANT)
        if state is None:
            raise ValueError(f"tenant: {tenant!r} is not configured (tenants: {sorted(self.fair.tenants)})")
        name, limit = state.config.name, state.config.max_queued_requests
        if limit is not None:
            num = sum(1 for s in self.waiting if (s.request.tenant or DEFAULT_TENANT) == name and s.index == 0)
            if num >= limit:
                raise TenantQuotaError(f"tenant {name!r}: {num} requests are waiting (its max_queued_requests="
                                       f"{limit}); retry later")
        blocks = -(-num_prompt_tokens // self.block_manager.block_size)
        if blocks > state.cap_blocks:
            raise TenantQuotaError(f"tenant {name!r}: the prompt needs {blocks} KV blocks, more than its "
                                   f"max_kv_fraction={state.config.max_kv_fraction} allows ({state.cap_blocks} "
                                   "blocks); shorten the prompt")

    def _passes_cap(self, seq: Sequence, num: int) -> bool:
        """Whether ``num`` more slots take ``seq``'s tenant past its KV cap while another sequence of the tenant
        runs (its only running sequence may outgrow the cap)."""
        blocks_after = -(-(seq.num_scheduled_through + num) // self.block_manager.block_size)
        if blocks_after <= seq.kv_blocks or not self.fair.passes_cap(seq, blocks_after):
            return False
        tenant = self.fair.state(seq)
        return any(s is not seq and self.fair.state(s) is tenant for s in self.running)

    def _may_preempt(self) -> bool:
        """Whether a running sequence may find no free block this step: fewer blocks free than each running
        sequence's decode can take (one block, more with speculative drafts) plus the step budget's worth (an
        upper bound of what decodes and prefills can take; forks have taken theirs already). When none may,
        the order of the running set decides nothing."""
        bm = self.block_manager
        per_sequence = 1 + -(-self.config.num_speculative_tokens // bm.block_size)
        return (bm.num_free_blocks
                < per_sequence * len(self.running) + self.config.max_num_batched_tokens // bm.block_size + 2)

    def _sort_running_by_share(self) -> None:
        """With fair share the running sequences go tenant by tenant, the tenant least over its share first (each
        tenant's in queue order): one that needs a block finds the sequences of tenants further over their
        share not scheduled yet, so those are the victims."""
        fair, (seats, _) = self.fair, self._tenant_counts()
        rank = {name: fair.overage(t, seats) for name, t in fair.tenants.items()}
        rank[None] = rank[DEFAULT_TENANT]                # Request.tenant None: the default tenant
        key = self._key
        self.running.sort(key=lambda s: (rank[s.request.tenant], key(s)))
        self._running_sorted = False          # not in queue order: a step without fair sorting sorts it back

    def _tenant_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(seats, running sequences) per tenant, in one pass over the running set."""
        seats: dict[str, int] = {}
        running: dict[str, int] = {}
        for seq in self.running:
            name = seq.request.tenant or DEFAULT_TENANT
            seats[name] = seats.get(name, 0) + 1 + seq.request.num_unforked * seq.must_fork_first
            running[name] = running.get(name, 0) + 1
        return seats, running

    def _fair_order(self, name: str, spent: dict[str, float]) -> tuple[float, int]:
        """Who goes first with fair share: the lowest counter (with this step's tokens so far), then the fewest
        blocks held."""
        tenant = self.fair.tenants[name]
        return tenant.counter + spent.get(name, 0.0), tenant.blocks

    def _fair_prefills_and_admissions(self, prefills: list, budget: int, out: SchedulerOutput) -> None:
        """Steps 3 and 4 with fair share: the partial prefills and the waiting sequences, tenant by tenant, the
        one lowest in ``_fair_order`` first (each tenant's own in queue order, its prefills before its
        admissions). A tenant whose next sequence cannot be admitted admits nothing more this step; a
        tenant at its KV cap admits nothing."""
        fair = self.fair
        queues: dict[str, list] = {}
        for seq, left in prefills:
            queues.setdefault(fair.state(seq).config.name, []).append((seq, left))
        admitting = not out.preempted and bool(self.waiting)
        taken = 0
        if admitting:
            taken = self._seats_taken()
            if self.lora_slots is not None:
                self.lora_slots.begin_pass()
            for seq in self._waiting_in_order():
                queues.setdefault(fair.state(seq).config.name, []).append((seq, None))
        cursors = dict.fromkeys(queues, 0)
        spent: dict[str, float] = {}
        while budget > 0 and cursors:
            name = min(cursors, key=lambda n: self._fair_order(n, spent))
            queue, index = queues[name], cursors[name]
            cursors[name] = index + 1
            if index + 1 == len(queue):
                del cursors[name]
            seq, left = queue[index]
            if left is not None:                     # a running partial prefill
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                num = min(left, budget)
                reserved = self._reserve(seq, num, out)
                admitting = admitting and not out.preempted    # freed blocks go to the running sequences first
                if not reserved:
                    continue
                self._schedule_tokens(seq, num, out)
            else:
                if not admitting or seq.status is not SequenceStatus.WAITING:
                    continue
                seats = self._seats_of(seq)
                num = _BLOCKED if self._admission_passes_cap(seq, budget) else self._try_admit(seq, budget, out, taken)
                if num == _PASSED:
                    continue
                if num == _BLOCKED:
                    cursors.pop(name, None)          # its later sequences wait behind it
                    continue
                taken += seats
            budget -= num
            spent[name] = spent.get(name, 0.0) + num / fair.tenants[name].config.weight

    def _admission_passes_cap(self, seq: Sequence, budget: int) -> bool:
        """Whether admitting ``seq`` takes its tenant, which runs something already, past its KV cap."""
        tenant = self.fair.state(seq)
        if not tenant.blocks:
            return False
        hit, num, _, _ = self._first_chunk(seq, budget)
        return tenant.blocks + -(-(hit + num) // self.block_manager.block_size) > tenant.cap_blocks

    def _make_room_for_fair_share(self, out: SchedulerOutput, budget: int) -> None:
        """Before the step: for each tenant's first waiting sequence (lowest counter first) that does not fit,
        and that its tenant may take within its share, the running sequences of tenants over their share are
        preempted (``FairShare.victim``) until it fits. These preemptions do not stop this step's admissions."""
        fair, bm = self.fair, self.block_manager
        heads: dict[str, Sequence] = {}
        for seq in self._waiting_in_order():
            heads.setdefault(fair.state(seq).config.name, seq)
        taken, seats, running = self._seats_taken(), None, None
        for name in sorted(heads, key=lambda n: self._fair_order(n, {})):
            seq, tenant = heads[name], fair.tenants[name]
            lora = seq.request.lora
            if (lora is not None and not self.lora_slots.can_acquire(lora)) or seq in self._tier_loads:
                continue
            hit, num, reuse, root = self._first_chunk(seq, budget)
            need_seats = self._seats_of(seq)
            if (taken + need_seats <= self.config.max_num_seqs
                    and bm.can_allocate(seq.seq_id, seq.token_ids, max(num, 1), reuse, root=root)):
                continue                             # it fits: nobody is preempted for it
            if seats is None:                        # per-tenant counts, once a head does not fit
                seats, running = self._tenant_counts()
            if not fair.within_share(tenant, seats, -(-(hit + num) // bm.block_size), need_seats):
                continue
            while (sum(seats.values()) + need_seats > self.config.max_num_seqs
                   or not bm.can_allocate(seq.seq_id, seq.token_ids, max(num, 1), reuse, root=root)):
                others = [s for s in self.running if fair.state(s) is not tenant]
                victim = fair.victim(others, self._key, seats, running) if others else None
                if victim is None:
                    break
                victim_name = fair.state(victim).config.name
                seats[victim_name] -= self._seats_of(victim)
                running[victim_name] -= 1
                self._preempt(victim, out, stops_admission=False)
