"""Cache-aware request routing between engine replicas (Ray Serve's request-router API).

Each engine replica reports, through Serve's ``record_routing_stats`` poll (every
``ROUTING_STATS_PERIOD_S``, no call per request), a bounded summary of its prefix cache: the hashes of
at most ``PREFIX_SUMMARY_BLOCKS`` cached full-block keys (``BlockManager.cached_prefix_hashes``) and
its load. ``CacheAwareRouter`` runs in every process that holds a handle to the engine deployment
(the ingress replicas). For a ``generate`` call it hashes the prompt's full blocks the same way
(``prefix_block_hashes``: chained keys, so a matching hash means the whole prefix up to that block
matches) and picks:

- the replica holding the longest run of the prompt's leading blocks, among the replicas whose load
  (requests in flight there: Serve's cached queue length, else the summary's running and waiting sequences
  plus the ``generate`` calls this router sent there since that summary arrived) is at most
  ``max_imbalance`` above the least-loaded replica's;
  ties go to the less loaded. With a second KV tier a replica also reports the hashes of blocks there and
  what one saves against computing it (``tier_weight``, measured: cluster/tier_cost.py); the blocks of the
  prompt in its tier right after its cached run count ``tier_weight`` each;
- when no such replica holds any block (a cold prompt): among the same eligible replicas, those with
  the smallest cache footprint this router has placed there (the distinct prompt blocks it sent them,
  ``on_request_routed``), then the least load; Serve probes their queues and takes the shortest. This
  is SGLang's "smallest tree" rule: new prefixes spread evenly over the replicas' caches, so that each
  replica's share of the prefixes fits its cache, instead of following a momentary queue length (with
  8 prefixes and 2 replicas, least-load alone often put 5 prefixes on one replica and 3 on the other);
- a prompt shorter than one block (no full block to cache or find): the least-loaded eligible replicas.
  Footprint first would send every such prompt to the same replica, since they add nothing to it.
- a request with a LoRA adapter (the call's ``lora``): only the eligible replicas where the adapter is
  resident (each replica's summary lists them) take part in the rules above, when there is one; and the
  prompt's hashes are the adapter's chains (``prefix_block_hashes(..., namespace)``), the ones its blocks
  are cached under.

A ``generate`` call of a request moved from a busy replica (``serve/rebalance.py``) names that replica
(``exclude``) and brings its KV blocks (``kv``): it goes to the least-loaded other replica. A call that brings
``kv`` without ``exclude`` (prefill/decode disaggregation) goes to the least-loaded replica too.

An ``export_prefix`` call (a replica pulling a prefix from a peer: ``serve/kv_pull.py``) goes to the replica
holding the longest run of its tokens' leading blocks, whatever its load (an export reads blocks, it computes
nothing), and never to the calling replica (its ``exclude`` argument). An ``import_prefix`` call (a KVExport
pushed from outside: tests, tools, rebalancing) goes to the replica holding the fewest of its blocks, the one it
is for.

Other calls (stats, health, drain, model_meta, warm_up_report) go to any replica as with Serve's default
router: every candidate, in random order (Serve takes the first of the shortest queues, so a fixed order
sent every such call between idle replicas to the same one).

Invariants of the routing loop (Serve runs it; issue #39):
- A replica found with room for one pending request goes to the oldest pending request (``FIFOMixin``, as in
  Serve's default router), not to the pending request with the same Serve internal request id (the base
  class). The ingress sends several ``generate`` calls for one HTTP request (the prompts of a batch, one
  continuation per sample of a lost ``n > 1`` request): Serve gives them all that request's id and indexes
  one pending request per id, so exact matching never fulfils the second one, and its routing task loops
  for ever, without yielding when the replica's queue length is cached (the router thread of the ingress
  then starves every other call). Requests pending at the same moment are few (a burst), so the prefix
  choice made for one of them rarely goes to another.
- A request that no chosen replica can take backs off between rounds (``should_backoff``, Serve's sleep),
  instead of probing the replicas in a tight loop.

Decisions: docs/design/deploy.md, ``pagedray.deploy.routing.router``.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Container
from dataclasses import dataclass

from pagedray.block_manager import prefix_block_hashes
from pagedray.workers.contract.lora_request import LoRARequest
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import registry as router_registry

PREFIX_SUMMARY_BLOCKS = 8192     # block hashes one replica reports (8 bytes each on the wire)
ROUTING_STATS_PERIOD_S = 1.0     # how often Serve polls each replica's record_routing_stats
GENERATE_METHODS = ("generate", "prefill")   # the engine deployment's methods whose args[1] is the prompt
EXPORT_METHOD = "export_prefix"  # the engine deployment's method whose args are (token_ids, lora)
IMPORT_METHOD = "import_prefix"  # ... whose args[0] is a KVExport


@dataclass(frozen=True)
class ReplicaView:
    """What the routing choice knows of one replica."""

    replica: object            # returned as given
    cached: Container[int]     # hashes of the blocks it holds
    load: int                  # requests in flight there
    footprint: int = 0         # distinct prompt blocks this router has sent there (its remembered share)
    adapters: Container[str] = ()   # the LoRA adapters resident in its slots
    tiered: Container[int] = ()     # hashes of the blocks in its second KV tier
    tier_weight: float = 0.0        # what a tier block is worth against a cached one (0..1, measured)


class HeldBlocks:
    """The blocks a replica reported plus those of the prompts sent to it since (no copy of either)."""

    def __init__(self, reported: frozenset[int], sent: Container[int]) -> None:
        self._reported, self._sent = reported, sent

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._reported or block_hash in self._sent


def leading_blocks_held(prompt_hashes: list[int], cached) -> int:
    """How many of the prompt's leading full blocks ``cached`` holds (stops at the first miss)."""
    count = 0
    for block_hash in prompt_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def prefix_score(prompt_hashes: list[int], view: ReplicaView) -> tuple[float, int]:
    """(the prompt's leading blocks ``view`` holds, plus ``tier_weight`` for each block after them in its tier;
    the cached ones alone)."""
    held = leading_blocks_held(prompt_hashes, view.cached)
    if not view.tier_weight:
        return float(held), held
    return held + view.tier_weight * leading_blocks_held(prompt_hashes[held:], view.tiered), held


