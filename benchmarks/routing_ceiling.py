"""How many prefix-hit tokens any router can win on the routing benchmark's workload: a model-free replay.

    python -m benchmarks.routing_ceiling [--workload independent|conversations] [--seeds 10] [--num-blocks 24,32,...]

``benchmarks.routing`` measures cache-aware routing against Serve's default router on a live app, where
the prefix-hit goal of issue 16 (>= 2x the default router's hit tokens) was met at none of 8 cache sizes.
This script asks whether a router could meet it at all. It replays the same workload shape (8 system
prompts x 16 questions, or 8 chats of 16 turns; ``--system-tokens`` 256, questions of
``--question-tokens`` 10..20, ``--max-tokens`` 8 answer tokens) on two real ``BlockManager`` s (the
engine's own prefix cache and eviction order), with no model and no clock, and counts the prompt tokens
each request finds cached under three routers:

- ``random``: each request to a uniformly random replica. Serve's default router compares two replicas'
  queue lengths; with two replicas and no queueing (below) that is a coin toss.
- ``cache_aware``: pagedray's choice (``deploy.routing.choose_by_prefix``), given each replica's cache
  summary fresh at every request (the live router sees it once a second) and the router's own record of
  the prompts it sent (``remember_sent``).
- ``partition``: an oracle that knows the workload: system prompt / chat ``i`` always to replica
  ``i % 2``, 4 prefixes each. No router that keeps the two replicas evenly loaded can place prefixes
  better on a uniform workload.

Requests run one at a time (each finishes, and its blocks are freed, before the next arrives), so no
running request pins blocks: every router gets its best case. Token ids are random (seeded), so only
the workload's structure repeats, as in the live benchmark. Each ``--seeds`` seed is a new workload and
order; the table shows per cache size the routers' hit rates and the hit-token ratios to ``random``,
median [min-max] over seeds. Nothing is timed, so the load average does not matter.

Why the ratio stays near or below 2 (LRU on a uniform stream): a replica that holds ``C`` of the ``N``
prefixes it is sent hits about ``C / N`` of them. ``random`` sends each replica all 8 prefixes, a
partition 4 each, so the ratio is ``min(1, C/4) / (C/8)``: 2 while ``C <= 4``, falling towards 1 as
``C`` grows. The answer and question blocks that also pass through the cache lower ``C`` for both.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pagedray.block_manager import BlockManager, prefix_block_hashes
from pagedray.deploy.routing.router import (
    PREFIX_SUMMARY_BLOCKS,
    HeldBlocks,
    ReplicaView,
    choose_by_prefix,
    remember_sent,
)
from pagedray.deploy.serve.options import DEFAULT_MAX_IMBALANCE

from benchmarks.common import print_table, write_json
from benchmarks.rounds import Stat, fmt_stat, stat
from benchmarks.routing import NUM_SYSTEMS, TURNS, block_sizes

ROUTERS = ("random", "cache_aware", "partition")
VOCAB = 49152       # SmolLM2's vocabulary: token ids are drawn from it
BLOCK_SIZE = 16
DEFAULT_SIZES = {"independent": [24, 32, 48, 64, 72, 96, 128, 160],
                 "conversations": [48, 64, 96, 128, 192, 256, 320, 400]}


@dataclass(frozen=True)
class Request:
    source: int              # system prompt / chat index, 0..NUM_SYSTEMS-1
    prompt: list[int]
    answer: list[int]        # the tokens it generates (all but the last get K/V slots)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def independent_requests(seed: int, system_tokens: int, question_tokens: tuple[int, int],
                         max_tokens: int) -> list[Request]:
    """NUM_SYSTEMS x TURNS requests (system prompt + one question) in a seeded random order."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_tokens) for _ in range(NUM_SYSTEMS)]
    requests = [Request(i % NUM_SYSTEMS, systems[i % NUM_SYSTEMS] + random_tokens(rng, rng.randint(*question_tokens)),
                        random_tokens(rng, max_tokens)) for i in range(NUM_SYSTEMS * TURNS)]
    rng.shuffle(requests)
    return requests


def conversation_requests(seed: int, system_tokens: int, question_tokens: tuple[int, int],
                          max_tokens: int) -> list[Request]:
    """NUM_SYSTEMS chats of TURNS turns, interleaved in a seeded random order (each chat's turns in order).
    Turn t's prompt is turn t-1's prompt + its answer + a new question."""
    rng = random.Random(seed)
    histories = [random_tokens(rng, system_tokens) for _ in range(NUM_SYSTEMS)]
    order = [c for c in range(NUM_SYSTEMS) for _ in range(TURNS)]
    rng.shuffle(order)
    requests = []
    for chat in order:
        prompt = histories[chat] + random_tokens(rng, rng.randint(*question_tokens))
        answer = random_tokens(rng, max_tokens)
        requests.append(Request(chat, prompt, answer))
        histories[chat] = prompt + answer
    return requests


class Replica:
    """One engine replica's prefix cache and what the cache-aware router has sent it."""

    def __init__(self, num_blocks: int) -> None:
        self.cache = BlockManager(BLOCK_SIZE, num_blocks)
        self.sent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.requests = 0

    def serve(self, seq_id: int, request: Request) -> int:
        """Prefill ``request``, decode its answer, free it; the prompt tokens found cached."""
        prompt, cache = request.prompt, self.cache
        cached = cache.num_cached_prefix_tokens(prompt)
        hit = cache.allocate_slots(seq_id, prompt, len(prompt) - cached).num_cached_tokens
        tokens = prompt + request.answer
        cache.allocate_slots(seq_id, tokens, len(request.answer) - 1)
        cache.free(seq_id)
        self.requests += 1
        return hit


