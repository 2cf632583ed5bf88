"""Engine over the FakeExecutor test double: streamed deltas, n > 1, abort, failure, stats, leaks.

The double samples (last token + 1) % 512, so every expected token sequence is known exactly.
"""

import pytest
from helpers.fake_executor import FakeExecutor
from helpers.tiny_models import TINY_LLAMA_EOS as TINY_EOS
from pagedray.cluster.engine import ENGINE_DEAD_MESSAGE, Engine
from pagedray.cluster.outputs import EngineDeadError
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams


def _engine(path, num_blocks=64, budget=32, fail_at_step=None, **model_kwargs):
    config = EngineConfig(model=ModelConfig(model=path, **model_kwargs),
                          cache=CacheConfig(block_size=8, num_blocks=num_blocks, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    executor = FakeExecutor(num_blocks, fail_at_step=fail_at_step)
    return Engine(config, executor=executor), executor


def _collect(engine, max_steps=200):
    streams = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return streams
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def _tokens(outputs, index=0):
    return [t for o in outputs for c in o.outputs if c.index == index for t in c.token_ids]


def test_deltas_stream_every_token_once_and_finish_last(tiny_llama_path):
    engine, fake = _engine(tiny_llama_path)
    engine.add("a", [10, 11, 12], SamplingParams(max_tokens=5, temperature=0))
    engine.add("b", list(range(100, 140)), SamplingParams(max_tokens=3, temperature=0))
    streams = _collect(engine)
    assert _tokens(streams["a"]) == [13, 14, 15, 16, 17]
    assert _tokens(streams["b"]) == [140, 141, 142]
    for outs in streams.values():
        assert outs[0].prompt_token_ids is not None and all(o.prompt_token_ids is None for o in outs[1:])
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[-1].finish_reason == "length"
    # b's 40-token prompt was chunked: 29 tokens after a's 3 in step 0, the remaining 11 in step 1
    assert [n.num_scheduled_tokens for n in fake.plans[0].new_seqs] == [3, 29]
    assert fake.mirror == {}  # the release-only plan emptied the mirror once idle
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == 64


def test_eos_stops_and_n_samples_get_their_own_index(tiny_llama_path):
    engine, _ = _engine(tiny_llama_path)
    engine.add("eos", [5, TINY_EOS - 1], SamplingParams(max_tokens=9, temperature=0))
    engine.add("n3", [20, 21, 22, 23], SamplingParams(n=3, max_tokens=2, temperature=0))
    streams = _collect(engine)
    assert _tokens(streams["eos"]) == [TINY_EOS]
    assert streams["eos"][-1].outputs[0].finish_reason == "stop"
    assert [_tokens(streams["n3"], i) for i in range(3)] == [[24, 25]] * 3
    final = [c for o in streams["n3"] for c in o.outputs if c.finish_reason]
    assert sorted(c.index for c in final) == [0, 1, 2]


def test_no_stop_rule_ends_a_sequence_before_min_tokens(tiny_llama_path):
    # the double samples prompt[-1] + 1, + 2, ...: EOS first, then the stop id, each at once or after min_tokens
    engine, _ = _engine(tiny_llama_path)
    engine.add("eos0", [5, TINY_EOS - 1], SamplingParams(max_tokens=4, temperature=0))
    engine.add("eos2", [5, TINY_EOS - 1], SamplingParams(max_tokens=4, temperature=0, min_tokens=2))
    engine.add("stop1", [10, 11], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(13,),
                                                         min_tokens=1))
    engine.add("stop2", [10, 11], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(13,),
                                                         min_tokens=2))
    streams = _collect(engine)
    assert _tokens(streams["eos0"]) == [TINY_EOS]
    assert _tokens(streams["eos2"]) == [TINY_EOS + i for i in range(4)]   # EOS at position 0 < 2: no stop
    assert streams["eos2"][-1].outputs[0].finish_reason == "length"
    assert _tokens(streams["stop1"]) == [12, 13]                          # 13 is the 2nd token: > 1 out
    assert streams["stop1"][-1].outputs[0].finish_reason == "stop"
    assert _tokens(streams["stop2"]) == [12, 13, 14, 15, 16]              # 13 is within the first 2
    assert engine.block_manager.num_free_blocks == 64


