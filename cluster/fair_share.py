"""FairShare: one engine's KV pool, seats and compute shared among tenants by weight.

On when ``SchedulerConfig.tenants`` names any tenant; requests that name none belong to the tenant
``default`` (weight 1, no caps, unless the table configures it). The scheduler asks this module who
goes next and whom to preempt; within one tenant, queue order (fcfs or priority) is unchanged.

Accounting (the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models", 2024,
with KV holding added):
- Each step adds to a tenant's counter, divided by its weight, the tokens its sequences computed plus
  its KV holding, ``blocks held x max_num_batched_tokens / num_blocks``: holding the whole pool for one
  step costs as much as a whole step's token budget. Time is counted in steps, not seconds, so the
  decisions do not depend on how fast the host is.
- A tenant that becomes active (nothing waiting or running before) starts no lower than the lowest
  counter of the active tenants: time spent idle banks no credit.
- Blocks are counted per sequence (``Sequence.kv_blocks``): a block two sequences share counts twice.

Decisions:
- Prefills and admissions go to the tenant with the lowest counter first (decodes are never held back).
- A tenant's share is its weight over the weights of the active tenants, of the usable blocks and of
  ``max_num_seqs``. When the head of a tenant's queue does not fit and taking it keeps the tenant within
  its share, the running sequences of tenants over their share are preempted (the one furthest over
  first, its last sequence in queue order); a tenant within its share is never preempted for a waiting one.
- A running sequence that finds no free block preempts the last sequence of a tenant further over its share
  than its own tenant will be, else (as without tenants) the last in queue order.
- A tenant's only running sequence is never a fair-share victim (either rule above), so every tenant keeps
  making progress and two tenants cannot preempt each other back and forth.
- ``max_kv_fraction``: a tenant whose blocks would pass its cap admits nothing more, and a running
  sequence that needs a block past the cap preempts the tenant's own last sequence; a tenant's only
  running sequence may outgrow the cap (so that every admitted request can finish). A prompt that alone
  needs more blocks than the cap is refused at intake (TenantQuotaError, HTTP 429).
- ``max_queued_requests``: the tenant's waiting requests; beyond it a request is refused (TenantQuotaError).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedray.workers.contract.config import DEFAULT_TENANT, TenantConfig

from .outputs import QueueFullError
from .request import Sequence


class TenantQuotaError(QueueFullError):
    """A tenant's quota refuses the request (HTTP 429 naming the quota)."""


@dataclass
class TenantState:
    config: TenantConfig
    cap_blocks: int            # max_kv_fraction of the pool
    counter: float = 0.0       # virtual tokens / weight
    blocks: int = 0            # blocks held by its running sequences (per sequence)
    live: int = 0              # its sequences waiting or running


class FairShare:
    def __init__(self, tenants: tuple[TenantConfig, ...], num_blocks: int, usable_blocks: int, max_num_seqs: int,
                 step_budget: int) -> None:
        configs = {t.name: t for t in tenants}
        configs.setdefault(DEFAULT_TENANT, TenantConfig(DEFAULT_TENANT))
        self.tenants = {name: TenantState(c, max(1, int(c.max_kv_fraction * num_blocks)))
                        for name, c in configs.items()}
        self.usable_blocks = usable_blocks
        self.max_num_seqs = max_num_seqs
        self._block_cost = step_budget / num_blocks     # virtual tokens per block held for one step

    def state(self, seq: Sequence) -> TenantState:
        return self.tenants[seq.request.tenant or DEFAULT_TENANT]

    # -- accounting ---------------------------------------------------------------------------
    def joined(self, tenant: TenantState, num: int = 1) -> None:
        """``num`` sequences of ``tenant`` became live (a request's enqueue, a fork)."""
        if tenant.live == 0:
            active = [t.counter for t in self.tenants.values() if t.live]
            tenant.counter = max(tenant.counter, min(active, default=tenant.counter))
        tenant.live += num

    @staticmethod
    def left(tenant: TenantState) -> None:
        """One sequence of ``tenant`` finished."""
        tenant.live -= 1

    def charge(self, scheduled: Iterable) -> None:
        """One step's cost: every scheduled token, and every block held, to its tenant's counter."""
        tokens: dict[str | None, int] = {}           # by Request.tenant (None: the default tenant)
        for sched in scheduled:
            name = sched.seq.request.tenant
            tokens[name] = tokens.get(name, 0) + sched.num_tokens
        for name, num in tokens.items():
            tenant = self.tenants[name or DEFAULT_TENANT]
            tenant.counter += num / tenant.config.weight
        for tenant in self.tenants.values():
            if tenant.blocks:
                tenant.counter += tenant.blocks * self._block_cost / tenant.config.weight

    # -- decisions ----------------------------------------------------------------------------
    def share(self, tenant: TenantState) -> float:
        active = sum(t.config.weight for t in self.tenants.values() if t.live) or tenant.config.weight
        return tenant.config.weight / active

    def within_share(self, tenant: TenantState, seats: dict[str, int], more_blocks: int, more_seats: int) -> bool:
        """Whether ``tenant`` taking ``more_blocks`` and ``more_seats`` stays within its share."""
        share = self.share(tenant)
        return (tenant.blocks + more_blocks <= share * self.usable_blocks
                and seats.get(tenant.config.name, 0) + more_seats <= share * self.max_num_seqs)

    def overage(self, tenant: TenantState, seats: dict[str, int], more_blocks: int = 0) -> float:
        """How far past its share ``tenant`` is (> 1: over it), in blocks or seats, whichever is more
        (``more_blocks``: after taking that many blocks more)."""
        share = self.share(tenant)
        return max((tenant.blocks + more_blocks) / (share * self.usable_blocks),
                   seats.get(tenant.config.name, 0) / (share * self.max_num_seqs))

    def victim(self, candidates: list[Sequence], key: Callable, seats: dict[str, int], running: dict[str, int],
               than: float = 1.0) -> Sequence | None:
        """The sequence fair share preempts among ``candidates``: the last (``key``) of the tenant furthest over its
        share (on a tie, the one with the higher counter), when that tenant is further over than ``than`` and
        runs another sequence (``running``: sequences per tenant; a tenant's only running sequence is never a
        fair-share victim, so every tenant keeps making progress). None when there is no such sequence."""
        eligible = [s for s in candidates if running.get(self.state(s).config.name, 0) >= 2]
        if not eligible:
            return None
        worst = max({id(self.state(s)): self.state(s) for s in eligible}.values(),
                    key=lambda t: (self.overage(t, seats), t.counter))
        if self.overage(worst, seats) <= than:
            return None
        return max((s for s in eligible if self.state(s) is worst), key=key)

    def passes_cap(self, seq: Sequence, blocks_after: int) -> bool:
        """Whether ``seq`` holding ``blocks_after`` blocks takes its tenant past its cap."""
        tenant = self.state(seq)
        return tenant.blocks - seq.kv_blocks + blocks_after > tenant.cap_blocks

    def stats(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> tuple[tuple[str, int, int, int], ...]:
        """Per-tenant gauges for /metrics: (name, KV blocks, waiting sequences, running sequences)."""
        counts = {name: [0, 0] for name in self.tenants}
        for index, seqs in ((0, waiting), (1, running)):
            for seq in seqs:
                counts[seq.request.tenant or DEFAULT_TENANT][index] += 1
        return tuple((name, t.blocks, *counts[name]) for name, t in self.tenants.items())
