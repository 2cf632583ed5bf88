"""Fair share through the Engine, paced by the FakeExecutor (time is counted in steps, never read off a clock):
a light tenant's time to first token next to a tenant flooding long prompts, against its solo run and FIFO;
the tenant gauges of ``stats()``; ``kv_block_seconds`` on the outputs.
"""

import pytest
from helpers.fake_executor import FakeExecutor
from pagedray.cluster.engine import Engine
from pagedray.cluster.fair_share import TenantQuotaError
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TenantConfig
from pagedray.workers.contract.sampling_params import SamplingParams

NUM_BLOCKS = 96
LIGHT_EVERY = 6          # steps between the light tenant's requests
LIGHT_REQUESTS = 24
FLOOD_QUEUE = 12         # the flood keeps this many long prompts waiting


def _engine(path, tenants):
    config = EngineConfig(model=ModelConfig(model=path),
                          cache=CacheConfig(block_size=8, num_blocks=NUM_BLOCKS, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, tenants=tenants))
    return Engine(config, executor=FakeExecutor(NUM_BLOCKS))


def _light_ttft_steps(engine, flood: bool, named: bool) -> list[int]:
    """Steps from each light request's arrival to its first token."""
    added, first, flood_ids, step = {}, {}, set(), 0
    light_tenant, flood_tenant = ("light", "flood") if named else (None, None)
    while len(first) < LIGHT_REQUESTS:
        if step % LIGHT_EVERY == 0 and len(added) < LIGHT_REQUESTS:
            rid = f"light-{len(added)}"
            engine.add(rid, [5 + len(added)] * 12, SamplingParams(max_tokens=8, temperature=0), tenant=light_tenant)
            added[rid] = step
        waiting_flood = sum(1 for s in engine.scheduler.waiting if s.request.request_id in flood_ids)
        for _ in range(FLOOD_QUEUE - waiting_flood if flood else 0):
            rid = f"flood-{len(flood_ids)}"
            engine.add(rid, [100 + len(flood_ids) % 300] * 200, SamplingParams(max_tokens=24, temperature=0),
                       tenant=flood_tenant)
            flood_ids.add(rid)
        for out in engine.step():
            if out.request_id in added and out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = step
        step += 1
        assert step < 5000, "the light requests did not all start"
    return sorted(first[r] - added[r] for r in added)


def _p99(values):
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def test_light_tenant_ttft_p99_stays_within_2x_of_solo_next_to_a_flood(tiny_llama_path):
    tenants = (TenantConfig("flood"), TenantConfig("light"))
    solo = _p99(_light_ttft_steps(_engine(tiny_llama_path, tenants), flood=False, named=True))
    fair = _p99(_light_ttft_steps(_engine(tiny_llama_path, tenants), flood=True, named=True))
    fifo = _p99(_light_ttft_steps(_engine(tiny_llama_path, ()), flood=True, named=False))
    assert fair <= 2 * max(solo, 1), (solo, fair, fifo)
    assert fifo > 2 * max(solo, 1), (solo, fair, fifo)      # what fair share is for


def test_stats_list_each_tenant_and_outputs_carry_kv_block_seconds(tiny_llama_path):
    engine = _engine(tiny_llama_path, (TenantConfig("a", max_queued_requests=1), TenantConfig("b")))
    engine.add("x", list(range(10, 30)), SamplingParams(max_tokens=4, temperature=0), tenant="a")
    with pytest.raises(TenantQuotaError, match="tenant 'a'"):
        engine.add("y", list(range(10, 30)), SamplingParams(max_tokens=4, temperature=0), tenant="a")
    with pytest.raises(ValueError, match="tenant: 'c' is not a configured tenant"):
        engine.add("z", [1, 2], SamplingParams(max_tokens=4), tenant="c")
    assert {t[0]: t[1:] for t in engine.stats().tenants} == {"a": (0, 1, 0), "b": (0, 0, 0), "default": (0, 0, 0)}
    engine.step()
    assert {t[0]: t[1:] for t in engine.stats().tenants}["a"] == (3, 0, 1)     # 20 tokens + 1: 3 blocks of 8
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.finished and last.kv_block_seconds > 0
    assert {t[0]: t[1:] for t in engine.stats().tenants}["a"] == (0, 0, 0)
