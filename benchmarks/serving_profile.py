"""Where a serving run's CPU time goes: CPU seconds per process during the serving benchmark's load.

    python -m benchmarks.serving_profile [--system pagedray-tp1] [--num-requests 32] [--concurrency 16]

Starts one server as ``benchmarks.serving`` does (same command, same private Ray), warms it up, reads
the CPU time (user + system) of every process in the server's tree and of this process (the load
generator) right before and right after the closed-loop load, and prints the difference grouped by
role: TP worker, engine replica, ingress, Serve proxy, Serve controller, other Ray processes, load
generator; with the run's output tokens per second, how much of the machine's CPU time the run
used, and the engine's model steps during the load (``pagedray:engine_steps`` and
``pagedray:computed_tokens`` from /metrics: tokens per step and wall ms per step). A profile, not a
comparison: it says which process to make cheaper, not how fast pagedray is.
JSON to ``--out`` (default ``benchmarks/results/serving_profile.json``).

What it showed (2-core AMD EPYC VM, 2026-11-25, SmolLM2 bf16, 32 requests at concurrency 16, single
runs, so +-5%): pagedray-tp1 445-454 tok/s, 131 steps at 34.5-35.3 wall ms each; the TP worker 86-87%
of the machine's CPU, the ingress (engine + HTTP) 5%, the load generator 3%, Ray's own processes 2%.
The same requests through the in-process ``LLM`` (no prefix hits) ran 617 tok/s. A temporary trace
inside the worker put the difference in three places: decode steps 22.7 ms median against 20.4 ms
offline (the front end's CPU bursts preempt one of the worker's two OpenMP threads, and the other
waits at the next barrier), 4.2 ms median between steps (the Ray actor round trip; ``.remote()``
alone was ~20% of the ingress's samples in py-spy), and prefill steps 0.86 s against ~0.5 s.
Variants, single runs: ``-t1`` 362-366 tok/s (the worker then runs 30 ms decode steps on one core);
``-async`` 479 (gaps 1.1 ms, decode steps 24.0 ms); ``--ray-transport compiled`` 351 (the ingress
spins at 43% of the machine waiting for results); ``-sock`` (``--ray-transport socket``) 480, the
ingress down to 3.8% (32.7 wall ms per step); the same with the rank's loop on a thread of its own
instead of the actor's main thread: 433 (oneDNN's GEMMs ran 1.5x slower there);
``OMP_WAIT_POLICY=PASSIVE`` 380, ``ACTIVE`` 421; the ingress at nice 5 / 10: 479 / 442 (no clear
change).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import time
import urllib.request

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import psutil
from pagedray.deploy.loadtest import LoadtestConfig, run_loadtest
from pagedray.deploy.loadtest.client import RequestOptions
from pagedray.deploy.loadtest.prompts import parse_length_range, synthetic_prompts
from pagedray.deploy.loadtest.runner import LoadSpec

from benchmarks.common import write_json
from benchmarks.serving import RunningServer, system_specs, warm_up_prompts

# (substring of the process command line, role); the first match wins
ROLES = (("RayWorker", "TP worker"), ("PagedEngine", "engine replica"), ("OpenAIIngress", "ingress"),
         ("ProxyActor", "Serve proxy"), ("ServeController", "Serve controller"))
LOAD_GENERATOR = "load generator (this process)"


def role_of(cmdline: str) -> str:
    return next((role for key, role in ROLES if key in cmdline), "other (Ray, server CLI)")


def cpu_times(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) for the server's process tree and this process."""
    found = {os.getpid(): (LOAD_GENERATOR, sum(psutil.Process().cpu_times()[:2]))}
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            found[proc.pid] = (role_of(" ".join(proc.cmdline())), sum(proc.cpu_times()[:2]))
        except psutil.Error:
            pass   # a process that ended between the listing and the read
    return found


def by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between the snapshots, summed per role (a process new in ``after`` counts whole)."""
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent = seconds - before.get(pid, (role, 0.0))[1]
        totals[role] = totals.get(role, 0.0) + max(spent, 0.0)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step and computed-token counters, summed over replicas, from the server's /metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    totals = {"steps": 0.0, "computed_tokens": 0.0}
    for line in text.splitlines():
        for key, series in (("steps", "pagedray:engine_steps_total"),
                            ("computed_tokens", "pagedray:computed_tokens_total")):
            if line.startswith(series + "{") or line.startswith(series + " "):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.serving_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", default="pagedray-tp1", help="pagedray-tpN[-local][-ei][-siK]")
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", default="8:120", help="prompt words, MIN:MAX")
    p.add_argument("--output-len", default="64", help="max_tokens, N or MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18550)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default="benchmarks/results/serving_profile.json")
    p.add_argument("--log", default="benchmarks/results/serving_profile_server.log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.system.startswith("pagedray-"):
        raise SystemExit("--system: only pagedray systems are profiled (pagedray-tpN, pagedray-tp1-local)")
    from pagedray.workers.weights.default_model import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    spec = system_specs([args.system], model_path, args.port, args)[0]
    prompts = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                                parse_length_range(args.output_len, "output_len"), args.seed)
    pathlib.Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    with RunningServer(spec, args.port, pathlib.Path(args.log)) as server:
        server.wait_healthy(args.startup_timeout)
        options = RequestOptions(model=server.model_name(), temperature=0.0, timeout_s=1800.0)

        def run(load: LoadSpec, sent=prompts):
            config = LoadtestConfig(options=options, prompts=sent, loads=[load], url=server.url,
                                    metrics_url="", progress=False)
            return asyncio.run(run_loadtest(config))

        # warm-up, not profiled: prompts outside the load, so that none of the load's sits in the prefix cache
        run(LoadSpec(num_requests=2, concurrency=2), warm_up_prompts(args))
        counters_before = engine_counters(server.url)
        before, started = cpu_times(server.proc.pid), time.monotonic()
        report = run(LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, seed=args.seed))
        wall, after = time.monotonic() - started, cpu_times(server.proc.pid)
        counters = {key: value - counters_before[key] for key, value in engine_counters(server.url).items()}
    roles = by_role(before, after)
    available = wall * (os.cpu_count() or 1)
    summary = report.summaries[0]
    print(f"{args.system}: {summary['output_tok_per_s']:.1f} output tok/s, {wall:.1f} s wall, "
          f"{sum(roles.values()):.1f} of {available:.1f} CPU-s used")
    for role, seconds in roles.items():
        print(f"  {seconds:8.2f} CPU-s  {100 * seconds / available:5.1f}% of the machine  {role}")
    steps = counters["steps"]
    if steps:
        print(f"  engine: {steps:.0f} steps, {counters['computed_tokens'] / steps:.1f} tokens per step, "
              f"{1000 * wall / steps:.1f} wall ms per step")
    write_json("serving_profile", {"system": args.system, "command": spec.command, "args": vars(args),
                                   "wall_s": wall, "cpu_s_by_role": roles, "engine": counters, "load": summary},
               args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