def choose_by_prefix(prompt_hashes: list[int], replicas: list[ReplicaView], max_imbalance: int,
                     adapter: str | None = None) -> tuple[list, int]:
    """(the replicas to send to, in one rank; the prompt blocks the chosen one holds in its KV cache).

    Eligible: the replicas within ``max_imbalance`` of the least load; with an ``adapter``, only those of them
    where it is resident when any is. The eligible replica with the highest ``prefix_score`` (ties: less
    load, then the order given); when no eligible replica holds a block: every eligible replica with the
    smallest ``(footprint, load)``, or with the least load for a prompt shorter than one block."""
    if not replicas:
        raise ValueError("replicas: at least one replica is needed")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance: must be >= 0, got {max_imbalance}")
    least = min(view.load for view in replicas)
    eligible = [view for view in replicas if view.load - least <= max_imbalance]
    if adapter is not None:
        eligible = [view for view in eligible if adapter in view.adapters] or eligible
    best, best_score, best_held = None, 0.0, 0
    for view in eligible:
        score, held = prefix_score(prompt_hashes, view)
        if score > best_score or (score == best_score and score > 0 and view.load < best.load):
            best, best_score, best_held = view, score, held
    if best is not None:
        return [best.replica], best_held
    if not prompt_hashes:   # no full block: nothing to place in a cache, so load alone decides
        return least_loaded(eligible), 0
    emptiest = min((view.footprint, view.load) for view in eligible)
    return [view.replica for view in eligible if (view.footprint, view.load) == emptiest], 0


def least_loaded(replicas: list[ReplicaView]) -> list:
    """The replicas with the least load."""
    least = min(view.load for view in replicas)
    return [view.replica for view in replicas if view.load == least]


