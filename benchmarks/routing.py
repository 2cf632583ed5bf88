"""Routing between two engine replicas: cache-aware routing vs Serve's default router (power of two).

    python -m benchmarks.routing [--rounds 3] [--workload conversations|independent] [--rate 2.0] [--num-blocks 64,96]

Workload: 8 system prompts (``--system-tokens`` tokens of fixed seed words, default SmolLM2 tokenizer)
x 16 user turns (a short question each) = 128 streaming completions; greedy, ``--max-tokens`` output
tokens. ``--workload``:
- ``conversations`` (default): 8 chats, one per system prompt, of 16 turns each. Turn t's prompt is
  turn t-1's prompt + its answer + the next question, so a chat's whole history is a cached prefix
  where its last turn ran. Chats start as a Poisson process at ``--rate`` per second; a chat's next turn
  follows its answer after an exponential think time (mean ``--think-s``).
- ``independent``: each request is a system prompt + one question (no history), the 128 in a seeded
  random order, arriving as a Poisson process at ``--rate`` requests/s.

Each run deploys the real app (``pagedray.deploy.serve.app.build_app``) on a local Ray instance with 2 engine
replicas (TP=1, Ray worker actor, 1 torch thread each) and ``request_router`` = ``cache_aware`` or
``serve`` (the peer: Serve's default router, at its defaults), sends the workload over HTTP, reads
per request the time to the first token (client side) and ``usage.prompt_tokens_details.cached_tokens``,
then asks the replicas for their stats (``replica_stats``: requests finished per replica). Each replica's
KV cache (``--num-blocks`` blocks of 16) holds about half of what the workload's prefixes need: the case
where routing decides whether a prompt's prefix is still cached where it lands (with a cache that holds
everything on every replica, any router ends up hitting).

``--num-blocks`` takes a comma-separated list to sweep the cache size: each size is then a pair of
systems (``cache_aware/96``, ``serve/96``) and a ratio row of its own, all interleaved in the same rounds.
How much routing gains depends on that size: with room for every prefix on each replica both routers
hit, and with room for less than each replica's share of the prefixes neither does; the sweep shows
the whole range rather than one chosen point.

Systems alternate over ``--rounds`` rounds (``benchmarks.rounds``); a fresh app per run. Goals (issue
16): cache-aware >= 2x the prefix-hit tokens and >= 1.5x lower mean TTFT than the default router, with
no replica serving more than 70% of the requests. ``benchmarks.routing_ceiling`` replays the same workloads
without a model to show how that hit-token ratio depends on the cache size for any router.
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

from benchmarks.common import add_round_args, finish_rounds, make_prompts, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

CACHE_AWARE, DEFAULT = "cache_aware", "serve"
APP_NAME = "pagedray-routing"
NUM_SYSTEMS, TURNS = 8, 16
# KV blocks per replica: about half of what the workload's prefixes need at the end (conversations: 8 chats
# of ~46 blocks; independent: 8 system prompts of 16 blocks), plus room for the requests running
DEFAULT_BLOCKS = {"conversations": 192, "independent": 96}
METRICS = [Metric("mean_ttft_s", "mean TTFT s", higher_is_better=False),
           Metric("p50_ttft_s", "p50 TTFT s", higher_is_better=False),
           Metric("p99_ttft_s", "p99 TTFT s", higher_is_better=False),
           Metric("cached_tokens", "prefix-hit tokens"),
           Metric("hit_rate", "prefix-hit rate"),
           Metric("busiest_replica_share", "busiest replica's share", higher_is_better=False),
           Metric("failed", "failed requests", higher_is_better=False)]
HIT_RATIO, TTFT_RATIO = "prefix-hit tokens (cache-aware / default)", "TTFT speedup (default / cache-aware)"


def system_name(router: str, blocks: int, sweep: bool) -> str:
    """A system of the rounds: the router, and with a sweep of cache sizes also the size (``serve/96``)."""
    return f"{router}/{blocks}" if sweep else router


def ratios(sizes: list[int]) -> list[Ratio]:
    """Per cache size: prefix-hit tokens cache-aware / default, and TTFT default / cache-aware."""
    sweep, out = len(sizes) > 1, []
    for blocks in sizes:
        aware, default = system_name(CACHE_AWARE, blocks, sweep), system_name(DEFAULT, blocks, sweep)
        suffix = f", {blocks} blocks" if sweep else ""
        out += [Ratio(aware, (default,), ("cached_tokens",), HIT_RATIO + suffix),
                Ratio(default, (aware,), ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s"), TTFT_RATIO + suffix)]
    return out


def block_sizes(text: str) -> list[int]:
    """argparse type of ``--num-blocks``: one count or a comma-separated list, each >= 1, no repeats."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"need distinct block counts >= 1, got {text!r}")
    return sizes


