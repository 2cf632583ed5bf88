"""Benchmark 3: prefix caching: time to first token of requests sharing a long system prompt.

Workload: a ~1k-token system prompt (fixed seed words, default SmolLM2 tokenizer) followed by a
short distinct question per request; 32 requests arrive together after one warm-up request with the
same system prompt (the "earlier user" whose blocks the cache keeps). max_tokens=1: the run measures
TTFT only. Both runs (caching on / off) use the same engine settings; TTFT is measured from the
moment all requests were added to the step that returned each request's first token.

The two runs alternate over ``--rounds`` rounds (``benchmarks.rounds``: on off, off on, ...), each
with a fresh engine; the speedup is the per-round ratio TTFT off / TTFT on, median [min-max].

Usage: ``python -m benchmarks.prefix [--rounds 3] [--num-requests 32] [--system-tokens 1024]``
(or ``python benchmarks/prefix.py ...``)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, make_prompts, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

ON, OFF = "caching on", "caching off"
METRICS = [Metric("mean_ttft_s", "mean TTFT s", higher_is_better=False),
           Metric("p50_ttft_s", "p50 TTFT s", higher_is_better=False),
           Metric("max_ttft_s", "max TTFT s", higher_is_better=False),
           Metric("prefix_hit_rate", "prefix hit rate"),
           Metric("computed_tokens", "computed tokens", higher_is_better=False)]
RATIOS = [Ratio(OFF, (ON,), ("mean_ttft_s", "p50_ttft_s", "max_ttft_s"), "speedup (off / on)")]


def _workload(tokenizer, num_requests: int, system_tokens: int, seed: int):
    text = make_prompts(1, 2 * system_tokens, 2 * system_tokens, seed)[0]
    system = tokenizer(text).input_ids[:system_tokens]
    questions = make_prompts(num_requests + 1, 8, 16, seed + 7)
    return [system + tokenizer(" Question: " + q).input_ids for q in questions]


def run(prompts, caching: bool) -> dict:
    from pagedray.cluster import LLM, SamplingParams

    llm = LLM("default", dtype="float32", enable_prefix_caching=caching, num_blocks=4096, max_num_seqs=64,
              max_num_batched_tokens=2048)
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        llm.generate(prompts[:1], params, use_tqdm=False)           # warm-up / first user
        for i, prompt in enumerate(prompts[1:]):
            engine.add(f"q{i}", prompt, params)
        start = time.perf_counter()
        ttft = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - start
        stats = engine.stats()
    finally:
        llm.shutdown()
    values = sorted(ttft.values())
    return {"requests": len(values), "mean_ttft_s": statistics.mean(values),
            "p50_ttft_s": statistics.median(values), "max_ttft_s": values[-1],
            "prefix_hit_rate": stats.prefix_hit_rate, "computed_tokens": stats.num_computed_tokens_total}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "prefix")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from pagedray.workers.weights.default_model import ensure_default_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    prompts = _workload(tokenizer, args.num_requests, args.system_tokens, args.seed)
    runs = run_rounds([ON, OFF], args.rounds, lambda system, _round: run(prompts, caching=system == ON),
                      on_run=print_run)
    report = finish_rounds("prefix", args.out, runs, METRICS, RATIOS, vars(args),
                           {"prompt_tokens": [len(p) for p in prompts]})
    print_ratio(report, RATIOS[0].name, "mean_ttft_s", "mean TTFT speedup with prefix caching", ">= 5x", digits=1)
    return report


if __name__ == "__main__":
    main()
