"""RayExecutor: TP=2 Ray worker actors give the same greedy tokens as the in-process LocalExecutor
(and HF), on one node (session Ray, compiled-graph transport) and across two simulated nodes
(own Ray cluster in a subprocess, SPREAD placement, actor-call transport). Also, with recovery off
(max_rank_restarts=0): a killed rank is reported dead and fails the in-flight requests with "error"
within 10 s; shutdown removes the placement group. (Recovery itself: test_rank_recovery.py.)"""

import json
import pathlib
import subprocess
import sys
import time

import pytest
from helpers.hf_oracle import hf_greedy
from pagedray.cluster import LLM, SamplingParams
from pagedray.cluster.engine import ENGINE_DEAD_MESSAGE
from pagedray.cluster.outputs import EngineDeadError

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

PROMPTS = [[5, 17, 300, 42, 8, 99, 100, 3], [250, 251, 252], list(range(40, 75))]
MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)


@pytest.fixture(scope="module")
def local_tokens(tiny_llama_path):
    llm = LLM(tiny_llama_path, dtype="float32", block_size=8, num_blocks=128)
    try:
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def local_prompt_logprobs(tiny_llama_path):
    with LLM(tiny_llama_path, dtype="float32", block_size=8, num_blocks=128) as llm:
        return llm.generate([PROMPTS[2]], PROMPT_LOGPROBS, use_tqdm=False)[0].prompt_logprobs


def assert_same_prompt_logprobs(got, expected) -> None:
    """TP=2 sums partial products in another order: equal up to rounding."""
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for a, b in zip(got[1:], expected[1:]):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def _first_health_failure(executor, hang_guard_s=120.0) -> str:
    deadline = time.monotonic() + hang_guard_s
    while True:
        try:
            executor.check_health()
        except EngineDeadError as exc:
            return str(exc)
        assert time.monotonic() < deadline, "the killed rank was never reported dead"
        time.sleep(0.1)


