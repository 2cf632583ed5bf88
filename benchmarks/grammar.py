"""Grammar-masked sampling cost: offline tokens/s with and without a JSON schema, batch 1 and 16.

Workload: ``--batch`` prompts (8-120 words), greedy, ``--max-tokens`` output tokens each. The schema
run asks every sequence for a JSON array of at least 64 one-digit integers (compact: ``[3,1,4,...``), so it
cannot close before ``max_tokens``; the plain run sets ``ignore_eos``. Both therefore produce exactly
the same number of tokens in the same number of steps, and the ratio isolates the grammar's cost: the
llguidance mask per row, unpacking it, masking the logits and feeding the sampled token back
(``workers/sampling/grammar.py``), timed separately as mask ms per step.

Systems ``plain bN`` / ``json bN`` run in interleaved rounds (``benchmarks.rounds``) on one in-process
engine (``LLM``, ``--threads`` torch threads), built once and warmed up with both kinds of request.

Usage: ``python -m benchmarks.grammar [--rounds 3] [--batches 1,16] [--max-tokens 64] [--threads 2]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, make_prompts, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "integer", "minimum": 0, "maximum": 9}}
METRICS = [Metric("output_tok_per_s", "output tok/s"),
           Metric("mask_ms_per_step", "mask ms / step", higher_is_better=False),
           Metric("output_tokens", "output tokens")]


class MaskTimer:
    """Wraps a GrammarBook's mask and advance on one worker, summing their wall time."""

    def __init__(self, book) -> None:
        self.seconds, self.steps = 0.0, 0
        for name in ("mask", "advance"):
            setattr(book, name, self._timed(getattr(book, name), name == "mask"))

    def _timed(self, method, counts_step: bool):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += counts_step
        return timed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "grammar")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from pagedray.cluster import LLM, SamplingParams
    from pagedray.deploy.openai.structured_output import schema_grammar

    batches = [int(b) for b in args.batches.split(",")]
    prompts = make_prompts(max(batches), 8, 120, args.seed)
    grammar = schema_grammar(SCHEMA, "schema")
    llm = LLM("default", dtype="float32", num_blocks=2048, max_num_seqs=max(batches), threads_per_worker=args.threads)
    timer = MaskTimer(llm.engine.executor.worker.grammars)
    params = {"plain": SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
              "json": SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=grammar)}
    for kind in params:                                            # warm-up: tokenizers, llguidance lexer
        llm.generate(prompts[:2], params[kind], use_tqdm=False)

    def measure(system: str, _round: int) -> dict:
        kind, batch = system.split(" b")
        timer.seconds, timer.steps = 0.0, 0
        start = time.perf_counter()
        results = llm.generate(prompts[:int(batch)], params[kind], use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        return {"output_tok_per_s": tokens / elapsed, "output_tokens": tokens,
                "mask_ms_per_step": 1e3 * timer.seconds / timer.steps if timer.steps else 0.0}

    systems = [f"{kind} b{batch}" for batch in batches for kind in ("plain", "json")]
    ratios = [Ratio(f"json b{batch}", (f"plain b{batch}",), ("output_tok_per_s",), f"json / plain, batch {batch}")
              for batch in batches]
    try:
        runs = run_rounds(systems, args.rounds, measure, on_run=print_run)
    finally:
        llm.shutdown()
    report = finish_rounds("grammar", args.out, runs, METRICS, ratios, vars(args), {"schema": SCHEMA})
    for ratio in ratios:
        print_ratio(report, ratio.name, "output_tok_per_s", ratio.name, ">= 0.90 at batch 16", digits=3)
    return report


if __name__ == "__main__":
    main()
