"""Embeddings: pagedray's ``LLM.embed`` against sentence-transformers' ``encode`` on the same CPU (#66).

Workload: ``--num`` inputs (default 1,000) of 64-512 tokens (random words from a fixed seed, other texts in each
round: an embedding job embeds a text once, and pagedray's prefix cache would serve a text seen before), embedded
with last-token pooling and L2 normalization, one call each run. Systems, interleaved over rounds:
- ``pagedray``: ``LLM.embed`` in float32 (the vectors compare with the peer's), the engine's defaults otherwise;
- ``pagedray-default``: the same at pagedray's default dtype (bfloat16 on CPUs with AVX512-BF16 or AMX);
- ``sentence-transformers``: ``encode`` with batch 32 (the issue's setting; its default too) in float32 (its
  default), run by its own venv's Python (``st_encode_run.py``; ``python -m benchmarks.embeddings install``
  makes the venv beside vLLM's, with this environment's torch and transformers).
Model loading is outside the timing; each system warms up once. Reports inputs/s and input tokens/s (median
[min-max] of the rounds, load average per run), the ratios, and the cosine of pagedray's vectors with the peer's
(min and median over the inputs, first round). Goal: >= 1.5x sentence-transformers' inputs/s with equal vectors.

    python -m benchmarks.embeddings install
    python -m benchmarks.embeddings --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks.common import add_round_args, finish_rounds, make_prompts, print_ratio, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

ST_VERSION = "6.2.0"
BATCH = 32
SYSTEMS = ("pagedray", "pagedray-default", "sentence-transformers")


def st_venv() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "pagedray-peers" / "sentence-transformers"
    return pathlib.Path(os.environ.get("PAGEDRAY_ST_VENV", default))


def install() -> None:
    """The peer's venv: this environment's packages (torch, transformers) plus sentence-transformers."""
    python = st_venv() / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(st_venv())], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"sentence-transformers=={ST_VERSION}"], check=True)


def make_texts(num: int, seed: int, tokenizer, low: int = 64, high: int = 512) -> list[str]:
    """``num`` texts of random words whose token counts lie in [low, high] (drawn, then cut to their target)."""
    import random

    rng = random.Random(seed)
    texts = []
    for words in make_prompts(num, high, high, seed):
        target = rng.randint(low, high)
        ids = tokenizer(words).input_ids[:target]
        texts.append(tokenizer.decode(ids))
    return texts


def run_peer(args, texts: list[str], warm_up: list[str], vectors: bool) -> dict:
    from benchmarks.st_encode_run import RESULT_PREFIX

    python = st_venv() / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no sentence-transformers venv at {st_venv()}: "
                           "run `python -m benchmarks.embeddings install`")
    job = {"model": args.model, "texts": texts, "warm_up": warm_up, "batch_size": BATCH, "pooling": "lasttoken",
           "vectors": vectors}
    done = subprocess.run([str(python), str(pathlib.Path(__file__).with_name("st_encode_run.py"))],
                          input=json.dumps(job), capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"sentence-transformers run failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def cosines(ours: list[list[float]], theirs: list[list[float]]) -> list[float]:
    import torch

    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).tolist()


def main(argv: list[str] | None = None) -> dict | None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["install"]:
        install()
        return None
    parser = argparse.ArgumentParser(prog="benchmarks.embeddings", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "embeddings")
    parser.add_argument("--model", default="default")
    parser.add_argument("--num", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    from pagedray.cluster import LLM
    from pagedray.workers.weights.default_model import resolve_model_path
    from transformers import AutoTokenizer

    args.model = str(resolve_model_path(args.model))
    systems = tuple(args.systems.split(","))
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: {unknown} are not among {list(SYSTEMS)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # each round its own texts (the same for every system in it): pagedray's prefix cache would serve texts it
    # embedded before, and an embedding job embeds each text once
    texts_of = [make_texts(args.num, args.seed + r, tokenizer) for r in range(args.rounds)]
    warm_up = make_texts(BATCH, args.seed + 10_000, tokenizer)
    lengths_of = [[len(tokenizer(t).input_ids) for t in texts] for texts in texts_of]
    lengths = [n for per_round in lengths_of for n in per_round]
    llms = {"pagedray": {"dtype": "float32"}, "pagedray-default": {}}
    engines: dict[str, LLM] = {}
    vectors: dict[str, list[list[float]]] = {}

    def measure(system: str, round_index: int) -> dict:
        texts = texts_of[round_index]
        if system == "sentence-transformers":
            result = run_peer(args, texts, warm_up, vectors=round_index == 0)
            seconds = result["seconds"]
            if round_index == 0:
                vectors[system] = result["vectors"]
        else:
            if system not in engines:       # loaded once, outside the timing, and warmed up
                engines[system] = LLM(args.model, **llms[system])
                engines[system].embed(warm_up, use_tqdm=False)
            start = time.perf_counter()
            results = engines[system].embed(texts, use_tqdm=False)
            seconds = time.perf_counter() - start
            if round_index == 0:
                vectors[system] = [r.embedding for r in results]
        return {"inputs_s": len(texts) / seconds, "tokens_s": sum(lengths_of[round_index]) / seconds}

    runs = run_rounds(systems, args.rounds, measure, on_run=print_run)
    for engine in engines.values():
        engine.shutdown()
    similarity = {}
    if "sentence-transformers" in vectors:
        for system in ("pagedray", "pagedray-default"):
            if system in vectors:
                values = cosines(vectors[system], vectors["sentence-transformers"])
                similarity[system] = {"min": min(values), "median": statistics.median(values)}
                print(f"cosine {system} vs sentence-transformers: min {min(values):.7f}, "
                      f"median {statistics.median(values):.7f}")
    metrics = [Metric("inputs_s", "inputs/s"), Metric("tokens_s", "input tok/s")]
    ratios = [Ratio(s, ("sentence-transformers",), ("inputs_s",), f"{s} / sentence-transformers")
              for s in ("pagedray", "pagedray-default") if s in systems and "sentence-transformers" in systems]
    config = {**vars(args), "batch_size": BATCH, "tokens_min": min(lengths), "tokens_max": max(lengths),
              "tokens_mean": statistics.mean(lengths), "sentence_transformers": ST_VERSION}
    report = finish_rounds("embeddings", args.out, runs, metrics, ratios, config, {"cosine": similarity})
    for ratio in ratios:
        print_ratio(report, ratio.label, "inputs_s", f"inputs/s, {ratio.label}", ">= 1.5x")
    return report


if __name__ == "__main__":
    main()
