"""Cache-aware routing (deploy/routing/router.py): the block-hash contract between router and engine, the choice
rule, and the router class driven with stand-in replicas (no Ray cluster: the class runs in-process), also
inside Serve's own routing loop (calls that share Serve's request id are all placed)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from pagedray.block_manager import BlockManager, prefix_block_hashes
from pagedray.deploy.routing.router import (
    PREFIX_SUMMARY_BLOCKS,
    CacheAwareRouter,
    ReplicaView,
    choose_by_prefix,
    generate_prompt,
    leading_blocks_held,
    prefix_score,
)

BS = 4


def test_a_prompt_hashes_like_the_blocks_the_engine_caches():
    manager = BlockManager(BS, 16)
    prompt = list(range(100, 111))                       # 11 tokens: 2 full blocks + 3 tokens
    manager.allocate_slots("a", prompt, len(prompt))
    hashes = prefix_block_hashes(prompt, BS)
    assert len(hashes) == 2 and set(manager.cached_prefix_hashes(10)) == set(hashes)
    other = prompt[:4] + [7, 7, 7, 7, 1]                 # first block shared, second not
    assert prefix_block_hashes(other, BS)[0] == hashes[0] and prefix_block_hashes(other, BS)[1] != hashes[1]
    assert prefix_block_hashes(prompt[4:], BS)[0] != hashes[1]   # a block's hash depends on its whole prefix
    assert prefix_block_hashes(prompt[:3], BS) == []


def test_the_cache_summary_is_bounded_running_blocks_first_then_the_last_freed():
    manager = BlockManager(BS, 16)
    old, recent, running = [list(range(s, s + 8)) for s in (0, 50, 90)]
    for seq_id, prompt in (("old", old), ("recent", recent), ("running", running)):
        manager.allocate_slots(seq_id, prompt, len(prompt))
    manager.free("old")
    manager.free("recent")
    assert manager.cached_prefix_hashes(2) == prefix_block_hashes(running, BS)
    # one more: the most recently freed block (free releases last-to-first, so recent's first block)
    assert manager.cached_prefix_hashes(3)[2] == prefix_block_hashes(recent, BS)[0]
    assert len(manager.cached_prefix_hashes(100)) == 6 and manager.cached_prefix_hashes(0) == []
    with pytest.raises(ValueError, match="limit"):
        manager.cached_prefix_hashes(-1)
    assert BlockManager(BS, 16, enable_prefix_caching=False).cached_prefix_hashes(5) == []


def test_leading_blocks_stop_at_the_first_miss():
    assert leading_blocks_held([1, 2, 3], {1, 2, 3}) == 3
    assert leading_blocks_held([1, 2, 3], {1, 3}) == 1
    assert leading_blocks_held([1, 2, 3], {2, 3}) == 0
    assert leading_blocks_held([], {1}) == 0


def test_choose_the_longest_cached_prefix_within_the_imbalance_else_the_least_loaded():
    prompt = [11, 12, 13]
    a, b, c = ReplicaView("a", {11}, 3), ReplicaView("b", {11, 12}, 5), ReplicaView("c", set(), 1)
    assert choose_by_prefix(prompt, [a, b, c], max_imbalance=8) == (["b"], 2)
    assert choose_by_prefix(prompt, [a, b, c], max_imbalance=3) == (["a"], 1)    # b is 4 above c
    assert choose_by_prefix(prompt, [a, b, c], max_imbalance=1) == (["c"], 0)    # no holder eligible
    even = [ReplicaView("x", {11}, 2), ReplicaView("y", {11}, 1)]
    assert choose_by_prefix(prompt, even, 8) == (["y"], 1)                       # tie: less load
    cold = [ReplicaView("x", set(), 2), ReplicaView("y", set(), 0), ReplicaView("z", set(), 0)]
    assert choose_by_prefix(prompt, cold, 8) == (["y", "z"], 0)                 # all the least loaded
    with pytest.raises(ValueError, match="replicas"):
        choose_by_prefix(prompt, [], 8)
    with pytest.raises(ValueError, match="max_imbalance"):
        choose_by_prefix(prompt, [a], -1)


def test_blocks_in_a_second_tier_count_their_measured_weight_after_the_cached_run():
    prompt = [11, 12, 13, 14, 15]
    cached = ReplicaView("cached", {11, 12}, 1)
    tiered = ReplicaView("tiered", {11}, 1, tiered={12, 13, 14, 99}, tier_weight=0.6)    # 1 + 3 x 0.6 = 2.8
    assert choose_by_prefix(prompt, [cached, tiered], 8) == (["tiered"], 1)
    cheap = ReplicaView("tiered", {11}, 1, tiered={12, 13, 14}, tier_weight=0.2)         # 1 + 0.6 < 2
    assert choose_by_prefix(prompt, [cached, cheap], 8) == (["cached"], 2)
    gap = ReplicaView("gap", {11}, 1, tiered={13, 14, 15}, tier_weight=0.9)              # 12 is nowhere: 1
    assert choose_by_prefix(prompt, [cached, gap], 8) == (["cached"], 2)
    unmeasured = ReplicaView("tiered", set(), 0, tiered={11, 12, 13}, tier_weight=0.0)   # counts for nothing
    assert choose_by_prefix(prompt, [cached, unmeasured], 8) == (["cached"], 2)
    assert prefix_score(prompt, tiered) == (pytest.approx(2.8), 1)


def test_a_cold_prompt_goes_to_the_smallest_footprint_within_the_imbalance():
    prompt = [11, 12, 13]
    cold = [ReplicaView("x", set(), 2, footprint=64), ReplicaView("y", set(), 0, footprint=80),
            ReplicaView("z", set(), 1, footprint=64)]
    assert choose_by_prefix(prompt, cold, 8) == (["z"], 0)            # smallest footprint, then less load
    assert choose_by_prefix(prompt, cold, 1) == (["z"], 0)            # x is 2 above y: not eligible
    assert choose_by_prefix(prompt, cold, 0) == (["y"], 0)            # only the least loaded is eligible
    tied = [ReplicaView("x", set(), 1, footprint=16), ReplicaView("y", set(), 1, footprint=16)]
    assert choose_by_prefix(prompt, tied, 8) == (["x", "y"], 0)       # Serve probes the tie


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded_whatever_the_footprints():
    """Such a prompt adds no block to a replica's footprint: footprint first would send them all to one replica."""
    replicas = [ReplicaView("x", {11}, 0, footprint=64), ReplicaView("y", set(), 1, footprint=0),
                ReplicaView("z", set(), 0, footprint=16)]
    assert choose_by_prefix([], replicas, 8) == (["x", "z"], 0)
    assert choose_by_prefix([], replicas[1:], 8) == (["z"], 0)
    assert choose_by_prefix([11], replicas[1:], 8) == (["y"], 0)      # a full block to place: footprint first


