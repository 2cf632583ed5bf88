"""Engine actor death in the Serve deployment shape (without Serve itself): an actor hosting a TP=2
engine is placed, like a Serve replica with ``placement_group_bundles``, in bundle 0 of a 3-bundle
placement group, so the RayExecutor puts its ranks in bundles 1..2 and creates no group of its own.
The host is killed while a request is in flight: the caller's request fails cleanly (RayActorError,
not a hang) within 10 s, both TP worker actors die with their owner, and no placement group other
than the replica's is left (removing that one is the replica owner's job: Serve's, here the test's).

Known Ray behaviour (2.60, measured): a placement group created INSIDE an actor outlives that actor's
death (it belongs to the job), so a standalone engine actor outside a placement group would leave its
TP group's placement group behind; the Serve deployment does not hit this."""

import time

import pytest

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)


def _answers(ray, actor) -> bool:
    try:
        ray.get(actor.num_sequences.remote(), timeout=5)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:   # busy or dying: ask again
        return True


def _live_groups(ray) -> set[str]:
    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


@pytest.mark.slow      # ~50 s on the shared 2-core machine (an engine host actor + TP=2 ranks)
@pytest.mark.timeout(240)
def test_killed_engine_actor_fails_its_request_and_leaves_no_worker_or_group(ray_session, tiny_llama_path):
    ray = ray_session
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    class EngineHost:                      # defined here so that Ray ships it by value
        def __init__(self, path):
            from pagedray.cluster import LLM

            self.llm = LLM(path, dtype="float32",
                           tensor_parallel_size=2, block_size=8, num_blocks=64, step_timeout_s=30.0)

        def group(self):
            executor = self.llm.engine.executor
            return executor.actors, executor.placement.created

        def generate_long(self):
            from pagedray.cluster import SamplingParams

            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            return self.llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)

    replica_group = ray.util.placement_group([{"CPU": 1}] * 3)
    ray.get(replica_group.ready(), timeout=60)
    groups_before = _live_groups(ray)
    host = EngineHost.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        replica_group, placement_group_bundle_index=0)).remote(tiny_llama_path)
    try:
        workers, created_own_group = ray.get(host.group.remote(), timeout=120)
        assert created_own_group is False and _live_groups(ray) == groups_before
        in_flight = host.generate_long.remote()
        time.sleep(1.0)
        ray.kill(host)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(in_flight, timeout=120)     # hang guard: the call ends with the actor, not at its end
        deadline = time.monotonic() + 120       # hang guard
        alive = list(workers)
        while alive and time.monotonic() < deadline:   # the owner's death takes its actors down
            alive = [w for w in alive if _answers(ray, w)]
            time.sleep(0.2)
        assert alive == [], f"{len(alive)} TP worker actors outlived the engine actor"
        assert _live_groups(ray) == groups_before
    finally:
        ray.util.remove_placement_group(replica_group)
