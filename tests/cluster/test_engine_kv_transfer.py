"""Moving a cached prefix from one engine to another (cluster/kv_transfers.py): the importing engine then serves
the prompt from its prefix cache and generates exactly the tokens (and fp32 logprobs) of a cold run, at TP=1, at
TP=2, across TP sizes (heads re-sharded) and with an 8-bit cache; a layout that differs is refused with nothing
changed; an import short of room moves a shorter prefix; no block is leaked or held after a transfer."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.engine_runs import run_alone
from helpers.hf_oracle import hf_greedy
from helpers.thread_tp import ThreadTPExecutor, thread_tp_workers
from helpers.tiny_models import save_tiny_model
from helpers.worker_setup import engine_config
from pagedray.cluster import SamplingParams
from pagedray.cluster.engine import Engine
from pagedray.cluster.kv_transfers import KVExport

BLOCK = 8
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


def _engine(path, monkeypatch=None, tp=1, num_blocks=32, **kwargs) -> Engine:
    """TP=1 in this process; with ``monkeypatch``, ``tp`` thread ranks (TP=1 too: once patched, every rank built
    in the test joins a thread group)."""
    config = engine_config(path, tp=tp, num_blocks=num_blocks, **kwargs)
    if monkeypatch is None:
        return Engine(config)
    workers = thread_tp_workers(monkeypatch, path, tp=tp, num_blocks=num_blocks, **kwargs)
    return Engine(config, executor=ThreadTPExecutor(workers, num_blocks))


def _prompts(seed=3, length=35, extra=6, vocab=500):
    rng = random.Random(seed)
    first = [rng.randrange(2, vocab) for _ in range(length)]
    return first, first + [rng.randrange(2, vocab) for _ in range(extra)]


def _logprob_run(engine: Engine, request_id: str, prompt: list[int]):
    """(tokens, each token's logprob, cached prompt tokens) of one greedy run with logprobs."""
    engine.add(request_id, prompt, WITH_LOGPROBS)
    tokens, logprobs, cached = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            sample = out.outputs[0]
            tokens += sample.token_ids
            logprobs += [entry.logprob for entry in sample.logprobs]
            cached = max(cached, out.num_cached_prompt_tokens)
    return tokens, logprobs, cached


def _move(source: Engine, target: Engine, first: list[int]) -> tuple[KVExport, int]:
    run_alone(source, "source", first, GREEDY)
    export = source.export_prefix(first)
    moved = target.import_prefix(export)
    for engine in (source, target):
        engine.block_manager.check_invariants()
        assert not engine.block_manager._transfer_holds and not engine.transfers.has_work
    return export, moved


def test_a_moved_prefix_is_served_from_the_cache_with_a_cold_runs_tokens_and_logprobs(tiny_llama_path,
                                                                                     tiny_hf_model):
    first, again = _prompts()
    source, target, cold = _engine(tiny_llama_path), _engine(tiny_llama_path), _engine(tiny_llama_path)
    export, moved = _move(source, target, first)
    assert export.num_blocks == 4 and export.token_ids == first[:32] and moved == 32
    free_before = target.block_manager.num_free_blocks
    tokens, logprobs, cached = _logprob_run(target, "again", again)
    assert cached == 32                                         # the import was a prefix hit, not a prefill
    cold_tokens, cold_logprobs, cold_cached = _logprob_run(cold, "cold", again)
    assert cold_cached == 0
    assert tokens == cold_tokens == hf_greedy(tiny_hf_model, again, NEW)
    assert logprobs == pytest.approx(cold_logprobs, abs=1e-6)
    assert target.block_manager.num_free_blocks == free_before   # every block back in the pool
    target.block_manager.check_invariants()


def test_an_export_while_requests_run_keeps_their_outputs(tiny_llama_path, tiny_hf_model):
    first, again = _prompts(seed=4)
    source, target = _engine(tiny_llama_path), _engine(tiny_llama_path)
    run_alone(source, "first", first, GREEDY)
    other = _prompts(seed=9)[0]
    source.add("running", other, GREEDY)
    tokens = source.step()[0].outputs[0].token_ids               # its prefill; its decodes go on during the export
    plans, execute = [], source.executor.execute
    source.executor.execute = lambda plan: plans.append(plan) or execute(plan)
    export = source.export_prefix(first)
    # the export went out in a plan of its own, not behind the running request's step
    assert [(bool(p.kv_exports), bool(p.decodes or p.running or p.new_seqs)) for p in plans] == [(True, False)]
    while source.has_unfinished_requests():
        for out in source.step():
            tokens += out.outputs[0].token_ids
    assert tokens == hf_greedy(tiny_hf_model, other, NEW)
    assert target.import_prefix(export) == 32
    assert run_alone(target, "again", again, GREEDY) == (hf_greedy(tiny_hf_model, again, NEW), 32)


@pytest.mark.parametrize("source_tp,target_tp", [(2, 2), (1, 2), (2, 1)])
def test_tensor_parallel_ranks_move_their_shards_and_resharding_is_exact(
        tiny_llama_path, tiny_hf_model, monkeypatch, source_tp, target_tp):
    first, again = _prompts(seed=5)
    source = _engine(tiny_llama_path, monkeypatch, tp=source_tp)
    target = _engine(tiny_llama_path, monkeypatch, tp=target_tp)
    export, moved = _move(source, target, first)
    assert len(export.shards) == source_tp and moved == 32
    assert run_alone(target, "again", again, GREEDY) == (hf_greedy(tiny_hf_model, again, NEW), 32)


def test_replicated_kv_heads_reshard_exactly(tmp_path, monkeypatch):
    """One KV head and TP=2: both ranks of the target hold the same head, taken from the one source rank."""
    path = save_tiny_model("mistral", tmp_path)         # 4 query heads, 1 KV head
    first, again = _prompts(seed=6, vocab=250)
    cold = _engine(path)
    expected, _ = run_alone(cold, "cold", again, GREEDY)
    source, target = _engine(path, monkeypatch), _engine(path, monkeypatch, tp=2)
    _move(source, target, first)
    assert run_alone(target, "again", again, GREEDY) == (expected, 32)


def test_an_8bit_cache_moves_its_scales(tiny_llama_path, monkeypatch):
    first, again = _prompts(seed=7)
    cold = _engine(tiny_llama_path, kv_cache_dtype="int8")
    expected, _ = run_alone(cold, "cold", again, GREEDY)
    source = _engine(tiny_llama_path, monkeypatch, kv_cache_dtype="int8")
    target = _engine(tiny_llama_path, monkeypatch, tp=2, kv_cache_dtype="int8")
    _move(source, target, first)
    assert run_alone(target, "again", again, GREEDY) == (expected, 32)


@pytest.mark.parametrize("field,value,named", [("block_size", 16, "block_size"),
                                               ("kv_cache_dtype", "int8", "kv_cache_dtype"),
                                               ("dtype", "bfloat16", "dtype"),
                                               ("model", "another-model", "model")])
def test_a_layout_that_differs_is_refused_and_changes_nothing(tiny_llama_path, field, value, named):
    first, _ = _prompts()
    source, target = _engine(tiny_llama_path), _engine(tiny_llama_path)
    run_alone(source, "source", first, GREEDY)
    export = source.export_prefix(first)
    export.layout = dataclasses.replace(export.layout, **{field: value})
    free = target.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=f"layout differs \\({named}"):
        target.import_prefix(export)
    assert target.block_manager.num_free_blocks == free and not target.transfers.has_work
    target.block_manager.check_invariants()