def test_eight_new_prefixes_split_four_and_four_between_two_replicas():
    """The placement the footprint rule exists for: equal loads, prefixes arriving one after the other."""
    async def scenario():
        router = make_router()
        stats = {"stats": {"num_running": 0, "num_waiting": 0}, "prefix_hashes": []}
        a, b = FakeReplica("a", dict(stats)), FakeReplica("b", dict(stats))
        placed = {"a": 0, "b": 0}
        for system in range(8):
            prompt = list(range(1000 * system, 1000 * system + 4 * BS))
            [choice] = await router.choose_replicas([a, b], generate_call(prompt))
            replica = choice[0]                          # Serve's probe would take the first of a tie
            router.on_request_routed(generate_call(prompt), replica.replica_id, None)
            placed[replica.replica_id] += 1
            # later turns of the same system follow it
            assert await router.choose_replicas([a, b], generate_call(prompt + [5])) == [[replica]]
        assert placed == {"a": 4, "b": 4}

    asyncio.run(scenario())


@dataclass
class FakeMetadata:
    call_method: str


@dataclass
class FakeRequest:
    args: list
    metadata: FakeMetadata
    kwargs: dict = field(default_factory=dict)
    routing_context: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(should_backoff=False))


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict


def generate_call(prompt: list[int]) -> FakeRequest:
    return FakeRequest(["req", prompt, None], FakeMetadata("generate"))


def test_only_generate_calls_carry_a_prompt():
    assert generate_prompt(generate_call([1, 2])) == [1, 2]
    assert generate_prompt(FakeRequest([], FakeMetadata("stats"))) is None
    assert generate_prompt(None) is None


def make_router(**options) -> CacheAwareRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = CacheAwareRouter(DeploymentID(name="PagedEngine", app_name="test"), DeploymentHandleSource.UNKNOWN,
                              **options)
    router.initialize_state(block_size=BS, max_imbalance=2)
    return router