def workload(tokenizer, system_tokens: int, seed: int) -> list[list[int]]:
    """NUM_SYSTEMS x TURNS token-id prompts (system prompt + question), in a seeded random order."""
    texts = make_prompts(NUM_SYSTEMS, 2 * system_tokens, 2 * system_tokens, seed)
    systems = [tokenizer(text).input_ids[:system_tokens] for text in texts]
    questions = make_prompts(NUM_SYSTEMS * TURNS, 8, 16, seed + 7)
    prompts = [systems[i % NUM_SYSTEMS] + tokenizer(" Question: " + q).input_ids for i, q in enumerate(questions)]
    random.Random(seed).shuffle(prompts)
    return prompts


def conversations(tokenizer, system_tokens: int, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(the NUM_SYSTEMS system prompts, per chat its TURNS questions), as token ids."""
    texts = make_prompts(NUM_SYSTEMS, 2 * system_tokens, 2 * system_tokens, seed)
    systems = [tokenizer(text).input_ids[:system_tokens] for text in texts]
    questions = make_prompts(NUM_SYSTEMS * TURNS, 8, 16, seed + 7)
    asks = [[tokenizer(" Question: " + q + " Answer:").input_ids for q in questions[c * TURNS:(c + 1) * TURNS]]
            for c in range(NUM_SYSTEMS)]
    return systems, asks


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps with mean 1 / rate, first at 0."""
    rng, at, offsets = random.Random(seed + 1), 0.0, []
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


def stream_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_request(client, body: dict, start_at: float) -> dict:
    """Send ``body`` at ``start_at`` (monotonic); TTFT, cached prompt tokens, the generated text, the arrival of
    each chunk with text (seconds after the send) and the completion tokens counted in its usage."""
    import json

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    sent, first, cached, text, times, completion = time.monotonic(), None, None, [], [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    first = first or time.monotonic()
                    text.append(event["choices"][0]["text"])
                    if text[-1]:
                        times.append(time.monotonic() - sent)
                if event.get("usage"):
                    cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                    completion = event["usage"]["completion_tokens"]
    except Exception:  # noqa: BLE001 - a failed request is counted, not raised
        return {"ok": False}
    return {"ok": first is not None and cached is not None, "ttft_s": (first or sent) - sent, "cached": cached or 0,
            "prompt_tokens": len(body["prompt"]), "text": "".join(text), "times": times,
            "completion_tokens": completion or 0}


async def send_independent(client, prompts: list[list[int]], offsets: list[float], max_tokens: int) -> list[dict]:
    start = time.monotonic() + 0.5
    return await asyncio.gather(*(one_request(client, stream_body(p, max_tokens), start + o)
                                  for p, o in zip(prompts, offsets)))


async def send_conversations(client, tokenizer, systems, asks, starts: list[float], think_s: float,
                             max_tokens: int, seed: int) -> list[dict]:
    async def chat(c: int, start_at: float) -> list[dict]:
        rng, history, results = random.Random(seed + 100 + c), list(systems[c]), []
        for question in asks[c]:
            prompt = history + question
            result = await one_request(client, stream_body(prompt, max_tokens), start_at)
            results.append(result)
            history = prompt + tokenizer(result["text"], add_special_tokens=False).input_ids
            start_at = time.monotonic() + rng.expovariate(1.0 / think_s)
        return results

    start = time.monotonic() + 0.5
    chats = await asyncio.gather(*(chat(c, start + o) for c, o in enumerate(starts)))
    return [r for results in chats for r in results]


def replica_finished_counts(handle, replicas: int, attempts: int = 64) -> dict[str, int]:
    """Requests finished per engine replica: ``replica_stats`` calls until every replica answered once
    (each call reaches the replica the router picks; ``attempts`` bounds the tries)."""
    seen: dict[str, int] = {}
    for _ in range(attempts):
        replica, stats = handle.replica_stats.remote().result()
        seen[replica] = stats.num_requests_finished_total
        if len(seen) == replicas:
            break
    return seen


async def send_workload(url: str, args: argparse.Namespace, tokenizer) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=NUM_SYSTEMS * TURNS)) as client:
        if args.workload == "independent":
            prompts = workload(tokenizer, args.system_tokens, args.seed)
            offsets = arrival_offsets(len(prompts), args.rate, args.seed)
            return await send_independent(client, prompts, offsets, args.max_tokens)
        systems, asks = conversations(tokenizer, args.system_tokens, args.seed)
        starts = arrival_offsets(NUM_SYSTEMS, args.rate, args.seed)
        return await send_conversations(client, tokenizer, systems, asks, starts, args.think_s, args.max_tokens,
                                        args.seed)