def pick(router: str, request: Request, replicas: list[Replica], rng: random.Random) -> Replica:
    if router == "random":
        return rng.choice(replicas)
    if router == "partition":
        return replicas[request.source % len(replicas)]
    hashes = prefix_block_hashes(request.prompt, BLOCK_SIZE)
    views = [ReplicaView(r, HeldBlocks(frozenset(r.cache.cached_prefix_hashes(PREFIX_SUMMARY_BLOCKS)), r.sent),
                         load=0, footprint=len(r.sent)) for r in replicas]
    chosen, _ = choose_by_prefix(hashes, views, DEFAULT_MAX_IMBALANCE)
    replica = rng.choice(chosen)        # Serve takes the shortest queue among them: all equal here
    remember_sent(replica.sent, hashes)
    return replica


def replay(router: str, requests: list[Request], num_blocks: int, seed: int) -> dict:
    """Hit tokens, prompt tokens and the busiest replica's share for one router over ``requests``."""
    longest = max(len(r.prompt) + len(r.answer) - 1 for r in requests)
    if -(-longest // BLOCK_SIZE) > num_blocks:
        raise ValueError(f"num_blocks: {num_blocks} blocks cannot hold the longest request ({longest} tokens)")
    replicas, rng = [Replica(num_blocks), Replica(num_blocks)], random.Random(seed + 12345)
    hit = sum(pick(router, request, replicas, rng).serve(i, request) for i, request in enumerate(requests))
    for replica in replicas:
        replica.cache.check_invariants()
        if replica.cache.num_free_blocks != num_blocks:
            raise RuntimeError("a replayed request left blocks behind")
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"hit_tokens": hit, "prompt_tokens": prompt_tokens, "hit_rate": hit / prompt_tokens,
            "busiest_share": max(r.requests for r in replicas) / len(requests)}


def over_seeds(values: list[float]) -> Stat:
    """Median [min-max] over the seeds' values (a seed is a round; nothing here is timed, so none is noisy)."""
    return stat([(seed, value, False) for seed, value in enumerate(values)])


def sweep(workload: str, sizes: list[int], seeds: int, system_tokens: int, question_tokens: tuple[int, int],
          max_tokens: int) -> list[dict]:
    """Per cache size: each router's hit rate and busiest share, and hit-token ratios to ``random`` (Stats)."""
    make = independent_requests if workload == "independent" else conversation_requests
    workloads = [make(seed, system_tokens, question_tokens, max_tokens) for seed in range(seeds)]
    rows = []
    for num_blocks in sizes:
        runs = {router: [replay(router, requests, num_blocks, seed) for seed, requests in enumerate(workloads)]
                for router in ROUTERS}
        row = {"num_blocks": num_blocks}
        for router, results in runs.items():
            row[router] = {"hit_rate": over_seeds([r["hit_rate"] for r in results]),
                           "busiest_share": over_seeds([r["busiest_share"] for r in results])}
            if router != "random":
                row[router]["hit_tokens_vs_random"] = over_seeds(
                    [r["hit_tokens"] / max(1, base["hit_tokens"]) for r, base in zip(results, runs["random"])])
        rows.append(row)
    return rows


def question_range(text: str) -> tuple[int, int]:
    """argparse type of ``--question-tokens``: ``LOW,HIGH`` with 1 <= LOW <= HIGH."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need LOW,HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("independent", "conversations"), default="independent")
    p.add_argument("--num-blocks", type=block_sizes, default=None,
                   help="KV blocks per replica (16 tokens each), comma-separated; default a sweep per workload")
    p.add_argument("--seeds", type=int, default=10, help="workloads (random tokens and order) per cache size")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=question_range, default=(10, 20))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=None,
                   help="JSON report (default benchmarks/results/routing_ceiling_<workload>.json)")
    args = p.parse_args(argv)
    for name in ("seeds", "system_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    sizes = args.num_blocks or DEFAULT_SIZES[args.workload]
    rows = sweep(args.workload, sizes, args.seeds, args.system_tokens, args.question_tokens, args.max_tokens)
    print_table([{"KV blocks": row["num_blocks"],
                  **{f"hit rate {router}": fmt_stat(row[router]["hit_rate"]) for router in ROUTERS},
                  "cache_aware / random": fmt_stat(row["cache_aware"]["hit_tokens_vs_random"], suffix="x"),
                  "partition / random": fmt_stat(row["partition"]["hit_tokens_vs_random"], suffix="x"),
                  "busiest (cache_aware)": fmt_stat(row["cache_aware"]["busiest_share"])} for row in rows],
                ["KV blocks", *(f"hit rate {router}" for router in ROUTERS), "cache_aware / random",
                 "partition / random", "busiest (cache_aware)"])
    config = {k: v for k, v in vars(args).items() if k != "out"}
    json_rows = [{"num_blocks": row["num_blocks"],
                  **{router: {k: v.to_json() for k, v in row[router].items()} for router in ROUTERS}} for row in rows]
    report = {"config": {**config, "num_blocks": sizes, "num_systems": NUM_SYSTEMS, "turns": TURNS},
              "rows": json_rows}
    write_json(f"routing_ceiling_{args.workload}", report, args.out)
    return report


if __name__ == "__main__":
    main()
