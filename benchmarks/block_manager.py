"""Decode-heavy bookkeeping benchmark of the BlockManager (a script, not a test).

    python -m benchmarks.block_manager [--rounds 3] [--out benchmarks/results/block_manager.json]
    python benchmarks/block_manager.py --num-seqs 40 --decode-steps 16   # a quick smoke run

Trace: ``--num-seqs`` sequences (1,000) with prompts of 1,792..2,303 tokens, half of them starting
with a common 1,024-token prefix, each decoding ``--decode-steps`` (256) tokens. A minimal scheduler
drives the manager the way the engine does: each step it admits waiting sequences in order while
``can_allocate`` says yes (whole prompt in one chunk, after a prefix-cache lookup) and up to
``--max-num-seqs`` run; then every running sequence appends its last sampled token,
``allocate_slots(seq, tokens, 1)`` and ``slot_mapping`` for that one slot; a sequence that cannot
grow preempts the newest running one (freed, re-admitted later by recompute); finished sequences are
freed. Capacity (``--num-blocks``) is chosen so that admission happens in waves.

Reported: microseconds of bookkeeping per decode token and per decode step, and per prompt token at
admission. Peers measured in the same process: the same trace with prefix caching off, and a "floor"
loop that does the scheduler's own per-token work (append a token, one dict lookup, build a
one-element list) without the manager; the ratio to it is the machine-independent figure. The floor
runs at the mean decode batch of the caching-on trace, taken from one untimed warm-up trace (the trace
is deterministic, so that batch is the one every timed run has).

The three systems run ``--rounds`` times in alternating order (``benchmarks.rounds``); the table shows
per system the median [min-max] over clean rounds and the per-round ratio to the floor.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pagedray.block_manager.errors import CannotAllocateError
from pagedray.block_manager.manager import BlockManager

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

VOCAB = 32000
CACHING_ON, CACHING_OFF, FLOOR = "manager, caching on", "manager, caching off", "floor (no manager)"
METRICS = [Metric("us_per_decode_token", "us/decode token", higher_is_better=False),
           Metric("us_per_decode_step", "us/decode step", higher_is_better=False),
           Metric("us_per_prompt_token", "us/prompt token", higher_is_better=False),
           Metric("mean_batch", "mean batch"), Metric("max_running", "max running"),
           Metric("prefix_hit_rate", "prefix hit rate"), Metric("preemptions", higher_is_better=False)]
RATIOS = [Ratio(CACHING_ON, (FLOOR,), ("us_per_decode_token",), f"{CACHING_ON} / floor"),
          Ratio(CACHING_OFF, (FLOOR,), ("us_per_decode_token",), f"{CACHING_OFF} / floor")]


@dataclass
class TraceResult:
    name: str
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    admit_s: float = 0.0
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    max_running: int = 0
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {
            "name": self.name,
            "us_per_decode_token": 1e6 * self.decode_s / max(1, self.decode_tokens),
            "us_per_decode_step": 1e6 * self.decode_s / max(1, self.decode_steps),
            "us_per_prompt_token": 1e6 * self.admit_s / max(1, self.prompt_tokens),
            "decode_tokens": self.decode_tokens, "decode_steps": self.decode_steps,
            "mean_batch": self.decode_tokens / max(1, self.decode_steps), "max_running": self.max_running,
            "prompt_tokens": self.prompt_tokens, "preemptions": self.preemptions,
            "prefix_hit_rate": self.prefix_hit_rate, **self.extra,
        }


def make_prompts(num_seqs: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(VOCAB) for _ in range(1024)]
    prompts = []
    for i in range(num_seqs):
        length = rng.randrange(1792, 2304)
        head = common if i % 2 == 0 else []
        prompts.append(head + [rng.randrange(VOCAB) for _ in range(length - len(head))])
    return prompts


def _admit(manager: BlockManager, waiting: deque, running: list, tokens: dict, limit: int,
           result: TraceResult) -> None:
    """Admit waiting sequences in order while they fit; timed as prefill bookkeeping."""
    start = time.perf_counter()
    while waiting and len(running) < limit:
        seq_id = waiting[0]
        toks = tokens[seq_id]
        hit = manager.num_cached_prefix_tokens(toks)
        if not manager.can_allocate(seq_id, toks, len(toks) - hit):
            if not running:
                raise SystemExit(f"sequence {seq_id} ({len(toks)} tokens) cannot fit in an empty pool; "
                                 "raise --num-blocks")
            break
        waiting.popleft()
        manager.allocate_slots(seq_id, toks, len(toks) - hit)
        manager.slot_mapping(seq_id, hit, len(toks))
        toks.append(len(toks) % VOCAB)  # the token sampled at the end of the prefill
        result.prompt_tokens += len(toks) - 1
        running.append(seq_id)
    result.admit_s += time.perf_counter() - start


def run_trace(name: str, prompts: list[list[int]], decode_steps: int, num_blocks: int, block_size: int,
              max_num_seqs: int, prefix_caching: bool) -> TraceResult:
    manager = BlockManager(block_size, num_blocks, enable_prefix_caching=prefix_caching, watermark=0.01)
    result = TraceResult(name)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    target = {i: len(p) + decode_steps for i, p in enumerate(prompts)}
    waiting = deque(range(len(prompts)))
    running: list[int] = []
    allocate_slots, slot_mapping = manager.allocate_slots, manager.slot_mapping
    while waiting or running:
        _admit(manager, waiting, running, tokens, max_num_seqs, result)
        result.max_running = max(result.max_running, len(running))
        start = time.perf_counter()
        scheduled = 0
        i = 0
        while i < len(running):
            seq_id = running[i]
            toks = tokens[seq_id]
            try:
                allocate_slots(seq_id, toks, 1)
            except CannotAllocateError:
                victim = running.pop()  # preempt the newest; recompute it later
                manager.free(victim)
                waiting.appendleft(victim)
                result.preemptions += 1
                continue
            n = len(toks)
            slot_mapping(seq_id, n - 1, n)
            toks.append(n % VOCAB)
            scheduled += 1
            i += 1
        result.decode_s += time.perf_counter() - start
        result.decode_tokens += scheduled
        result.decode_steps += 1
        finished = [s for s in running if len(tokens[s]) > target[s]]
        for seq_id in finished:
            manager.free(seq_id)
        running = [s for s in running if len(tokens[s]) <= target[s]]
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks, "the trace leaked blocks"
    result.prefix_hit_rate = manager.stats().prefix_hit_rate
    return result


def run_floor(prompts: list[list[int]], decode_steps: int, batch: int) -> TraceResult:
    """The scheduler's own per-token work without the manager: the peer the manager is compared to."""
    result = TraceResult(FLOOR)
    tokens = {i: list(p) for i, p in enumerate(prompts[:batch])}
    lengths = {i: len(p) for i, p in tokens.items()}
    running = list(tokens)
    for _ in range(decode_steps):
        start = time.perf_counter()
        for seq_id in running:
            toks = tokens[seq_id]
            n = lengths[seq_id] = len(toks)
            _ = [n - 1]
            toks.append(n % VOCAB)
        result.decode_s += time.perf_counter() - start
        result.decode_tokens += len(running)
        result.decode_steps += 1
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_args(parser, "block_manager")
    parser.add_argument("--num-seqs", type=int, default=1000)
    parser.add_argument("--decode-steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = make_prompts(args.num_seqs, args.seed)
    common = (args.decode_steps, args.num_blocks, args.block_size, args.max_num_seqs)
    warm = run_trace(CACHING_ON, prompts, *common, prefix_caching=True)  # untimed: warm-up, floor batch
    mean_batch = max(1, round(warm.decode_tokens / max(1, warm.decode_steps)))

    def measure(system: str, _round: int) -> dict:
        if system == FLOOR:  # no admission, no cache: only the decode figures apply
            row = run_floor(prompts, args.decode_steps, mean_batch).row()
            return {k: row[k] for k in ("name", "us_per_decode_token", "us_per_decode_step", "decode_tokens",
                                        "decode_steps", "mean_batch")}
        return run_trace(system, prompts, *common, prefix_caching=system == CACHING_ON).row()

    runs = run_rounds([CACHING_ON, CACHING_OFF, FLOOR], args.rounds, measure, on_run=print_run)
    return finish_rounds("block_manager", args.out, runs, METRICS, RATIOS, vars(args),
                         {"floor_batch": mean_batch})


if __name__ == "__main__":
    main()