def remember_sent(sent: collections.OrderedDict[int, None], prompt_hashes: list[int]) -> None:
    """Add a routed prompt's block hashes to ``sent`` (a replica's remembered share, newest last), keeping
    at most ``PREFIX_SUMMARY_BLOCKS`` (the oldest go first)."""
    for block_hash in prompt_hashes:
        sent[block_hash] = None
        sent.move_to_end(block_hash)
    while len(sent) > PREFIX_SUMMARY_BLOCKS:
        sent.popitem(last=False)


def generate_prompt(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt token ids of an engine ``generate`` call, else None."""
    if pending_request is None or pending_request.metadata.call_method not in GENERATE_METHODS:
        return None
    args = pending_request.args
    return args[1] if len(args) > 1 and isinstance(args[1], list) else None


def generate_adapter(pending_request: PendingRequest) -> LoRARequest | None:
    """The LoRA adapter of an engine ``generate`` or ``prefill`` call (an argument after the prompt), or None."""
    return next((arg for arg in pending_request.args[2:] if isinstance(arg, LoRARequest)), None)


def choose_exporter(pending_request: PendingRequest, candidates: list[RunningReplica], cached,
                    block_size: int) -> list:
    """The replicas for an ``export_prefix`` call: the one (not its caller) whose ``cached(replica)`` holds the
    longest run of the tokens' leading blocks; every replica but the caller when none holds any."""
    args, exclude = pending_request.args, pending_request.kwargs.get("exclude")
    tokens = args[0] if args and isinstance(args[0], list) else []
    adapter = args[1] if len(args) > 1 and isinstance(args[1], LoRARequest) else None
    peers = [r for r in candidates if r.replica_id.unique_id != exclude] or candidates
    hashes = prompt_hashes(tokens, block_size, adapter)
    held = [(leading_blocks_held(hashes, cached(r)), r) for r in peers]
    best = max(count for count, _ in held)
    return [r for count, r in held if count == best] if best else peers


def choose_importer(pending_request: PendingRequest, candidates: list[RunningReplica], cached,
                    block_size: int) -> list:
    """The replicas for an ``import_prefix`` call: those holding the fewest leading blocks of its export."""
    export = pending_request.args[0] if pending_request.args else None
    tokens, namespace = getattr(export, "token_ids", None), getattr(export, "namespace", None)
    if not isinstance(tokens, list):
        return candidates
    hashes = prefix_block_hashes(tokens, block_size, namespace)
    held = [(leading_blocks_held(hashes, cached(r)), r) for r in candidates]
    fewest = min(count for count, _ in held)
    return [r for count, r in held if count == fewest]


def prompt_hashes(prompt: list[int], block_size: int, adapter: LoRARequest | None) -> list[int]:
    """The hashes the prompt's blocks are cached under: the base model's chains, or its adapter's."""
    return prefix_block_hashes(prompt, block_size, None if adapter is None else adapter.cache_namespace)


def replica_summaries(app_name: str, deployment_name: str) -> list[dict] | None:
    """The last summary (``ServedEngine.routing_stats``) of every replica that a CacheAwareRouter in this
    process routes to; None when there is no such router or no replica has reported yet."""
    router = router_registry.lookup(app_name, deployment_name)
    if router is None:
        return None
    replicas = list(router.curr_replicas.values())   # the router swaps in a new dict on updates
    summaries = [r.routing_stats for r in replicas if (r.routing_stats or {}).get("replica")]
    return summaries or None


class CacheAwareRouter(FIFOMixin, RequestRouter):
    """Serve request router for the engine deployment (see the module docstring, its invariants too)."""

    def initialize_state(self, *, block_size: int, max_imbalance: int) -> None:
        router_registry.register(self._deployment_id.app_name, self._deployment_id.name, self)
        self._block_size = block_size
        self._max_imbalance = max_imbalance
        self._sent: dict[ReplicaID, collections.OrderedDict[int, None]] = {}
        self._reported: dict[tuple, tuple[list, frozenset[int]]] = {}   # (the reported list, its set)
        # per replica: its summary as last seen here, and the generate calls routed there since it arrived
        self._since_summary: dict[ReplicaID, tuple[dict | None, int]] = {}

    def _reported_set(self, replica: RunningReplica, field: str) -> frozenset[int]:
        hashes = (replica.routing_stats or {}).get(field) or []
        memo = self._reported.get((replica.replica_id, field))
        if memo is None or memo[0] is not hashes:   # a new report (the memo keeps the old list alive)
            memo = (hashes, frozenset(hashes))
            self._reported[(replica.replica_id, field)] = memo
        return memo[1]

    def _cached(self, replica: RunningReplica) -> HeldBlocks:
        return HeldBlocks(self._reported_set(replica, "prefix_hashes"), self._sent.get(replica.replica_id, {}))

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        footprint = len(self._sent.get(replica.replica_id, ()))
        return ReplicaView(replica, self._cached(replica), self._load(replica), footprint,
                           frozenset(stats.get("lora_resident") or ()), self._reported_set(replica, "tier_hashes"),
                           float(stats.get("tier_weight") or 0.0))

    def _load(self, replica: RunningReplica) -> int:
        """Serve's cached queue length of the replica, else its last summary's sequences plus the generate calls
        this router sent it since that summary arrived (a summary is up to ``ROUTING_STATS_PERIOD_S`` old: right
        after a burst it still says idle, and every request of the burst would pile onto one replica)."""
        sent = self._sent_since_summary(replica)
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        stats = (replica.routing_stats or {}).get("stats") or {}   # {}: a replica not polled yet
        return int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0)) + sent

    def _sent_since_summary(self, replica: RunningReplica) -> int:
        """The generate calls routed to ``replica`` since its summary object changed. Serve hands a new object per
        broadcast of the replica list, which may also come with another replica's report: the count then restarts
        early and undercounts until the next report, never over."""
        seen, sent = self._since_summary.get(replica.replica_id, (None, 0))
        if seen is not replica.routing_stats:      # a new summary counts what was sent before it
            self._since_summary[replica.replica_id] = (replica.routing_stats, 0)
            return 0
        return sent

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:   # no room on what this returns: Serve sleeps before the next round
            pending_request.routing_context.should_backoff = True
        prompt = generate_prompt(pending_request)
        if len(candidate_replicas) < 2:
            return [candidate_replicas]
        if pending_request is not None and pending_request.metadata.call_method == EXPORT_METHOD:
            return [choose_exporter(pending_request, candidate_replicas, self._cached, self._block_size)]
        if pending_request is not None and pending_request.metadata.call_method == IMPORT_METHOD:
            return [choose_importer(pending_request, candidate_replicas, self._cached, self._block_size)]
        if prompt is None:   # in random order: Serve takes the first of the shortest queues, ties are common here
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        exclude, kwargs = pending_request.kwargs.get("exclude"), pending_request.kwargs
        if exclude is not None:   # a moved request (serve/rebalance.py): never back to the replica it left
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id != exclude] \
                or candidate_replicas
        if kwargs.get("kv") is not None:   # it brings its blocks: the load alone decides
            return [least_loaded([self._view(r) for r in candidate_replicas])]
        adapter = generate_adapter(pending_request)
        hashes = prompt_hashes(prompt, self._block_size, adapter)
        views = [self._view(r) for r in candidate_replicas]
        chosen, _ = choose_by_prefix(hashes, views, self._max_imbalance, None if adapter is None else adapter.name)
        return [chosen]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        prompt = generate_prompt(pending_request)
        if prompt is None:
            return
        if replica_id in self._since_summary:      # set when the choice read the replica's load
            seen, sent = self._since_summary[replica_id]
            self._since_summary[replica_id] = (seen, sent + 1)
        remember_sent(self._sent.setdefault(replica_id, collections.OrderedDict()),
                      prompt_hashes(prompt, self._block_size, generate_adapter(pending_request)))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
        self._since_summary.pop(replica_id, None)
        for field in ("prefix_hashes", "tier_hashes"):
            self._reported.pop((replica_id, field), None)
