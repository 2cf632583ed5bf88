"""TP rank death on Ray (tiny Llama, TP=2): SIGKILL of rank 1's process mid-decode makes the engine
rebuild its TP group and re-admit the running sequences by recompute; every request then finishes with
exactly the tokens of an undisturbed in-process run (greedy and seeded sampling). The old actors and
placement group are gone, and no KV block or worker mirror is left once idle. The recovery time
(kill -> first token after the rebuild) is logged. (``ray.kill`` with recovery off:
test_ray_executor.py; both kill modes with timings: ``python -m benchmarks.recovery``.)"""

import logging
import os
import signal

import pytest
from pagedray.cluster import LLM

from benchmarks.recovery import ENGINE_KWARGS, run_with_kill, undisturbed_tokens

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

logger = logging.getLogger(__name__)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("draft", [False, pytest.param(True, marks=pytest.mark.slow)])   # slow: -m slow
def test_tp2_rank_sigkilled_mid_decode_is_rebuilt_and_outputs_match_undisturbed_run(ray_session, tiny_llama_path,
                                                                                     draft):
    """``draft``: the model drafts for itself on the ranks (speculative_model): the rebuilt ranks load the
    draft model again and recompute its cache with the target's."""
    ray = ray_session
    expected = undisturbed_tokens(tiny_llama_path)
    speculation = dict(num_speculative_tokens=3, speculative_model=tiny_llama_path) if draft else {}
    llm = LLM(tiny_llama_path, tensor_parallel_size=2, step_timeout_s=30.0, **ENGINE_KWARGS,   # float32 in there
              **speculation)
    engine, executor = llm.engine, llm.engine.executor
    old_actors, old_group = list(executor.actors), executor.placement.placement_group
    pid = executor.rank_pids[1]
    try:
        tokens, recovery_s = run_with_kill(engine, lambda: os.kill(pid, signal.SIGKILL), kill_after_tokens=5)
        logger.warning("rank-1 SIGKILL -> first token after rebuild: %.2f s (rebuild %.2f s)", recovery_s,
                       engine.last_recovery_s)
        assert tokens == expected
        assert engine.stats().num_rank_restarts_total == 1 and executor.num_rebuilds == 1
        # the old group is gone: both old actors are dead, the old placement group removed
        for actor in old_actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.num_sequences.remote(), timeout=30)
        assert ray.util.placement_group_table(old_group)["state"] == "REMOVED"
        new_group = executor.placement.placement_group
        assert new_group.id != old_group.id and ray.util.placement_group_table(new_group)["state"] == "CREATED"
        # nothing leaked: every block free, every mirror released, the new group healthy
        bm = engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and bm.sequence_ids() == []
        assert executor.num_sequences() == [0, 0]
        engine.check_health()
        if draft:
            assert engine.stats().spec_decode_num_accepted_tokens_total > 0
    finally:
        llm.shutdown()
    assert ray.util.placement_group_table(new_group)["state"] == "REMOVED"
