"""Prefill/decode disaggregation against mixed replicas: long prompts arriving while other requests decode
(issue #65; ``deploy/serve/disaggregation.py``).

    python -m benchmarks.disaggregation [--rounds 3] [--decoders 8] [--long-prompts 6] [--long-tokens 1536]

Two systems on the same 2 engine replicas' worth of machine (the real app, the model in each replica's process,
1 torch thread each, the default model at the default dtype): ``1P1D`` (``prefill_replicas`` 1, one decode
replica) and ``2 mixed`` (two ordinary replicas, the cache-aware router). Workload, over HTTP, streaming:
``--decoders`` requests with short prompts (32 tokens) and ``--decode-tokens`` tokens out start 0.1 s apart;
from 1 s on, ``--long-prompts`` prompts of ``--long-tokens`` tokens (8 out) arrive one every ``--gap-s``.
Per run: the decoding requests' inter-token latency (the gap between a stream's chunks after its first), p50 and
p99; the long prompts' TTFT, mean and p99; output tokens per second over the run. Systems alternate over
``--rounds`` rounds (``benchmarks.rounds``); a fresh app per run. Goal (#65): ITL p99 >= 2x lower than the mixed
replicas at equal throughput within 10%.
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

APP_NAME = "disaggregation"
SPLIT, MIXED = "1P1D", "2 mixed"
METRICS = [Metric("itl_p99_s", "ITL p99 s", higher_is_better=False),
           Metric("itl_p50_s", "ITL p50 s", higher_is_better=False),
           Metric("long_ttft_mean_s", "long prompt TTFT mean s", higher_is_better=False),
           Metric("long_ttft_p99_s", "long prompt TTFT p99 s", higher_is_better=False),
           Metric("output_tok_s", "output tok/s"),
           Metric("failed", "failed requests", higher_is_better=False)]
RATIOS = [Ratio(MIXED, (SPLIT,), ("itl_p99_s", "itl_p50_s", "long_ttft_p99_s"), "2 mixed / 1P1D"),
          Ratio(SPLIT, (MIXED,), ("output_tok_s",), "1P1D / 2 mixed")]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(client, prompt: list[int], max_tokens: int, start_at: float) -> dict:
    """One streaming completion sent at ``start_at`` (``routing.one_request``): ok only with every token."""
    result = await one_request(client, stream_body(prompt, max_tokens), start_at)
    return {**result, "ok": result["ok"] and bool(result["times"]) and result["completion_tokens"] == max_tokens}


async def workload(url: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], float]:
    import httpx

    rng = random.Random(args.seed)
    short = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(args.decoders)]
    long = [[rng.randrange(100, 40000) for _ in range(args.long_tokens)] for _ in range(args.long_prompts)]
    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False,
                                 limits=httpx.Limits(max_connections=64)) as client:
        start = time.monotonic() + 0.5
        decoders = [stream(client, p, args.decode_tokens, start + 0.1 * i) for i, p in enumerate(short)]
        longs = [stream(client, p, 8, start + 1.0 + args.gap_s * i) for i, p in enumerate(long)]
        results = await asyncio.gather(*decoders, *longs)
        wall = time.monotonic() - start
    return list(results[:args.decoders]), list(results[args.decoders:]), wall


def run(system: str, args: argparse.Namespace) -> dict:
    from pagedray.deploy.serve.app import build_app
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    layout = {"prefill_replicas": 1, "decode_replicas": 1} if system == SPLIT else {"num_replicas": 2}
    app_args = {"model": args.model, "dtype": args.dtype, "executor": "local", "threads_per_worker": 1,
                "max_model_len": args.long_tokens + 64, "warm_prefix_tokens": 0, **layout}
    try:
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        decoders, longs, wall = asyncio.run(workload(f"http://127.0.0.1:{port}", args))
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    done = [r for r in decoders + longs if r["ok"]]
    gaps = [b - a for r in decoders if r["ok"] for a, b in zip(r["times"], r["times"][1:])]
    ttfts = [r["times"][0] for r in longs if r["ok"]]
    return {"failed": len(decoders) + len(longs) - len(done),
            "itl_p99_s": percentile(gaps, 0.99), "itl_p50_s": percentile(gaps, 0.5),
            "long_ttft_mean_s": statistics.mean(ttfts), "long_ttft_p99_s": percentile(ttfts, 0.99),
            "output_tok_s": sum(r["completion_tokens"] for r in done) / wall, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--gap-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_round_args(p, "disaggregation")
    args = p.parse_args(argv)
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        runs = run_rounds([SPLIT, MIXED], args.rounds, lambda system, _: run(system, args), on_run=print_run)
    finally:
        ray.shutdown()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = finish_rounds("disaggregation", args.out, runs, METRICS, RATIOS, config)
    print_ratio(report, RATIOS[0].name, "itl_p99_s", "ITL p99, 2 mixed / 1P1D", ">= 2x")
    print_ratio(report, RATIOS[1].name, "output_tok_s", "output tok/s, 1P1D / 2 mixed", ">= 0.9x")
    return report


if __name__ == "__main__":
    main()