def test_abort_returns_a_final_abort_output_and_frees_blocks(tiny_llama_path):
    engine, fake = _engine(tiny_llama_path)
    engine.add("a", list(range(30)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    assert engine.abort("a") is True and engine.abort("a") is False
    assert engine.block_manager.num_free_blocks == 64
    (final,) = engine.step()
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert fake.mirror == {} and not engine.has_unfinished_requests()


def test_executor_failure_ends_requests_with_error_and_kills_the_engine(tiny_llama_path, caplog):
    engine, _ = _engine(tiny_llama_path, fail_at_step=2)
    engine.add("a", [3, 4], SamplingParams(max_tokens=20, temperature=0))
    engine.add("b", [7, 8], SamplingParams(max_tokens=20, temperature=0))
    with caplog.at_level("ERROR", logger="pagedray.cluster.engine"):
        streams = _collect(engine)
    for rid in ("a", "b"):
        last = streams[rid][-1]
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert last.error == ENGINE_DEAD_MESSAGE   # the failure itself goes to the log, never to a caller
    assert "simulated rank failure" in caplog.text
    assert engine.block_manager.num_free_blocks == 64
    with pytest.raises(EngineDeadError) as dead:
        engine.add("c", [1, 2], SamplingParams())
    assert str(dead.value) == ENGINE_DEAD_MESSAGE
    with pytest.raises(EngineDeadError, match="^engine dead"):
        engine.check_health()


def test_admission_checks_vocab_and_clamped_max_model_len(tiny_llama_path):
    engine, _ = _engine(tiny_llama_path, num_blocks=4)   # 4 blocks x 8 = 32 slots < 512 positions
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="the prompt has 32 tokens"):
        engine.add("a", list(range(32)), SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_token_ids: token 512 is not an id in \[0, 512\)"):
        engine.add("a", [1, 512], SamplingParams())
    with pytest.raises(ValueError, match=r"logit_bias: token 600 is not an id in \[0, 512\)"):
        engine.add("a", [1, 2], SamplingParams(logit_bias=((3, 1.0), (600, 2.0))))
    assert not engine.has_unfinished_requests()


def test_stats_count_tokens_preemptions_and_usage(tiny_llama_path):
    engine, _ = _engine(tiny_llama_path, num_blocks=6, budget=64)  # 48 slots for 3 x 24 tokens
    for i in range(3):
        engine.add(f"r{i}", list(range(50 * i, 50 * i + 8)), SamplingParams(max_tokens=16, temperature=0))
    first = engine.step()
    mid = engine.stats()
    assert (mid.num_running, mid.num_waiting, mid.num_prompt_tokens_total) == (3, 0, 24)
    assert mid.kv_usage == pytest.approx(3 / 6)
    streams = _collect(engine)
    for out in first:
        streams[out.request_id].insert(0, out)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_generation_tokens_total >= 48
    assert stats.num_requests_finished_total == 3 and stats.kv_usage == 0.0
    assert all(len(_tokens(s)) == 16 for s in streams.values())


def test_a_seed_near_int64_max_with_n_samples_forks_without_failing_the_step(tiny_llama_path):
    """seed + i for sample i wraps into int64: INT64_MAX with n = 3 used to raise ValueError inside the
    scheduler's fork, out of the engine's step (an AsyncEngine's step loop, and so the engine, died)."""
    from pagedray.cluster.request import sibling_seed

    engine, _ = _engine(tiny_llama_path)
    engine.add("a", [3, 4], SamplingParams(n=3, seed=2**63 - 1, temperature=1.0, max_tokens=4))
    final = _collect(engine)["a"][-1]
    assert final.finished and sorted(c.finish_reason for c in final.outputs) == ["length"] * 3
    assert not engine.is_dead and engine.block_manager.num_free_blocks == 64
    assert [sibling_seed(2**63 - 1, i) for i in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]


def test_add_validates_once_and_a_refused_request_changes_nothing(tiny_llama_path, monkeypatch):
    from pagedray.cluster import engine as engine_module

    calls = []
    original = engine_module.check_arguments
    monkeypatch.setattr(engine_module, "check_arguments", lambda *a, **k: (calls.append(a), original(*a, **k)))
    engine, _ = _engine(tiny_llama_path)
    engine.add("a", [10, 11, 12], SamplingParams(max_tokens=2, temperature=0))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="request_id: 'a' is already in flight"):
        engine.add("a", [10], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add("c", [-1], SamplingParams(max_tokens=2))
    assert engine.scheduler.num_waiting == 1 and _tokens(_collect(engine)["a"]) == [13, 14]
