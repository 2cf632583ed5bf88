"""Speculative decoding (n-gram prompt lookup): time per output token with and without it, same requests.

Workload: tasks whose answers repeat their input, as users give a small instruct model: copy a passage,
rewrite a function with one change, fix a typo in a list, continue a repetitive table (``TASKS``, chat
template of the default SmolLM2-135M-Instruct), greedy, up to ``--max-tokens`` tokens (EOS ends a request
early), at batch 1 (each task alone, one after the other) and at batch 8 (eight requests together: the
tasks in turn). Systems: ``off`` (``num_speculative_tokens=0``) and ``ngram`` (``--k`` drafts per step,
prompt lookup 2-4 tokens), plus ``draft`` with ``--draft-model FOLDER`` (``--k`` greedy drafts per step
from that model on the rank, ``speculative_model``), each an in-process ``LLM`` at the default dtype,
driven step by step so that every request's tokens are timed as they come out.

Metrics per system and batch size: TPOT (ms per output token after the first, mean over requests),
output tok/s, acceptance (accepted / proposed drafts) and drafts accepted per step that carried drafts
(a sequence's step then emits that many tokens plus its own). Ratio:
ngram / off (and draft / off) TPOT per round (lower is better), median [min-max] over ``--rounds``
interleaved rounds.
Greedy output is the same with and without speculation in float32; in bfloat16 a different batch shape
can break a near-tie, so the script reports the fraction of identical outputs.

    python -m benchmarks.spec_decode [--rounds 3] [--k 4] [--max-tokens 128] [--dtype auto] [--draft-model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

TASKS = [
    "Copy this paragraph exactly, word for word:\n\nThe paged KV cache stores the keys and values of every "
    "sequence in fixed-size blocks. A block table maps each sequence's positions to blocks, so sequences "
    "can grow without moving memory, and blocks with the same prefix can be shared between requests.",
    "Rename the variable `total` to `acc` in this function and write out the whole function:\n\n"
    "def sum_squares(values):\n    total = 0\n    for value in values:\n        total = total + value * value\n"
    "    return total\n",
    "Fix the spelling mistake and write the list again:\n\n- apples\n- bananas\n- cherrys\n- dates\n- elderberries\n"
    "- figs\n- grapes\n",
    "Continue the table for 6 more rows:\n\n| n | n squared |\n|---|---|\n| 1 | 1 |\n| 2 | 4 |\n| 3 | 9 |\n"
    "| 4 | 16 |\n",
    "Write this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Add a docstring to this function and return the whole function:\n\ndef area(width, height):\n"
    "    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n",
]
SYSTEMS = ("off", "ngram")
BATCHES = (1, 8)


def _metrics() -> list[Metric]:
    metrics = []
    for batch in BATCHES:
        metrics += [Metric(f"tpot_ms_b{batch}", f"TPOT ms batch {batch}", higher_is_better=False),
                    Metric(f"tok_s_b{batch}", f"output tok/s batch {batch}"),
                    Metric(f"acceptance_b{batch}", f"acceptance batch {batch}"),
                    Metric(f"accepted_per_step_b{batch}", f"accepted/drafted step batch {batch}")]
    return metrics


def prompts_of(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True,
                                           tokenize=False) for task in TASKS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _run_wave(engine, prompts: list[list[int]], params) -> tuple[list[float], int, float, dict[str, list[int]]]:
    """Adds the prompts together and steps to the end: per-request TPOT (s), tokens, wall seconds, tokens."""
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, params)
    first, last, tokens = {}, {}, {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = out.outputs[0].token_ids
            if new:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens.setdefault(out.request_id, []).extend(new)
    wall = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in tokens if len(tokens[r]) > 1]
    return tpots, sum(len(t) for t in tokens.values()), wall, tokens


def measure(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    from pagedray.cluster import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    values, outputs = {}, {}
    for batch in BATCHES:
        before = engine.stats()
        waves = [[prompts[i % len(prompts)]] for i in range(len(prompts))] if batch == 1 else \
            [[prompts[i % len(prompts)] for i in range(batch)]]
        tpots, count, wall = [], 0, 0.0
        for w, wave in enumerate(waves):
            wave_tpots, wave_count, wave_wall, tokens = _run_wave(engine, wave, params)
            tpots += wave_tpots
            count += wave_count
            wall += wave_wall
            outputs.update({f"b{batch}-{w}-{r}": t for r, t in tokens.items()})
        after = engine.stats()
        proposed = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
        accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
        values[f"tpot_ms_b{batch}"] = 1e3 * statistics.mean(tpots)
        values[f"tok_s_b{batch}"] = count / wall
        values[f"acceptance_b{batch}"] = accepted / proposed if proposed else 0.0
        drafted = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
        values[f"accepted_per_step_b{batch}"] = accepted / drafted if drafted else 0.0
    return values, outputs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "spec_decode")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the ngram system")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-model", default=None,
                        help="also run the system 'draft': this model folder drafts (see benchmarks.draft_models)")
    args = parser.parse_args(argv)
    from pagedray.cluster import LLM
    from transformers import AutoTokenizer

    systems = SYSTEMS + (("draft",) if args.draft_model else ())
    engines = {system: LLM("default", dtype=args.dtype, num_speculative_tokens=0 if system == "off" else args.k,
                           speculative_model=args.draft_model if system == "draft" else None,
                           num_blocks=1024, max_num_seqs=16) for system in systems}
    tokenizer = AutoTokenizer.from_pretrained(engines["off"].engine.model_path)
    prompts = prompts_of(tokenizer)
    for llm in engines.values():                     # warm-up, outside the timing
        measure(llm, prompts[:1], 8)
    texts = {}

    def run(system: str, round_index: int) -> dict:
        values, outputs = measure(engines[system], prompts, args.max_tokens)
        texts[(system, round_index)] = outputs
        return values

    try:
        runs = run_rounds(systems, args.rounds, run, on_run=print_run)
    finally:
        for llm in engines.values():
            llm.shutdown()
    same = [texts[(system, r)][key] == texts[("off", r)][key]
            for system in systems[1:] for r in range(args.rounds) for key in texts[("off", r)]]
    metrics = _metrics()
    keys = tuple(f"tpot_ms_b{b}" for b in BATCHES) + tuple(f"tok_s_b{b}" for b in BATCHES)
    ratios = [Ratio(system, ("off",), keys, f"{system} / off") for system in systems[1:]]
    report = finish_rounds("spec_decode", args.out, runs, metrics, ratios, vars(args),
                           {"dtype": engines["off"].engine.dtype, "identical_outputs": sum(same) / len(same)})
    print(f"identical outputs with and without speculation: {sum(same)} of {len(same)}")
    if args.draft_model:
        print_ratio(report, "draft / off", "tpot_ms_b1", "TPOT at batch 1, draft / off", "< 1")
    print_ratio(report, "ngram / off", "tpot_ms_b1", "TPOT at batch 1, ngram / off", "<= 0.667 (1.5x lower)")
    return report


if __name__ == "__main__":
    main()
