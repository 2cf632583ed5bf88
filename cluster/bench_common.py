"""Shared helpers of the benchmark scripts: seeded workloads, timing, table printing, JSON output.

Benchmarks are scripts (``python -m pagedray.cluster.bench_*``), never timed tests. Each compares
against a peer run in the same script and writes ``bench_results/<name>.json`` (path relative to the
current directory) with the machine description.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import random
import time

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact be have do say get make go know take see "
         "come think look want give use find tell ask seem feel try leave call good new first last long "
         "great little own other old right big high different small large next early young important "
         "few public bad same able river mountain city garden music paper window light water story table "
         "system program question night morning power money friend house school country market").split()


def make_prompts(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(num)]


def make_max_tokens(num: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(low, high) for _ in range(num)]


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)


def write_json(name: str, payload: dict) -> pathlib.Path:
    out_dir = pathlib.Path("bench_results")
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    print(f"wrote {path}")
    return path


def hf_continuous_batching(model, token_id_prompts: list[list[int]], max_tokens: list[int], pad_token_id: int,
                           timeout_s: float) -> dict:
    """Greedy generation through transformers' continuous-batching manager (the ``generate_batch``
    engine): every request added at once, timed until the last one finishes."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None,
                              pad_token_id=pad_token_id)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    produced = 0
    try:
        with Timer() as t:
            for i, (ids, m) in enumerate(zip(token_id_prompts, max_tokens)):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
            done = 0
            while done < len(token_id_prompts):
                result = manager.get_result(timeout=timeout_s)
                if result is None:
                    raise RuntimeError("HF continuous batching stopped returning results")
                if result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
    finally:
        manager.stop(block=True)
    return {"seconds": t.seconds, "output_tokens": produced}
