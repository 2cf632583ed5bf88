"""Streams piled on one replica: rebalancing between live replicas on against off (#65's planned migration;
``deploy/serve/rebalance.py``).

    python -m benchmarks.rebalance [--rounds 3] [--streams 8] [--max-tokens 256]

Each run deploys the real app (``build_app``) on a local Ray instance with 2 engine replicas (TP=1, the model in
each replica's process, 1 torch thread each: one core each on the 2-core machine) and the cache-aware router with
``router_max_imbalance`` 16, so that a replica holding a prompt's prefix takes every request of a burst. The
systems differ only in ``rebalance_threshold``: 0 (off) or 1 (on: the busy replica moves half of its excess, with
the KV blocks, to the idle one). Workload: a random ``--prefix-tokens`` prefix is sent once (not measured; it
lands on one replica), then after 3 s (the summaries reach every router) ``--streams`` concurrent greedy streams
of that prefix + 8 tokens of their own, ``--max-tokens`` tokens each (EOS ignored).

Per run: output tokens/s of the burst (its tokens over the time from the first send to the last token), mean
end-to-end seconds, ITL p50 / p99 (gaps between text chunks, every stream), the moves the ingress counted
(``pagedray:request_moves_total``) and whether every stream's text equals the first run's (greedy: moving a
stream must not change it). Systems alternate over ``--rounds`` rounds (``benchmarks.rounds``); a fresh app per
run.
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

APP_NAME = "rebalance"
ON, OFF = "rebalance on", "rebalance off"
TAIL = 8
METRICS = [Metric("output_tok_s", "output tok/s"),
           Metric("mean_e2e_s", "mean e2e s", higher_is_better=False),
           Metric("itl_p50_ms", "ITL p50 ms", higher_is_better=False),
           Metric("itl_p99_ms", "ITL p99 ms", higher_is_better=False),
           Metric("moves", "moves"),
           Metric("failed", "failed requests", higher_is_better=False)]
RATIOS = [Ratio(ON, (OFF,), ("output_tok_s",), "on / off"),
          Ratio(OFF, (ON,), ("mean_e2e_s", "itl_p50_ms", "itl_p99_ms"), "off / on")]


def prompts(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(the prefix's first prompt, the burst's prompts), random token ids."""
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
    tails = [[rng.randrange(100, 40000) for _ in range(TAIL)] for _ in range(args.streams + 1)]
    return prefix + tails[0], [prefix + tail for tail in tails[1:]]


def moves_total(text: str) -> float:
    line = next((line for line in text.splitlines() if line.startswith("pagedray:request_moves_total")), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


async def send(url: str, first: list[int], burst: list[list[int]], max_tokens: int) -> tuple[list[dict], float, float]:
    """(the burst's results, its wall seconds, the moves counted during it)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=1800, trust_env=False,
                                 limits=httpx.Limits(max_connections=64)) as client:
        await one_request(client, stream_body(first, 1), time.monotonic())
        await asyncio.sleep(3.0)
        before = moves_total((await client.get("/metrics")).text)
        start = time.monotonic()
        results = await asyncio.gather(*(one_request(client, stream_body(p, max_tokens), start) for p in burst))
        seconds = time.monotonic() - start
        return results, seconds, moves_total((await client.get("/metrics")).text) - before


def run(on: bool, args: argparse.Namespace, first, burst, texts: dict) -> dict:
    from pagedray.deploy.serve.app import build_app
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_args = {"model": args.model, "dtype": args.dtype, "num_replicas": 2, "request_router": "cache_aware",
                "router_max_imbalance": 16, "executor": "local", "threads_per_worker": 1,
                "rebalance_threshold": 1 if on else 0,
                "max_model_len": args.prefix_tokens + TAIL + args.max_tokens + 16,
                "warm_prefix_tokens": 0, "max_num_seqs": max(16, args.streams)}
    try:
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        results, seconds, moves = asyncio.run(send(f"http://127.0.0.1:{port}", first, burst, args.max_tokens))
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    done = [r for r in results if r["ok"]]
    gaps = sorted(1000 * (b - a) for r in done for a, b in zip(r["times"], r["times"][1:]))
    outputs = [r["text"] for r in results]
    texts.setdefault("first", outputs)
    return {"failed": len(results) - len(done), "output_tok_s": sum(r["completion_tokens"] for r in done) / seconds,
            "mean_e2e_s": statistics.mean(r["times"][-1] for r in done if r["times"]),
            "itl_p50_ms": gaps[len(gaps) // 2], "itl_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "moves": moves, "texts_equal_first_run": outputs == texts["first"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    add_round_args(p, "rebalance")
    args = p.parse_args(argv)
    import ray

    first, burst = prompts(args)
    texts: dict = {}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        runs = run_rounds([ON, OFF], args.rounds, lambda system, _: run(system == ON, args, first, burst, texts),
                          on_run=print_run)
    finally:
        ray.shutdown()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    equal = all(r.details.get("texts_equal_first_run", True) for r in runs)
    report = finish_rounds("rebalance", args.out, runs, METRICS, RATIOS, config, {"texts_equal": equal})
    print(f"every run's texts equal the first run's: {equal}")
    print_ratio(report, "on / off", "output_tok_s", "output tok/s, rebalance on / off", "none (measured)")
    print_ratio(report, "off / on", "itl_p99_ms", "ITL p99, off / on", "none (measured)")
    return report


if __name__ == "__main__":
    main()
