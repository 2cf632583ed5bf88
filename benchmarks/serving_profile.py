"""Where a serving run's CPU time goes: CPU seconds per process during the serving benchmark's load.

    python -m benchmarks.serving_profile [--system pagedray-tp1] [--num-requests 32] [--concurrency 16]

Starts one server as ``benchmarks.serving`` does (same command, same private Ray), warms it up, reads
the CPU time (user + system) of every process in the server's tree and of this process (the load
generator) right before and right after the closed-loop load, and prints the difference grouped by
role: TP worker, engine replica, ingress, Serve proxy, Serve controller, other Ray processes, load
generator; with the run's output tokens per second and how much of the machine's CPU time the run
used. A profile, not a comparison: it says which process to make cheaper, not how fast pagedray is.
JSON to ``--out`` (default ``bench_results/serving_profile.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import psutil
from pagedray.deploy.loadtest import LoadtestConfig, run_loadtest
from pagedray.deploy.loadtest.client import RequestOptions
from pagedray.deploy.loadtest.prompts import parse_length_range, synthetic_prompts
from pagedray.deploy.loadtest.runner import LoadSpec

from benchmarks.common import write_json
from benchmarks.serving import RunningServer, system_specs

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
    p.add_argument("--out", default="bench_results/serving_profile.json")
    p.add_argument("--log", default="bench_results/serving_profile_server.log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.system.startswith("pagedray-"):
        raise SystemExit("--system: only pagedray systems are profiled (pagedray-tpN, pagedray-tp1-local)")
    from pagedray.workers.default_model import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    spec = system_specs([args.system], model_path, args.port, args)[0]
    prompts = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                                parse_length_range(args.output_len, "output_len"), args.seed)
    pathlib.Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    with RunningServer(spec, args.port, pathlib.Path(args.log)) as server:
        server.wait_healthy(args.startup_timeout)
        options = RequestOptions(model=server.model_name(), temperature=0.0, timeout_s=1800.0)

        def run(load: LoadSpec):
            config = LoadtestConfig(options=options, prompts=prompts, loads=[load], url=server.url,
                                    metrics_url="", progress=False)
            return asyncio.run(run_loadtest(config))

        run(LoadSpec(num_requests=2, concurrency=2))   # warm-up, not profiled
        before, started = cpu_times(server.proc.pid), time.monotonic()
        report = run(LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, seed=args.seed))
        wall, after = time.monotonic() - started, cpu_times(server.proc.pid)
    roles = by_role(before, after)
    available = wall * (os.cpu_count() or 1)
    summary = report.summaries[0]
    print(f"{args.system}: {summary['output_tok_per_s']:.1f} output tok/s, {wall:.1f} s wall, "
          f"{sum(roles.values()):.1f} of {available:.1f} CPU-s used")
    for role, seconds in roles.items():
        print(f"  {seconds:8.2f} CPU-s  {100 * seconds / available:5.1f}% of the machine  {role}")
    write_json("serving_profile", {"system": args.system, "command": spec.command, "args": vars(args),
                                   "wall_s": wall, "cpu_s_by_role": roles, "load": summary}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