def run(router: str, num_blocks: int, args: argparse.Namespace, tokenizer) -> dict:
    from pagedray.deploy.serve.app import build_app
    from pagedray.deploy.serve.engine_deployment import ENGINE_DEPLOYMENT_NAME
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # longest prompt + output: a whole chat (conversations) or one question (independent), with room to spare
    turns = TURNS if args.workload == "conversations" else 1
    app_args = {"model": args.model, "dtype": "float32", "num_replicas": 2, "request_router": router,
                "num_blocks": num_blocks, "max_model_len": args.system_tokens + turns * 32 + 64,
                "max_num_seqs": 16, "threads_per_worker": 1}
    try:
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        results = asyncio.run(send_workload(f"http://127.0.0.1:{port}", args, tokenizer))
        counts = replica_finished_counts(serve.get_deployment_handle(ENGINE_DEPLOYMENT_NAME, APP_NAME), 2)
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    done = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft_s"] for r in done)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    cached = sum(r["cached"] for r in done)
    finished = sum(counts.values())
    return {"requests": len(results), "failed": len(results) - len(done),
            "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts),
            "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "cached_tokens": cached, "hit_rate": cached / prompt_tokens,
            "replicas_seen": len(counts),
            "busiest_replica_share": max(counts.values()) / finished if len(counts) == 2 and finished else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--workload", choices=("conversations", "independent"), default="conversations")
    p.add_argument("--rate", type=float, default=2.0,
                   help="Poisson arrival rate per second: of chats (conversations), of requests (independent)")
    p.add_argument("--think-s", type=float, default=0.5, help="conversations: mean pause between a chat's turns")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=block_sizes, default=None,
                   help="KV blocks per replica (16 tokens each), or a comma-separated list to sweep; "
                        "default 192 for conversations, 96 for independent")
    p.add_argument("--seed", type=int, default=0)
    add_round_args(p, "routing")
    args = p.parse_args(argv)
    if args.num_blocks is None:
        args.num_blocks = [DEFAULT_BLOCKS[args.workload]]
    sizes, sweep = args.num_blocks, len(args.num_blocks) > 1
    systems = {system_name(router, blocks, sweep): (router, blocks) for blocks in sizes
               for router in (CACHE_AWARE, DEFAULT)}

    import ray
    from pagedray.workers.weights.default_model import ensure_default_model
    from transformers import AutoTokenizer

    if args.model == "default":
        args.model = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # 2 replicas x (engine + TP worker) bundles: logical CPUs, the machine has what it has
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        runs = run_rounds(list(systems), args.rounds, lambda system, _: run(*systems[system], args, tokenizer),
                          on_run=print_run)
    finally:
        ray.shutdown()
    config = {k: v for k, v in vars(args).items() if k not in ("out", "rounds")}
    rows = ratios(sizes)
    report = finish_rounds("routing", args.out, runs, METRICS, rows,
                           {**config, "num_systems": NUM_SYSTEMS, "turns": TURNS, "rounds": args.rounds})
    for hits, ttft in zip(rows[::2], rows[1::2]):
        print_ratio(report, hits.name, "cached_tokens", hits.name, ">= 2x")
        print_ratio(report, ttft.name, "mean_ttft_s", ttft.name + ", mean", ">= 1.5x")
    return report


if __name__ == "__main__":
    main()
