"""Shared helpers of the benchmark scripts: seeded workloads, timing, table printing, JSON output, and the
command-line and output plumbing of the interleaved comparisons (``benchmarks.rounds``).

Benchmarks are scripts (``python -m benchmarks.<name>`` or ``python benchmarks/<name>.py`` from the repo
root), never timed tests. Each compares against a peer run in the same script and writes
``benchmarks/results/<name>.json`` (path relative to the current directory) with the machine description.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import pathlib
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator

from benchmarks import rounds

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
    """``rounds.environment()`` (CPUs, platform, Python, date, commit) plus torch and the GPU if any."""
    info = rounds.environment()
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


def write_json(name: str, payload: dict, path: str | os.PathLike | None = None) -> pathlib.Path:
    """``payload`` with ``machine()`` to ``path`` (default ``benchmarks/results/<name>.json``)."""
    return _write(path or pathlib.Path("benchmarks/results") / f"{name}.json", {"machine": machine(), **payload})


def _write(path: str | os.PathLike, data: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
    return path


def _rounds_arg(text: str) -> int:
    try:
        return rounds.check_rounds(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_round_args(parser: argparse.ArgumentParser, name: str) -> None:
    """``--rounds`` (>= 3, default 3) and ``--out`` (default ``benchmarks/results/<name>.json``)."""
    parser.add_argument("--rounds", type=_rounds_arg, default=rounds.MIN_ROUNDS,
                        help="interleaved rounds (>= 3); the order of the systems alternates between rounds")
    parser.add_argument("--out", default=f"benchmarks/results/{name}.json", help="JSON report path")


def print_run(run: rounds.Run) -> None:
    """Progress line for ``rounds.run_rounds(on_run=...)``."""
    values = ", ".join(f"{k}={rounds.fmt(v)}" for k, v in run.values.items())
    status = f"error: {run.error}" if run.error else values
    print(f"[round {run.round}] {run.system}: {status} (load {run.load_before[0]:.2f} -> {run.load_after[0]:.2f})",
          flush=True)


def finish_rounds(name: str, out: str, runs: list[rounds.Run], metrics: list[rounds.Metric],
                  ratios: list[rounds.Ratio], config: dict, extra: dict | None = None) -> dict:
    """Print ``rounds.format_table`` and write ``rounds.report`` (plus ``machine()`` and ``extra``) to ``out``."""
    cpus = os.cpu_count() or 1
    print(rounds.format_table(runs, metrics, ratios, cpus))
    features = rounds.cpu_features()
    print(f"cpu: {rounds.cpu_model()}, {cpus} CPUs, AMX {'yes' if features['amx'] else 'no'} "
          f"({' '.join(features['cpu_flags']) or 'none of ' + ' '.join(rounds.NOTED_CPU_FLAGS)})")
    report = {**rounds.report(name, runs, metrics, ratios, cpus, config), **(extra or {})}
    report["environment"] = machine()  # rounds' environment plus torch and the GPU
    _write(out, report)
    return report


def print_ratio(report: dict, ratio: str, metric: str, label: str, goal: str, digits: int = 2) -> None:
    """One line with a ratio's median [min-max] from a ``finish_rounds`` report (nothing when it has no value)."""
    value = report["summary"]["ratios"][ratio][metric]
    if value is not None:
        print(f"{label}: {value['median']:.{digits}f}x [{value['min']:.{digits}f}-{value['max']:.{digits}f}] "
              f"(goal {goal})")


def hf_cache_kwargs(model, cache) -> dict:
    """The keyword a transformers model's forward takes its KV cache by, with ``cache``: ``cache`` from
    transformers 5.25 on (where ``past_key_values`` is deprecated, to go in 5.40), ``past_key_values`` before."""
    takes_cache = "cache" in inspect.signature(getattr(model, "forward", model)).parameters
    return {"cache" if takes_cache else "past_key_values": cache}


def hf_returned_cache(output):
    """The KV cache a transformers forward returned (``cache`` from 5.25 on, ``past_key_values`` before)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def hf_continuous_batching(model, token_id_prompts: list[list[int]], max_tokens: list[int], pad_token_id: int,
                           timeout_s: float, deadline_s: float | None = None) -> dict:
    """Greedy generation through transformers' continuous-batching manager (the ``generate_batch``
    engine): every request added at once, timed until the last one finishes. ``deadline_s``: a time
    limit for the whole run (TimeoutError past it, so a slow peer cannot hold a benchmark forever)."""
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
            limit = float("inf") if deadline_s is None else deadline_s
            while done < len(token_id_prompts):
                left = limit - (time.perf_counter() - t.start)
                result = manager.get_result(timeout=min(timeout_s, left)) if left > 0 else None
                if result is None and time.perf_counter() - t.start >= limit:
                    raise TimeoutError(f"HF continuous batching: {done} of {len(token_id_prompts)} requests "
                                       f"finished within the {deadline_s:g} s limit")
                if result is None:
                    raise RuntimeError("HF continuous batching stopped returning results")
                if result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
    finally:
        manager.stop(block=True)
    return {"seconds": t.seconds, "output_tokens": produced}


REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("block_manager", "kernels", "workers", "cluster", "deploy")


@contextlib.contextmanager
def ref_import_root(ref: str) -> Iterator[pathlib.Path]:
    """A folder whose ``pagedray/`` holds git commit REF's packages (a worktree of REF linked in): put it
    first on PYTHONPATH and a process imports REF's code (and builds REF's C kernels). Removed on exit."""
    with tempfile.TemporaryDirectory(prefix="pagedray-ref-") as scratch:
        tree = pathlib.Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
        try:
            root = pathlib.Path(scratch) / "root" / "pagedray"
            root.mkdir(parents=True)
            for package in PACKAGES:
                (root / package).symlink_to(tree / package)
            yield root.parent
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