def test_tp2_on_ray_matches_local_and_hf_then_detects_a_dead_rank(ray_session, tiny_llama_path, tiny_hf_model,
                                                                   local_tokens, local_prompt_logprobs, caplog):
    ray = ray_session
    llm = LLM(tiny_llama_path, dtype="float32", tensor_parallel_size=2, block_size=8, num_blocks=128,
              step_timeout_s=30.0, max_rank_restarts=0, ray_transport="compiled")
    executor = llm.engine.executor
    group = executor.placement.placement_group
    try:
        assert type(executor).__name__ == "RayExecutor" and executor.transport == "compiled"
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert tokens == local_tokens
        assert tokens == [hf_greedy(tiny_hf_model, p, MAX_TOKENS, {1}) for p in PROMPTS]
        # prompt logprobs: the vocab-parallel LM head over prompt slices, gathered to rank 0, over the wire
        result, = llm.generate([PROMPTS[2]], PROMPT_LOGPROBS, use_tqdm=False)
        assert_same_prompt_logprobs(result.prompt_logprobs, local_prompt_logprobs)
        assert executor.num_sequences() == [0, 0]          # every mirror released once idle
        llm.engine.add("doomed", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
        llm.engine.step()
        ray.kill(executor.actors[1])
        assert "rank 1" in _first_health_failure(executor)   # a busy rank's ping may time out first
        with caplog.at_level("ERROR", logger="pagedray.cluster.engine"):
            outputs = llm.engine.step()
        assert [o.outputs[-1].finish_reason for o in outputs] == ["error"] and outputs[0].finished
        assert outputs[0].error == ENGINE_DEAD_MESSAGE and "max_rank_restarts=0" in caplog.text
        with pytest.raises(EngineDeadError):
            llm.engine.check_health()
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


@pytest.mark.slow   # the extended tier (README: -m slow): CI keeps TP=2 on one node
@pytest.mark.timeout(400)
def test_tp2_across_two_simulated_nodes_with_spread_matches_local_and_moves_blocks_to_a_third(tiny_llama_path,
                                                                                               local_tokens):
    script = pathlib.Path(__file__).with_name("two_node_check.py")
    proc = subprocess.run([sys.executable, str(script), tiny_llama_path, json.dumps(PROMPTS), str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == local_tokens
    assert len(set(result["nodes"])) == 2                 # SPREAD put the two ranks on different nodes
    assert result["leaks"] == [0, 0]
    moved = result["moved"]                               # the last prompt's blocks, to a TP=1 rank on a third node
    assert moved["shards"] == 2 and moved["moved"] == moved["cached"] == 32 and moved["node"] not in result["nodes"]
    assert moved["tokens"] == local_tokens[-1]


def test_health_does_not_ping_ranks_during_a_step():
    """An actor runs one call at a time, so a ping sent during a step would wait for it (and /health
    said 503 under normal load): while execute() is in flight, check_health leaves the ranks alone.
    White-box: the executor's state is set directly, its ranks are stand-ins that fail when pinged."""
    from pagedray.cluster.ray_executor import RayExecutor

    class NotToBePinged:
        class ping:
            @staticmethod
            def remote():
                raise AssertionError("a rank was pinged during a step")

    executor = RayExecutor.__new__(RayExecutor)
    executor._closed, executor._rebuilding, executor.tp_size = False, False, 2
    executor.actors, executor._steps_in_flight = [NotToBePinged(), NotToBePinged()], 1
    executor._serving = []                       # actor transport: no step channel loops
    executor.check_health()                      # returns at once: no ping
    executor._steps_in_flight = 0
    with pytest.raises(AssertionError, match="pinged"):
        executor.check_health()                  # between steps the ranks are pinged


@pytest.mark.parametrize("transport", ["actor", "compiled", "socket", "auto"])
def test_async_scheduling_over_ray_tp1_matches_local(ray_session, tiny_llama_path, local_tokens, transport):
    """async_scheduling on the Ray executor: step N+1 is sent to the rank's actor while step N runs
    there (actor calls and compiled-graph executions run in order); the tokens are the local ones."""
    llm = LLM(tiny_llama_path, dtype="float32", block_size=8, num_blocks=128, executor="ray", async_scheduling=True,
              ray_transport=transport)
    try:
        results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert llm.engine.executor._steps_in_flight == 0
        # auto: the rank runs on this (the engine's) node, so its plans go over the step channel
        assert llm.engine.executor.transport == ("socket" if transport == "auto" else transport)
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in results] == local_tokens


def test_socket_transport_tp2_matches_local_reports_worker_errors_and_recovers_a_killed_rank(
        ray_session, tiny_llama_path, local_tokens):
    """ray_transport="socket" (workers/step_channel.py): TP=2 gives the local tokens; a plan the worker
    refuses comes back as StepWorkerError (worker code, not a rank failure) and the channel stays in step;
    a rank killed mid-decode is a rank failure: the group is rebuilt (new actors, new channels) and the
    requests finish with the undisturbed tokens, nothing leaked; health sees a killed idle rank."""
    from pagedray.cluster.ray_executor import StepWorkerError
    from pagedray.workers.contract.wire import RunningDelta, StepPlan

    from benchmarks.recovery import run_with_kill, undisturbed_tokens

    ray = ray_session
    llm = LLM(tiny_llama_path, dtype="float32", tensor_parallel_size=2, block_size=8, num_blocks=96,
              step_timeout_s=60.0, ray_transport="socket")
    engine, executor = llm.engine, llm.engine.executor
    try:
        assert executor.transport == "socket" and len(executor._channels) == 2
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert tokens == local_tokens and executor.num_sequences() == [0, 0]
        expected = undisturbed_tokens(tiny_llama_path)   # benchmarks/recovery.py's requests, in-process
        recovered, _ = run_with_kill(engine, lambda: ray.kill(executor.actors[1]), kill_after_tokens=5)
        assert recovered == expected and executor.num_rebuilds == 1
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and executor.num_sequences() == [0, 0]
        engine.check_health()
    finally:
        llm.shutdown()
    tp1 = LLM(tiny_llama_path, dtype="float32", block_size=8, num_blocks=96, executor="ray", ray_transport="socket")
    try:
        bad = StepPlan(step_id=1, running=[RunningDelta(seq_id=424242, num_scheduled_tokens=1, new_token_id=5)])
        with pytest.raises(StepWorkerError, match="TP rank 0: .*424242"):
            tp1.engine.executor.execute(bad)
        assert not tp1.engine.executor.is_rank_failure(StepWorkerError("x"))
        tokens = [r.outputs[0].token_ids for r in tp1.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert tokens == local_tokens                         # the channel is still in step after the error
        tp1.engine.executor.check_health()                    # the rank's serving call is still running
        ray.kill(tp1.engine.executor.actors[0])
        assert "rank 0" in _first_health_failure(tp1.engine.executor)
    finally:
        tp1.shutdown()


def test_ranks_that_resolve_dtype_auto_differently_are_refused(ray_session):
    """dtype auto is resolved on each rank's machine (dtype_choice.py); ranks on CPUs that differ (one
    with AVX512-BF16, one without) would run different dtypes, so the executor refuses them before any
    KV cache exists, naming the option. White-box: the ranks are stand-ins answering with ObjectRefs."""
    from pagedray.cluster.llm import build_engine_config
    from pagedray.cluster.ray_executor import RayExecutor

    def rank(dtype: str):
        class Rank:
            class dtype_name:
                @staticmethod
                def remote():
                    return ray_session.put(dtype)

            class available_kv_blocks:
                @staticmethod
                def remote():
                    raise AssertionError("KV blocks asked for after the dtype check failed")
        return Rank()

    executor = RayExecutor.__new__(RayExecutor)
    executor.config, executor.tp_size = build_engine_config("default"), 1
    executor.actors = [rank("bfloat16"), rank("float32")]
    with pytest.raises(ValueError, match=r"dtype: the ranks resolved 'auto' differently \(\['bfloat16', 'float32'\]"):
        executor._init_workers()
    executor.actors = [rank("bfloat16"), rank("bfloat16")]
    with pytest.raises(AssertionError, match="KV blocks asked for"):
        executor._init_workers()
    assert executor.dtype == "bfloat16"