def test_the_router_follows_reported_caches_and_its_own_sends_and_respects_load():
    async def scenario():
        router = make_router()
        shared = list(range(200, 212))                  # 3 full blocks
        stats = {"stats": {"num_running": 0, "num_waiting": 0}}
        a = FakeReplica("a", {**stats, "prefix_hashes": []})
        b = FakeReplica("b", {**stats, "prefix_hashes": prefix_block_hashes(shared[:8], BS)})
        assert await router.choose_replicas([a, b], generate_call(shared + [1])) == [[b]]
        # a prompt nobody holds: every least-loaded replica, for Serve to probe
        fresh = list(range(500, 512))
        assert await router.choose_replicas([a, b], generate_call(fresh)) == [[a, b]]
        # once sent to a, a holds it for this router before a's next report
        router.on_request_routed(generate_call(fresh), "a", None)
        assert await router.choose_replicas([a, b], generate_call(fresh + [9])) == [[a]]
        # a holder loaded beyond the imbalance is passed over
        busy_b = FakeReplica("b", {"stats": {"num_running": 3, "num_waiting": 1},
                                   "prefix_hashes": b.routing_stats["prefix_hashes"]})
        assert await router.choose_replicas([a, busy_b], generate_call(shared)) == [[a]]
        # control calls (no prompt) go to any replica: all of them, in random order (Serve breaks ties by order)
        random.seed(39)
        orders = [await router.choose_replicas([a, b], FakeRequest([], FakeMetadata("stats"))) for _ in range(32)]
        assert {tuple(r.replica_id for r in order) for [order] in orders} == {("a", "b"), ("b", "a")}
        router.on_replica_actor_died("a")
        assert await router.choose_replicas([a, b], generate_call(fresh)) == [[a, b]]

    asyncio.run(scenario())


def test_a_burst_over_stale_summaries_counts_the_calls_sent_since_each_summary():
    """Summaries come once a poll period; right after a burst they still say idle, so with Serve's queue-length
    cache empty every call of the burst went to the same replica. The router adds the generate calls it sent
    since a replica's summary arrived; that replica's next summary, which includes them, replaces the count."""
    async def scenario():
        router = make_router()
        idle = {"stats": {"num_running": 0, "num_waiting": 0}, "prefix_hashes": []}
        a, b = FakeReplica("a", dict(idle)), FakeReplica("b", dict(idle))
        short = [7]                                        # shorter than a block: the least-loaded rule alone
        placed = []
        for _ in range(4):
            [chosen] = await router.choose_replicas([a, b], generate_call(short))
            placed.append(chosen[0].replica_id)            # Serve sends it to the first chosen one with room
            router.on_request_routed(generate_call(short), chosen[0].replica_id, None)
        assert placed == ["a", "b", "a", "b"]
        router.on_request_routed(FakeRequest([], FakeMetadata("stats")), "a", None)   # no prompt: not counted
        a.routing_stats = {"stats": {"num_running": 1, "num_waiting": 1}, "prefix_hashes": []}   # its 2, reported
        assert await router.choose_replicas([a, b], generate_call(short)) == [[a, b]]
        b.routing_stats = {"stats": {"num_running": 0, "num_waiting": 0}, "prefix_hashes": []}   # b's 2 finished
        assert await router.choose_replicas([a, b], generate_call(short)) == [[b]]
        router.on_replica_actor_died("b")
        b2 = FakeReplica("b", dict(idle))
        assert await router.choose_replicas([a, b2], generate_call(short)) == [[b2]]

    asyncio.run(scenario())


def test_a_generate_call_asks_serve_to_back_off_when_no_chosen_replica_has_room():
    """Else a request that no replica can take yet is retried in a tight loop on the router's thread."""
    async def scenario():
        router = make_router()
        a = FakeReplica("a", {"stats": {"num_running": 0, "num_waiting": 0}, "prefix_hashes": []})
        call = generate_call([1, 2, 3])
        await router.choose_replicas([a], call)
        assert call.routing_context.should_backoff

    asyncio.run(scenario())