def test_shards_of_the_wrong_size_are_refused(tiny_llama_path):
    first, _ = _prompts()
    source, target = _engine(tiny_llama_path), _engine(tiny_llama_path)
    run_alone(source, "source", first, GREEDY)
    export = source.export_prefix(first)
    export.shards = [export.shards[0][:-1]]
    with pytest.raises(ValueError, match="shards of"):
        target.import_prefix(export)
    with pytest.raises(ValueError, match="export: expected a KVExport"):
        target.import_prefix({"token_ids": first})


def test_an_import_short_of_room_moves_a_shorter_prefix_exactly(tiny_llama_path, tiny_hf_model):
    first, again = _prompts(seed=8, length=60)
    source = _engine(tiny_llama_path)
    target = _engine(tiny_llama_path, num_blocks=12)
    run_alone(source, "source", first, GREEDY)
    export = source.export_prefix(first)
    assert export.num_blocks == 7
    target.add("holder", _prompts(seed=10, length=60, extra=0)[0], SamplingParams(temperature=0, max_tokens=2))
    target.step()                                              # 8 of its 12 blocks held by a running prefill
    moved = target.import_prefix(export)
    assert 0 < moved < 56 and moved % BLOCK == 0
    while target.has_unfinished_requests():
        target.step()
    target.block_manager.check_invariants()
    assert run_alone(target, "again", again, GREEDY)[0] == hf_greedy(tiny_hf_model, again, NEW)


def test_what_is_cached_already_is_not_imported_again_and_nothing_cached_exports_nothing(tiny_llama_path):
    first, _ = _prompts()
    source, target = _engine(tiny_llama_path), _engine(tiny_llama_path)
    assert source.export_prefix(first).num_blocks == 0
    run_alone(source, "source", first, GREEDY)
    run_alone(target, "target", first[:17], GREEDY)               # 2 of the 4 blocks cached here already
    export = source.export_prefix(first)
    free = target.block_manager.num_free_blocks
    assert target.import_prefix(export) == 32
    assert target.block_manager.num_free_blocks == free            # imported blocks are free-and-cached
    assert target.import_prefix(export) == 32                      # a second import finds them all
    target.block_manager.check_invariants()


def test_transfers_are_refused_without_a_prefix_cache(tiny_llama_path):
    engine = _engine(tiny_llama_path, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="export: blocks move between prefix caches"):
        engine.start_export([1, 2, 3])
    with pytest.raises(ValueError, match="token_ids: must be a list of integers"):
        _engine(tiny_llama_path).start_export("not tokens")


@pytest.mark.integration
def test_ray_rank_actors_gather_and_write_their_shards(ray_session, tiny_llama_path, tiny_hf_model):
    """TP=2 over Ray worker actors (gloo's gather) on both sides."""
    from pagedray.cluster import LLM

    first, again = _prompts(seed=11)
    kwargs = dict(dtype="float32", block_size=BLOCK, num_blocks=32, threads_per_worker=1, tensor_parallel_size=2)
    with LLM(tiny_llama_path, **kwargs) as source, LLM(tiny_llama_path, **kwargs) as target:
        assert source.config.parallel.use_ray
        export, moved = _move(source.engine, target.engine, first)
        assert len(export.shards) == 2 and moved == 32
        result = run_alone(target.engine, "again", again, GREEDY)
    assert result == (hf_greedy(tiny_hf_model, again, NEW), 32)
