"""A light tenant next to one flooding long prompts: FIFO against fair share (#64 part 3):
``python -m benchmarks.fairness [--light 16] [--rounds 3] [--dry-run]``

Workload (fixed seed, token ids, greedy, EOS ignored), on the offline engine in this process (the model at its
default dtype), its steps run back to back on the wall clock:
- the light tenant sends ``--light`` requests of ``--light-tokens`` prompt tokens, one every
  ``--light-interval-s``, each generating ``--max-tokens``;
- the flood tenant keeps ``--flood-queue`` prompts of ``--flood-tokens`` tokens waiting at every moment of the
  run (each generating ``--max-tokens``), so the KV pool and every step's token budget are always wanted.

Systems, interleaved by rounds, each in a fresh engine: ``solo`` (the light tenant alone), ``fifo`` (both, no
tenants: today's queue order) and ``fair`` (both, as tenants of equal weight: cluster/fair_share.py).
``--max-num-batched-tokens`` is the step budget of all three (the engine's default unless given).

Reported: the light tenant's TTFT (its request's arrival -> first token, ms) p50 and p99, and the flood's
output tok/s; ratios fifo / solo and fair / solo (how many times the solo TTFT). The issue's goal: fair's p99
<= 1.5x solo's.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

SYSTEMS = ("solo", "fifo", "fair")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(system: str, args, vocab: int) -> dict:
    from pagedray.cluster import LLM, SamplingParams
    from pagedray.workers.contract.config import TenantConfig

    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tenants = (TenantConfig("flood"), TenantConfig("light")) if system == "fair" else ()
    light_tenant, flood_tenant = ("light", "flood") if system == "fair" else (None, None)
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    with LLM(args.model, block_size=16, num_blocks=args.num_blocks, tenants=tenants, **extra) as llm:
        engine = llm.engine
        engine.add("warm-up", [rng.randrange(2, vocab) for _ in range(32)], params)
        while engine.has_unfinished_requests():
            engine.step()
        arrivals, first, flood_ids, flood_tokens = {}, {}, set(), 0
        start = time.perf_counter()
        while len(first) < args.light:
            now = time.perf_counter() - start
            while len(arrivals) < args.light and now >= len(arrivals) * args.light_interval_s:
                rid = f"light-{len(arrivals)}"
                prompt = [rng.randrange(2, vocab) for _ in range(args.light_tokens)]
                engine.add(rid, prompt, params, tenant=light_tenant)
                arrivals[rid] = time.perf_counter()
            if system != "solo":
                waiting = sum(1 for s in engine.scheduler.waiting if s.request.request_id in flood_ids)
                for _ in range(args.flood_queue - waiting):
                    rid = f"flood-{len(flood_ids)}"
                    engine.add(rid, [rng.randrange(2, vocab) for _ in range(args.flood_tokens)], params,
                               tenant=flood_tenant)
                    flood_ids.add(rid)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, len(arrivals) * args.light_interval_s - (time.perf_counter() - start)))
                continue
            for out in engine.step():
                got = sum(len(c.token_ids) for c in out.outputs)
                if out.request_id in arrivals and got and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
                if out.request_id in flood_ids:
                    flood_tokens += got
        elapsed = time.perf_counter() - start
    ttfts = [1000 * (first[r] - arrivals[r]) for r in arrivals]
    return {"light_ttft_p50_ms": _percentile(ttfts, 0.5), "light_ttft_p99_ms": _percentile(ttfts, 0.99),
            "flood_tok_s": flood_tokens / elapsed}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.fairness", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "fairness")
    parser.add_argument("--model", default="default")
    parser.add_argument("--light", type=int, default=16)
    parser.add_argument("--light-tokens", type=int, default=64)
    parser.add_argument("--light-interval-s", type=float, default=1.0)
    parser.add_argument("--flood-queue", type=int, default=8)
    parser.add_argument("--flood-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="3 light requests, small prompts: the plumbing")
    args = parser.parse_args(argv)
    from pagedray.workers.models.model_info import model_info
    from pagedray.workers.weights.default_model import resolve_model_path

    if args.dry_run:
        args.light, args.light_tokens, args.light_interval_s = 3, 16, 0.05
        args.flood_queue, args.flood_tokens, args.max_tokens, args.num_blocks = 2, 96, 4, 64
    args.model = str(resolve_model_path(args.model))
    vocab = model_info(args.model).vocab_size
    runs = run_rounds(SYSTEMS, args.rounds, lambda system, _: measure(system, args, vocab), on_run=print_run)
    metrics = [Metric("light_ttft_p50_ms", "light TTFT p50 ms", higher_is_better=False),
               Metric("light_ttft_p99_ms", "light TTFT p99 ms", higher_is_better=False),
               Metric("flood_tok_s", "flood output tok/s")]
    ratios = [Ratio("fifo", ("solo",), ("light_ttft_p50_ms", "light_ttft_p99_ms"), "fifo / solo"),
              Ratio("fair", ("solo",), ("light_ttft_p50_ms", "light_ttft_p99_ms"), "fair / solo"),
              Ratio("fair", ("fifo",), ("flood_tok_s",), "fair / fifo")]
    out = "/dev/null" if args.dry_run and args.out == parser.get_default("out") else args.out
    report = finish_rounds("fairness", out, runs, metrics, ratios, vars(args))
    print_ratio(report, "fair / solo", "light_ttft_p99_ms", "light TTFT p99, fair / solo", "<= 1.5x")
    print_ratio(report, "fifo / solo", "light_ttft_p99_ms", "light TTFT p99, fifo / solo", "none: today's FIFO")
    return report


if __name__ == "__main__":
    main()
