"""Hot prefixes arriving at busy replicas: pulling the cached prefix from a peer replica against computing it again
(issue #65's ``benchmarks.cluster_cache``; ``deploy/serve/kv_pull.py``).

    python -m benchmarks.cluster_cache [--rounds 3] [--prefix-tokens 4096] [--prefixes 4] [--burst 8]

Each run deploys the real app (``build_app``) on a local Ray instance with 2 engine replicas (TP=1, the model in
each replica's process, 1 torch thread each), the cache-aware router with ``router_max_imbalance`` 2 (a replica
holding a prompt's prefix takes it until it has 2 requests more than the other), and ``kv_peer_pull`` on or off
(the two systems; everything else equal). Workload: ``--prefixes`` random prefixes of ``--prefix-tokens`` tokens.
First each is sent once, one after another (not measured): the router spreads them over the replicas. After 3 s
(the replicas' summaries reach every router), each prefix in turn gets a burst of ``--burst`` concurrent
streaming requests (the prefix + 8 tokens of its own, 8 tokens out): the holder fills up and the router sends
the rest to the other replica, which pulls the prefix (on) or computes it (off).

Per run: mean and p99 TTFT of the burst requests (client side), the prompt tokens they computed (prompt tokens
less ``cached_tokens``), and the pulls the replicas made. Systems alternate over ``--rounds`` rounds
(``benchmarks.rounds``); a fresh app per run. Goal (#65): >= 2x lower mean TTFT at long prefixes on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds
from benchmarks.routing import one_request, stream_body

APP_NAME = "cluster-cache"
ON, OFF = "pull on", "pull off"
TAIL, MAX_TOKENS = 8, 8
METRICS = [Metric("mean_ttft_s", "mean TTFT s", higher_is_better=False),
           Metric("p99_ttft_s", "p99 TTFT s", higher_is_better=False),
           Metric("computed_prompt_tokens", "prompt tokens computed", higher_is_better=False),
           Metric("pulls", "pulls"),
           Metric("failed", "failed requests", higher_is_better=False)]
RATIOS = [Ratio(OFF, (ON,), ("mean_ttft_s", "p99_ttft_s", "computed_prompt_tokens"), "pull off / pull on")]


def prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(one first prompt per prefix, a burst of prompts per prefix), all of random token ids."""
    rng = random.Random(args.seed)
    firsts, bursts = [], []
    for _ in range(args.prefixes):
        prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
        tails = [[rng.randrange(100, 40000) for _ in range(TAIL)] for _ in range(args.burst + 1)]
        firsts.append(prefix + tails[0])
        bursts.append([prefix + tail for tail in tails[1:]])
    return firsts, bursts


async def send(url: str, firsts, bursts) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False,
                                 limits=httpx.Limits(max_connections=64)) as client:
        for prompt in firsts:
            await one_request(client, stream_body(prompt, MAX_TOKENS), time.monotonic())
        await asyncio.sleep(3.0)
        results = []
        for burst in bursts:
            now = time.monotonic()
            results += await asyncio.gather(*(one_request(client, stream_body(p, MAX_TOKENS), now) for p in burst))
        return results


def pull_reports(handle, attempts: int = 64) -> dict[str, dict | None]:
    """Each engine replica's ``peer_pull_report`` (calls until both answered; ``attempts`` bounds the tries)."""
    seen: dict[str, dict | None] = {}
    for _ in range(attempts):
        replica, report = handle.peer_pull_report.remote().result()
        seen[replica] = report
        if len(seen) == 2:
            break
    return seen


def run(pull: bool, args: argparse.Namespace, firsts, bursts) -> dict:
    from pagedray.deploy.serve.app import build_app
    from pagedray.deploy.serve.engine_deployment import ENGINE_DEPLOYMENT_NAME
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_args = {"model": args.model, "dtype": args.dtype, "num_replicas": 2, "request_router": "cache_aware",
                "router_max_imbalance": 2, "executor": "local", "threads_per_worker": 1, "kv_peer_pull": pull,
                "max_model_len": args.prefix_tokens + TAIL + MAX_TOKENS + 16, "warm_prefix_tokens": 0}
    try:
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        results = asyncio.run(send(f"http://127.0.0.1:{port}", firsts, bursts))
        reports = pull_reports(serve.get_deployment_handle(ENGINE_DEPLOYMENT_NAME, APP_NAME))
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    done = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft_s"] for r in done)
    return {"requests": len(results), "failed": len(results) - len(done),
            "mean_ttft_s": statistics.mean(ttfts), "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "computed_prompt_tokens": sum(r["prompt_tokens"] - r["cached"] for r in done),
            "pulls": sum((report or {}).get("pulls", 0) for report in reports.values()),
            "pulled_blocks": sum((report or {}).get("pulled_blocks", 0) for report in reports.values()),
            "pull_seconds_per_block": [(report or {}).get("seconds_per_block") for report in reports.values()]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_round_args(p, "cluster_cache")
    args = p.parse_args(argv)
    import ray

    firsts, bursts = prompts(args)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        runs = run_rounds([ON, OFF], args.rounds, lambda system, _: run(system == ON, args, firsts, bursts),
                          on_run=print_run)
    finally:
        ray.shutdown()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = finish_rounds("cluster_cache", args.out, runs, METRICS, RATIOS, config)
    print_ratio(report, RATIOS[0].name, "mean_ttft_s", "mean TTFT, pull off / on", ">= 2x")
    return report


if __name__ == "__main__":
    main()