@dataclass
class RoutableReplica:
    """What Serve's routing loop asks of a replica: its id, its bound, its queue length (always room)."""

    replica_id: str
    routing_stats: dict = field(default_factory=lambda: {"stats": {"num_running": 0, "num_waiting": 0}})
    max_ongoing_requests: int = 8
    is_cross_language: bool = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_every_generate_call_of_one_ingress_request_is_placed():
    """Serve gives the handle calls made while serving one HTTP request that request's internal id, and keeps
    one pending request per id in its index. The ingress makes several such calls at once (a batch's prompts,
    one continuation per sample of a lost n > 1 request: issue #39): each must get a replica. Serve's exact
    matching by id left the second one unplaced, its routing task looping (the router takes the FIFO mixin)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    async def scenario():
        router = make_router(use_replica_queue_len_cache=False)     # each round probes: the loop yields
        replica = RoutableReplica("a")
        router.update_replicas([replica])
        calls = [PendingRequest(args=[f"req:failover1:{i}", [7, 8, 9], None], kwargs={},
                                metadata=RequestMetadata(request_id="req", internal_request_id="one-http-request",
                                                         call_method="generate", is_streaming=True))
                 for i in range(3)]
        placed = asyncio.gather(*(router._choose_replica_for_request(call) for call in calls))
        assert await asyncio.wait_for(placed, 30) == [replica] * 3      # hang guard: unplaced calls wait forever

    asyncio.run(scenario())


def test_the_router_remembers_a_bounded_number_of_sent_blocks():
    async def scenario():
        router = make_router()
        for start in range(0, (PREFIX_SUMMARY_BLOCKS + 10) * BS, 64 * BS):
            router.on_request_routed(generate_call(list(range(start, start + 64 * BS))), "a", None)
        assert len(router._sent["a"]) == PREFIX_SUMMARY_BLOCKS

    asyncio.run(scenario())


class SummaryEngine:
    """Stands in for AsyncEngine in ServedEngine.routing_stats: counts the step-thread reads of the cache."""

    def __init__(self) -> None:
        self.hash_reads: list[int] = []

    async def stats(self):
        from pagedray.cluster.stats import EngineStats

        return EngineStats(num_running=2, num_waiting=1, num_blocks=64, num_free_blocks=40, kv_usage=0.375,
                           prefix_hit_rate=0.5, prefix_query_tokens_total=96, prefix_hit_tokens_total=48,
                           num_preemptions_total=0, num_prompt_tokens_total=96, num_generation_tokens_total=9,
                           num_computed_tokens_total=57, num_steps_total=9, num_requests_finished_total=1)

    async def check_health(self) -> None:
        return None

    async def cached_prefix_hashes(self, limit: int) -> list[int]:
        self.hash_reads.append(limit)
        return [11, 22, 33][:limit]

    def resident_adapters(self) -> list[str]:
        return ["sql"]


def test_a_summary_of_zero_blocks_reads_no_cache_keys_but_still_reports_load():
    """Serve's own router reads no prefix hashes: build_app gives its replicas ``prefix_summary_blocks`` 0,
    and their summaries then skip the walk over the cache (a wait for the step thread)."""
    from pagedray.deploy.serve.served_engine import ServedEngine
    from pagedray.workers.contract.config import EngineConfig

    served = object.__new__(ServedEngine)
    served._engine, served._draining, served._closed = SummaryEngine(), False, False
    served._config = EngineConfig()          # no second tier: no tier summary either
    without = asyncio.run(served.routing_stats("r0", 0))
    assert served._engine.hash_reads == [] and without["prefix_hashes"] == []
    load = (without["replica"], without["stats"]["num_running"], without["stats"]["num_waiting"], without["healthy"])
    assert load == ("r0", 2, 1, True)
    with_hashes = asyncio.run(served.routing_stats("r0", 2))
    assert served._engine.hash_reads == [2] and with_hashes["prefix_hashes"] == [11, 22]
    assert {k: v for k, v in with_hashes.items() if k != "prefix_hashes"} == \
        {k: v for k, v in without.items() if k != "prefix_hashes"}
    assert with_hashes["lora_resident"] == ["sql"]
    assert (with_hashes["tier_hashes"], with_hashes["tier_weight"]) == ([], 0.0)


def test_an_adapter_prompt_hashes_like_the_blocks_its_adapter_caches():
    from pagedray.block_manager import namespace_root
    from pagedray.deploy.routing.router import prompt_hashes
    from pagedray.workers.contract.lora_request import LoRARequest

    sql = LoRARequest("sql", "/adapters/sql")
    manager = BlockManager(BS, 16)
    prompt = list(range(100, 111))
    manager.allocate_slots("a", prompt, len(prompt), root=namespace_root(sql.cache_namespace))
    hashes = prompt_hashes(prompt, BS, sql)
    assert len(hashes) == 2 and set(manager.cached_prefix_hashes(10)) == set(hashes)
    assert not set(hashes) & set(prompt_hashes(prompt, BS, None))          # never the base model's blocks
    assert not set(hashes) & set(prompt_hashes(prompt, BS, LoRARequest("sql", "/adapters/other")))


def test_an_adapter_request_goes_where_its_adapter_is_resident_within_the_imbalance():
    hot = [ReplicaView("x", {11}, 0), ReplicaView("y", set(), 1, adapters={"sql"}), ReplicaView("z", set(), 0)]
    assert choose_by_prefix([11], hot, max_imbalance=2, adapter="sql") == (["y"], 0)   # cold there, but resident
    assert choose_by_prefix([11], hot, max_imbalance=2) == (["x"], 1)                 # no adapter: the prefix
    assert choose_by_prefix([11], hot, max_imbalance=0, adapter="sql") == (["x"], 1)  # y too loaded: as without
    nowhere = [ReplicaView("x", set(), 0), ReplicaView("y", set(), 0)]
    assert choose_by_prefix([11], nowhere, max_imbalance=2, adapter="sql") == (["x", "y"], 0)


def test_the_router_reads_the_call_adapter_and_the_replicas_resident_adapters():
    from pagedray.deploy.routing.router import prompt_hashes
    from pagedray.workers.contract.lora_request import LoRARequest

    async def scenario():
        router = make_router()
        sql = LoRARequest("sql", "/adapters/sql")
        prompt = list(range(300, 312))
        stats = {"stats": {"num_running": 0, "num_waiting": 0}}
        base_holder = FakeReplica("a", {**stats, "prefix_hashes": prompt_hashes(prompt, BS, None)})
        resident = FakeReplica("b", {**stats, "prefix_hashes": [], "lora_resident": ["sql"]})
        call = FakeRequest(["req", prompt, None, [], sql], FakeMetadata("generate"))
        assert await router.choose_replicas([base_holder, resident], call) == [[resident]]
        assert await router.choose_replicas([base_holder, resident], generate_call(prompt)) == [[base_holder]]
        router.on_request_routed(call, "b", None)      # remembered under the adapter's chains
        assert set(router._sent["b"]) == set(prompt_hashes(prompt, BS, sql))

    asyncio.run(scenario())


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def test_exports_go_to_the_holder_never_the_caller_and_imports_to_the_replica_lacking_the_blocks():
    from pagedray.cluster.kv_transfers import KVExport

    async def scenario():
        router = make_router()
        shared = list(range(300, 312))                  # 3 full blocks
        busy = {"stats": {"num_running": 9, "num_waiting": 9}}
        a = FakeReplica(FakeReplicaID("a"), {"stats": {}, "prefix_hashes": []})
        b = FakeReplica(FakeReplicaID("b"), {**busy, "prefix_hashes": prefix_block_hashes(shared, BS)})
        c = FakeReplica(FakeReplicaID("c"), {"stats": {}, "prefix_hashes": prefix_block_hashes(shared[:4], BS)})

        def export_call(caller):
            return FakeRequest([shared, None], FakeMetadata("export_prefix"), {"exclude": caller})
        assert await router.choose_replicas([a, b, c], export_call("a")) == [[b]]     # loaded, but it holds most
        assert await router.choose_replicas([a, b, c], export_call("b")) == [[c]]     # never back to the caller
        nobody = FakeRequest([list(range(900, 912)), None], FakeMetadata("export_prefix"), {"exclude": "a"})
        assert await router.choose_replicas([a, b, c], nobody) == [[b, c]]
        export = KVExport(None, None, shared, [])
        imports = FakeRequest([export], FakeMetadata("import_prefix"))
        assert await router.choose_replicas([a, b, c], imports) == [[a]]

    asyncio.run(scenario())


def test_a_moved_request_goes_to_the_least_loaded_other_replica_whatever_the_caches():
    """Rebalancing (serve/rebalance.py): the continuation of a moved request names the replica it left
    (``exclude``) and brings its blocks (``kv``): prefix holdings do not matter, load does, and never back."""
    async def scenario():
        router = make_router()
        prompt = list(range(400, 412))                  # 3 full blocks, cached on a (the replica it left)
        held = prefix_block_hashes(prompt, BS)
        a = FakeReplica(FakeReplicaID("a"), {"stats": {"num_running": 0}, "prefix_hashes": held})
        b = FakeReplica(FakeReplicaID("b"), {"stats": {"num_running": 1}, "prefix_hashes": held})
        c = FakeReplica(FakeReplicaID("c"), {"stats": {"num_running": 0}, "prefix_hashes": []})

        def call(**kwargs):
            return FakeRequest(["req:moved1", prompt, None], FakeMetadata("generate"), kwargs)
        assert await router.choose_replicas([a, b, c], call()) == [[a]]                      # a plain prompt
        assert await router.choose_replicas([a, b, c], call(exclude="a", kv=object())) == [[c]]
        assert await router.choose_replicas([a, b, c], call(exclude="c", kv=object())) == [[a]]
        assert await router.choose_replicas([a, b, c], call(exclude="a")) == [[b]]   # no blocks: the prefix rules
        assert await router.choose_replicas([a, c], call(exclude="a", kv=object())) == [[c]]
        assert await router.choose_replicas([a, b], call(kv=object())) == [[a]]     # disaggregation: least load

    asyncio.run(scenario())
