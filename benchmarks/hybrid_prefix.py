"""Prefix caching for a hybrid model on CPU: multi-turn conversations on a Qwen3.5-shaped hybrid with its state
snapshots (``hybrid_prefix_states``, the default 16) against the same model with prefix caching off (what hybrids
had before the snapshots: ``hybrid_prefix_states=0``), and a dense Qwen3 of the same size with its ordinary
prefix cache as the reference, in one run.

The models are ``benchmarks.hybrid_decode``'s (random weights, SmolLM2-135M's shape). Workload: ``--convs``
conversations (4) of ``--turns`` turns (4); turn 1's prompt is ``--first-len`` random tokens (512), every later
turn's prompt is the previous prompt + its ``--max-tokens`` output tokens (16, greedy, EOS ignored) + ``--user-len``
new tokens (128), as a chat client sends them. Each turn of all conversations is one ``LLM.generate`` call, in
process (``--threads`` torch threads, ``--dtype``). Every round draws new conversations (its own seed), so no
round reuses another's cache. Metrics: the wall time of all turns (lower is better), the prompt tokens served
from the cache (of ``prompt_tokens`` in all turns), and the time of the last turn (the longest prompts). Systems
interleave over ``--rounds`` rounds (``benchmarks.rounds``); reported: median [min-max] per system, and snapshots
/ off per round.

Usage: ``python -m benchmarks.hybrid_prefix [--rounds 3] [--convs 4] [--turns 4]``
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import rounds
from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run
from benchmarks.hybrid_decode import SHAPE, save_models

SYSTEMS = {"hybrid-snapshots": ("hybrid", {}), "hybrid-off": ("hybrid", {"hybrid_prefix_states": 0}),
           "dense-cached": ("dense", {})}


def conversation_turns(llm, convs: int, turns: int, first_len: int, user_len: int, max_tokens: int, seed: int,
                       vocab: int = SHAPE["vocab_size"]) -> dict:
    """Runs ``convs`` conversations of ``turns`` turns (module docstring) -> the run's metrics."""
    from pagedray.cluster import SamplingParams

    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [words(first_len) for _ in range(convs)]
    total = last = 0.0
    cached = prompt_tokens = 0
    for turn in range(turns):
        prompt_tokens += sum(len(p) for p in prompts)
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        last = time.perf_counter() - start
        total += last
        cached += sum(r.num_cached_prompt_tokens for r in results)
        if turn + 1 < turns:
            prompts = [p + r.outputs[0].token_ids + words(user_len) for p, r in zip(prompts, results)]
    return {"all_turns_s": total, "last_turn_s": last, "cached_prompt_tokens": cached, "prompt_tokens": prompt_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "hybrid_prefix")
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)

    from pagedray.cluster import LLM

    with tempfile.TemporaryDirectory() as folder:
        models = save_models(Path(folder))
        llms = {system: LLM(models[kind][0], dtype=args.dtype, threads_per_worker=args.threads,
                            enable_prefix_caching=True, **options) for system, (kind, options) in SYSTEMS.items()}
        try:
            for llm in llms.values():                      # warm-up: first-call costs outside the timing
                conversation_turns(llm, 1, 2, 64, 16, 2, seed=-1)

            def measure(system: str, index: int) -> dict:
                return conversation_turns(llms[system], args.convs, args.turns, args.first_len, args.user_len,
                                          args.max_tokens, seed=index)

            runs = rounds.run_rounds(list(llms), args.rounds, measure, on_run=print_run)
            dtype = str(next(iter(llms.values())).engine.dtype)
        finally:
            for llm in llms.values():
                llm.shutdown()
    metrics = [rounds.Metric("all_turns_s", "all turns, s", higher_is_better=False),
               rounds.Metric("last_turn_s", "last turn, s", higher_is_better=False),
               rounds.Metric("cached_prompt_tokens", "prompt tokens from the cache")]
    ratios = [rounds.Ratio("hybrid-snapshots", ("hybrid-off",), ("all_turns_s", "last_turn_s")),
              rounds.Ratio("hybrid-snapshots", ("dense-cached",), ("all_turns_s", "last_turn_s"))]
    config = {**vars(args), "dtype_used": dtype, "parameters": {s: count for s, (_, count) in models.items()}}
    report = finish_rounds("hybrid_prefix", args.out, runs, metrics, ratios, config)
    print_ratio(report, "hybrid-snapshots / hybrid-off", "all_turns_s", "hybrid conversation time, snapshots / off",
                "measured, no goal")
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
