"""KV block transfer between replicas: pulling a cached prefix against computing it, and the bytes' rate
against this machine's memory copy bandwidth (issue #65's primitive, cluster/kv_transfers.py).

Two engines in one process (the default model, one local rank each), a source and a target. For each prefix
length, two systems, interleaved over ``--rounds`` rounds (``benchmarks.rounds``), each run on a fresh random
prefix that the target has never seen:
- ``prefill L``: the target computes the prompt (the prefix + 8 tokens) and samples one token: its TTFT.
- ``pull L``: the source computes the prefix first (not timed), then the target pulls it: the source exports
  the blocks, each rank's shard goes through the Ray object store (``ray.put`` / ``ray.get``, as between two
  Serve replicas), the target imports them, then runs the same prompt: TTFT from the export call to the first
  token. Its parts are kept: export, object store, import, the prompt's own step.

The transfer rate is the shard bytes over export + import seconds, against a ``torch`` copy of as many bytes
(``memcpy``, median of 5) measured in the same run. The prefill / pull TTFT ratio per length shows where a pull
starts to pay (the break-even length).

Usage: ``python -m benchmarks.kv_transfer [--rounds 3] [--lengths 512,2048,6144] [--dtype auto]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

TAIL = 8   # prompt tokens after the prefix (the request's own part)
METRICS = [Metric("ttft_s", "TTFT s", higher_is_better=False),
           Metric("export_s", "export s", higher_is_better=False),
           Metric("object_store_s", "object store s", higher_is_better=False),
           Metric("import_s", "import s", higher_is_better=False),
           Metric("transfer_gb_s", "export+import GB/s"),
           Metric("memcpy_ratio", "rate / memcpy")]


def _systems(lengths: list[int]) -> list[str]:
    return [f"{kind} {length}" for length in lengths for kind in ("pull", "prefill")]


def _ratios(lengths: list[int]) -> list[Ratio]:
    return [Ratio(f"prefill {length}", (f"pull {length}",), ("ttft_s",), f"TTFT prefill / pull at {length}")
            for length in lengths]


def _memcpy_gb_s(num_bytes: int) -> float:
    import torch

    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return num_bytes / statistics.median(times) / 1e9


def _first_token_s(engine, request_id: str, prompt: list[int], params) -> tuple[float, int]:
    started = time.perf_counter()
    engine.add(request_id, prompt, params)
    elapsed, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = max(cached, out.num_cached_prompt_tokens)
            if elapsed is None and out.outputs and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - started
    return elapsed, cached


class Bench:
    def __init__(self, dtype: str, vocab_top: int) -> None:
        from pagedray.cluster import LLM, SamplingParams

        self.source = LLM("default", dtype=dtype, max_num_batched_tokens=2048)
        self.target = LLM("default", dtype=dtype, max_num_batched_tokens=2048)
        self.params = SamplingParams(max_tokens=1, temperature=0)
        self.vocab_top = vocab_top
        self.count = 0

    def _prompt(self, length: int) -> list[int]:
        self.count += 1
        rng = random.Random(self.count * 7919)
        return [rng.randrange(100, self.vocab_top) for _ in range(length + TAIL)]

    def measure(self, system: str) -> dict:
        import ray

        kind, length = system.split()
        prompt = self._prompt(int(length))
        target = self.target.engine
        if kind == "prefill":
            ttft, cached = _first_token_s(target, f"prefill-{self.count}", prompt, self.params)
            assert cached == 0, cached
            return {"ttft_s": ttft}
        source = self.source.engine
        _first_token_s(source, f"source-{self.count}", prompt[:int(length)] + [5], self.params)   # not timed
        started = time.perf_counter()
        export = source.export_prefix(prompt[:int(length)])
        exported = time.perf_counter()
        refs = [ray.put(shard) for shard in export.shards]
        export.shards = ray.get(refs)
        fetched = time.perf_counter()
        moved = target.import_prefix(export)
        imported = time.perf_counter()
        ttft, cached = _first_token_s(target, f"pull-{self.count}", prompt, self.params)
        assert moved == cached == export.num_blocks * export.layout.block_size > 0, (moved, cached)
        num_bytes = sum(len(shard) for shard in export.shards)
        rate = num_bytes / ((exported - started) + (imported - fetched)) / 1e9
        return {"ttft_s": imported - started + ttft, "export_s": exported - started,
                "object_store_s": fetched - exported, "import_s": imported - fetched, "transfer_gb_s": rate,
                "memcpy_ratio": rate / _memcpy_gb_s(num_bytes), "bytes": num_bytes, "blocks": export.num_blocks}

    def shutdown(self) -> None:
        self.source.shutdown()
        self.target.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "kv_transfer")
    parser.add_argument("--lengths", default="512,2048,6144", help="prefix lengths in tokens, comma-separated")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    bench = Bench(args.dtype, vocab_top=40000)
    try:
        runs = run_rounds(_systems(lengths), args.rounds, lambda system, _round: bench.measure(system),
                          on_run=print_run)
    finally:
        bench.shutdown()
        ray.shutdown()
    ratios = _ratios(lengths)
    report = finish_rounds("kv_transfer", args.out, runs, METRICS, ratios, vars(args), {"tail_tokens": TAIL})
    return report


if __name__ == "__main__":
    main()
