"""Benchmark 2: per-step orchestration overhead of the Ray TP executor vs the step's compute.

For each transport (compiled graph, plain actor calls) and batch size (1, 16, 64 decoding sequences),
TP=2 (1 torch thread per rank) on a random-weight model of SmolLM2-135M's shape with 8 query / 4 KV
heads (SmolLM2's 9 heads do not split over 2 ranks), fp32 CPU:

- ``step_ms``: one full ``Engine.step`` (schedule + plan + Ray round trip + forward + update);
- ``execute_ms``: the ``executor.execute`` part of it;
- ``noop_ms``: the round trip of a plan with no sequences (encode, send to both ranks, decode the
  reply; no forward): the pure orchestration cost the transport adds to every step;
- ``engine_ms``: step_ms - execute_ms (scheduler, plan building, output building on the engine);
- ``overhead_pct`` = noop_ms / step_ms. Goal: <= 5% at batch 64.

Usage: ``python -m pagedray.cluster.bench_overhead [--steps 20]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from .bench_common import print_table, write_json

BATCHES = (1, 16, 64)


def _decode_ready_engine(engine, batch: int) -> None:
    from .sampling_params import SamplingParams

    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [1] + [100 + (i + j) % 500 for j in range(15)],
                           SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()


def _measure(engine, executor, steps: int) -> dict:
    from .wire import StepPlan

    execute_times = []
    original = executor.execute

    def timed(plan):
        start = time.perf_counter()
        try:
            return original(plan)
        finally:
            execute_times.append(time.perf_counter() - start)

    executor.execute = timed
    step_times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
    finally:
        executor.execute = original
    noop = []
    for i in range(steps):
        start = time.perf_counter()
        original(StepPlan(step_id=10_000_000 + i))
        noop.append(time.perf_counter() - start)
    step_ms = statistics.median(step_times) * 1e3
    execute_ms = statistics.median(execute_times) * 1e3
    noop_ms = statistics.median(noop) * 1e3
    return {"step_ms": step_ms, "execute_ms": execute_ms, "noop_ms": noop_ms,
            "engine_ms": step_ms - execute_ms, "overhead_pct": 100 * noop_ms / step_ms}


def run_transport(model: str, transport: str, steps: int) -> list[dict]:
    from .engine import Engine
    from .llm import build_engine_config
    from .ray_executor import RayExecutor

    config = build_engine_config(model, tensor_parallel_size=2, dtype="float32", num_blocks=1024,
                                 max_num_seqs=64, max_num_batched_tokens=2048, threads_per_worker=1)
    executor = RayExecutor(config, transport=transport)
    engine = Engine(config, executor=executor)
    rows = []
    try:
        for batch in BATCHES:
            _decode_ready_engine(engine, batch)
            rows.append({"transport": transport, "batch": batch, **_measure(engine, executor, steps)})
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
            engine.step()
    finally:
        engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    import tempfile

    import ray

    from .bench_offline import save_even_head_model

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="pagedray-8heads-") as folder:
            save_even_head_model(folder)
            for transport in ("compiled", "actor"):
                rows += run_transport(folder, transport, args.steps)
                print(rows[-3:], flush=True)
    finally:
        ray.shutdown()
    print_table(rows, ["transport", "batch", "step_ms", "execute_ms", "noop_ms", "engine_ms", "overhead_pct"])
    write_json("overhead", {"steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
