"""The second KV tier in the engine: a prompt whose cached prefix was evicted by other traffic finds it in the
tier, has it loaded back before it runs, and generates transformers' tokens; corrupt tier files are a miss
(computed again, the same tokens); with TP=2 each rank saves and loads its own shard."""

from __future__ import annotations

import pytest
from helpers.hf_oracle import hf_greedy
from helpers.thread_tp import ThreadTPExecutor, thread_tp_workers
from helpers.tier_runs import NEW, evict_then_return
from helpers.worker_setup import engine_config
from pagedray.cluster import LLM
from pagedray.cluster.engine import Engine

BLOCK = 8
TIER = {"kv_offload_gib": 0.002}     # ~2 MB a rank: hundreds of the tiny model's blocks


def _llm(path, **kwargs) -> LLM:
    return LLM(path, dtype="float32", block_size=BLOCK, num_blocks=16, watermark=0.0, threads_per_worker=1,
               **TIER, **kwargs)


def test_an_evicted_prefix_comes_back_from_the_tier_exactly(tiny_llama_path, tiny_hf_model):
    with _llm(tiny_llama_path) as llm:
        again, tokens, cached = evict_then_return(llm.engine)
        stats = llm.engine.block_manager.stats()
    assert cached == 32 and stats.num_tier_loaded == 4 and stats.num_tier_load_failures == 0
    assert tokens == hf_greedy(tiny_hf_model, again, NEW)
    cost = llm.engine.tier_cost        # measured for the router: both sides were seen
    assert cost.load_s_per_block > 0 and cost.compute_s_per_token > 0 and 0.0 <= cost.weight <= 1.0


def test_corrupt_tier_files_are_a_miss_never_a_wrong_token(tiny_llama_path, tiny_hf_model, tmp_path):
    def corrupt():
        for file in (tmp_path / "rank0").glob("*.kv"):
            data = bytearray(file.read_bytes())
            data[len(data) // 2] ^= 0x55
            file.write_bytes(bytes(data))

    with _llm(tiny_llama_path, kv_offload_path=str(tmp_path)) as llm:
        again, tokens, cached = evict_then_return(llm.engine, corrupt)
        stats = llm.engine.block_manager.stats()
    assert cached == 0 and stats.num_tier_load_failures == 4 and stats.num_tier_loaded == 0
    assert tokens == hf_greedy(tiny_hf_model, again, NEW)


def test_tensor_parallel_ranks_each_move_their_shard(tiny_llama_path, tiny_hf_model, monkeypatch, tmp_path):
    workers = thread_tp_workers(monkeypatch, tiny_llama_path, tp=2, num_blocks=16, kv_offload_path=str(tmp_path),
                                **TIER)
    engine = Engine(engine_config(tiny_llama_path, tp=2, num_blocks=16, kv_offload_path=str(tmp_path), **TIER),
                    executor=ThreadTPExecutor(workers, 16))
    again, tokens, cached = evict_then_return(engine)
    assert cached == 32 and engine.block_manager.stats().num_tier_loaded == 4
    assert {f.name for f in (tmp_path / "rank0").glob("*.kv")} == {f.name for f in (tmp_path / "rank1").glob("*.kv")}
    assert tokens == hf_greedy(tiny_hf_model, again, NEW)


def test_the_tier_is_refused_with_a_draft_model(tiny_llama_path):
    with pytest.raises(ValueError, match="kv_offload_gib: not with speculative_model"):
        _llm(tiny_llama_path, num_speculative_tokens=2, speculative_model=tiny_llama_path)


@pytest.mark.integration
def test_tensor_parallel_rank_actors_over_ray_use_the_tier(ray_session, tiny_llama_path, tiny_hf_model):
    with _llm(tiny_llama_path, tensor_parallel_size=2) as llm:
        assert llm.config.parallel.use_ray and llm.engine.executor.num_tier_slots > 0
        again, tokens, cached = evict_then_return(llm.engine)
        assert cached == 32 and llm.engine.block_manager.stats().num_tier_loaded == 4
    assert tokens == hf_greedy(tiny_hf_model, again, NEW)
