"""Decode-heavy bookkeeping benchmark of the BlockManager (a script, not a test).

    python -m pagedray.block_manager.bench [--out bench_results/block_manager.json]

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
one-element list) without the manager; the ratio to it is the machine-independent figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections import deque
from dataclasses import dataclass, field

from .errors import CannotAllocateError
from .manager import BlockManager

VOCAB = 32000


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
    result = TraceResult("floor (no manager)")
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
    parser.add_argument("--out", default="bench_results/block_manager.json")
    parser.add_argument("--num-seqs", type=int, default=1000)
    parser.add_argument("--decode-steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = make_prompts(args.num_seqs, args.seed)
    common = (args.decode_steps, args.num_blocks, args.block_size, args.max_num_seqs)
    runs = [run_trace("manager, prefix caching on", prompts, *common, prefix_caching=True),
            run_trace("manager, prefix caching off", prompts, *common, prefix_caching=False)]
    mean_batch = max(1, round(runs[0].decode_tokens / max(1, runs[0].decode_steps)))
    runs.append(run_floor(prompts, args.decode_steps, mean_batch))
    rows = [r.row() for r in runs]
    floor = rows[-1]["us_per_decode_token"]
    for row in rows:
        row["ratio_to_floor"] = row["us_per_decode_token"] / floor
    _print_table(rows)
    report = {"benchmark": "block_manager decode-heavy trace", "args": vars(args), "rows": rows,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "processor": platform.processor() or platform.machine()},
              "date": time.strftime("%Y-%m-%d")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return report


def _print_table(rows: list[dict]) -> None:
    header = (f"{'run':<30} {'us/decode tok':>13} {'x floor':>8} {'us/step':>9} {'batch':>6} "
              f"{'us/prompt tok':>13} {'hit rate':>8} {'preempt':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<30} {r['us_per_decode_token']:>13.3f} {r['ratio_to_floor']:>8.2f} "
              f"{r['us_per_decode_step']:>9.1f} {r['mean_batch']:>6.1f} {r['us_per_prompt_token']:>13.3f} "
              f"{r['prefix_hit_rate']:>8.3f} {r['preemptions']:>7}")


if __name__ == "__main__":
    main()
