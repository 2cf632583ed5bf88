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

Each value is the median of ``--steps`` steps. The two transports alternate over ``--rounds`` rounds
(``benchmarks.rounds``), each run on a fresh engine in one Ray instance; the table shows the median
[min-max] over clean rounds and the per-round ratio actor / compiled.

Usage: ``python -m benchmarks.overhead [--rounds 3] [--steps 20]`` (or ``python benchmarks/overhead.py ...``)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

BATCHES = (1, 16, 64)
TRANSPORTS = ("compiled", "actor")
FIELDS = ("step_ms", "execute_ms", "noop_ms", "engine_ms", "overhead_pct")
METRICS = [Metric(f"{f} b{b}", higher_is_better=False) for b in BATCHES for f in FIELDS]
RATIOS = [Ratio("actor", ("compiled",), tuple(f"{f} b{b}" for b in BATCHES for f in ("step_ms", "noop_ms")))]


def _decode_ready_engine(engine, batch: int) -> None:
    from pagedray.workers.contract.sampling_params import SamplingParams

    for i in range(batch):
        engine.add(f"b{batch}-{i}", [1] + [100 + (i + j) % 500 for j in range(15)],
                           SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()


def _measure(engine, executor, steps: int) -> dict:
    from pagedray.workers.contract.wire import StepPlan

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
    from pagedray.cluster.engine import Engine
    from pagedray.cluster.llm import build_engine_config
    from pagedray.cluster.ray_executor import RayExecutor

    config = build_engine_config(model, tensor_parallel_size=2, dtype="float32", num_blocks=1024,
                                 max_num_seqs=64, max_num_batched_tokens=2048, threads_per_worker=1)
    executor = RayExecutor(config, transport=transport)
    engine = Engine(config, executor=executor)
    rows = []
    try:
        for batch in BATCHES:
            _decode_ready_engine(engine, batch)
            rows.append({"batch": batch, **_measure(engine, executor, steps)})
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
            engine.step()
    finally:
        engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "overhead")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    import tempfile

    import ray

    from benchmarks.offline import save_even_head_model

    def measure(transport: str, _round: int) -> dict:
        rows = run_transport(folder, transport, args.steps)
        return {f"{f} b{row['batch']}": row[f] for row in rows for f in FIELDS}

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with tempfile.TemporaryDirectory(prefix="pagedray-8heads-") as folder:
            save_even_head_model(folder)
            runs = run_rounds(TRANSPORTS, args.rounds, measure, on_run=print_run)
    finally:
        ray.shutdown()
    return finish_rounds("overhead", args.out, runs, METRICS, RATIOS, vars(args))


if __name__ == "__main__":
    main()
