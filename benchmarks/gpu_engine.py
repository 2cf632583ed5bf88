"""Benchmark 5 (CUDA GPU): every engine figure of the GPU goals in one run, on a Qwen3-0.6B-shaped
random-weight model in bfloat16 (in-process ``LLM``, no Ray).

Sections (each prints its table; one JSON holds them all):

1. ``throughput``: the nano-vllm shape: 256 sequences, prompt and output lengths uniform in
   [100, 1024] (fixed seed, random token ids), ignore EOS, greedy, CUDA-graph decode (the default).
   Output tokens/s, median [min-max] of ``--rounds`` rounds, with the synchronous engine and with
   async scheduling (``async_scheduling``: step N+1 scheduled while step N runs), interleaved;
   the ratio says whether async scheduling pays. Goal on an H100: >= 15,000.
2. ``batch1``: one 128-token prompt decoding 128 tokens: milliseconds per decode step (whole step:
   schedule, inputs, forward, sampling), graphs vs the same engine with its graphs switched off
   (what ``enforce_eager`` runs), interleaved rounds. Goal: <= 2.5 ms.
3. ``busy``: GPU busy fraction of batch-256 decode: torch.profiler device time / wall time of a
   generate of 256 x 64-token prompts x 64 tokens (graphs and eager), and the replay time of the
   256-row graph alone / the wall time of a decode step. Goal: >= 80%.
4. ``vs_hf``: the peer in the same script: transformers continuous batching (``generate_batch``'s
   manager, at its defaults) against pagedray on the same smaller workload (``--hf-seqs`` sequences,
   lengths in [100, 256]), interleaved rounds; each HF round has a time limit (``--hf-max-s``) so the
   script always prints both (a round past it is recorded as an error).
5. ``prefill_kernel``: the paged prefill kernel at its defaults against torch SDPA (flash) at 4k, 8k
   and 16k-token chunks, with and without a history as long as the chunk (``benchmarks.kernels``'
   ``bench_prefill``). Goal: >= 1.25x.
Start-up facts: CUDA-graph capture time, graph memory, buckets; KV blocks.

``--dry-run``: a tiny Qwen3-shaped model on CPU in float32 (no graphs, no profiler, no prefill kernel
section), to check the plumbing where there is no GPU; its numbers mean nothing.

Usage: ``python -m benchmarks.gpu_engine [--dry-run] [--rounds 3] [--skip-hf] [--num-seqs 256] [--out PATH]``
(``--num-seqs`` shrinks the throughput section for a smoke run; its figure then is not the goal's shape)
(about 4 minutes on an H200, 2026-11-25: docs/gpu.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import rounds
from benchmarks.common import add_round_args, finish_rounds, hf_continuous_batching, print_run, write_json

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
FULL = dict(shape=QWEN3_0_6B, dtype="bfloat16", device="cuda", num_seqs=256, low=100, high=1024, hf_low=100,
            hf_high=256, batch1_prompt=128, batch1_tokens=128, busy_seqs=256, busy_prompt=64, busy_tokens=64,
            max_num_seqs=256, max_num_batched_tokens=16384)
DRY = dict(shape=TINY, dtype="float32", device="cpu", num_seqs=8, low=8, high=32, hf_low=8, hf_high=16,
           batch1_prompt=16, batch1_tokens=8, busy_seqs=4, busy_prompt=8, busy_tokens=4, max_num_seqs=8,
           max_num_batched_tokens=512)


ASYNC_SCHEDULING = "pagedray_async"


def save_random_qwen3(folder: str, shape: dict, dtype) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, bos_token_id=0, eos_token_id=1)).to(dtype)
    model.save_pretrained(folder)


def workload(num: int, low: int, high: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]
    outputs = [rng.randint(low, high) for _ in range(num)]
    return prompts, outputs


class Engine:
    """One in-process LLM whose decode graphs can be switched off and on between runs."""

    def __init__(self, folder: str, cfg: dict, gpu_memory_utilization: float) -> None:
        from pagedray.cluster import LLM

        self.llm = LLM(folder, dtype=cfg["dtype"], device=cfg["device"], max_num_seqs=cfg["max_num_seqs"],
                       max_num_batched_tokens=cfg["max_num_batched_tokens"],
                       gpu_memory_utilization=gpu_memory_utilization)
        self.worker = self.llm.engine.executor.worker
        self.graphs = self.worker.runner.decode_graphs

    def set_graphs(self, on: bool) -> None:
        self.worker.runner.decode_graphs = self.graphs if on else None

    def set_async_scheduling(self, on: bool) -> None:
        self.llm.engine.set_async_scheduling(on)

    def generate(self, prompts, max_tokens) -> dict:
        from pagedray.cluster import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
        steps_before = self.llm.engine.stats().num_steps_total
        start = time.perf_counter()
        results = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(r.outputs[0].token_ids) for r in results)
        steps = self.llm.engine.stats().num_steps_total - steps_before
        return {"seconds": seconds, "output_tokens": produced, "output_tok_s": produced / seconds, "steps": steps}

    def startup(self) -> dict:
        report = self.worker.graph_report
        facts = {"kv_blocks": self.llm.engine.stats().num_blocks}
        if report is not None:
            facts.update(capture_s=report.seconds, graph_mib=report.graph_bytes / 2**20,
                         buckets=list(report.buckets))
        return facts

    def shutdown(self) -> None:
        self.llm.shutdown()
        self.graphs = self.worker = None      # the graphs hold the KV cache: the next engine needs the memory
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def batch1_ms_per_step(engine: Engine, cfg: dict, graphs: bool) -> dict:
    """(time to generate N+1 tokens - time to generate 1) / N: the decode steps alone."""
    engine.set_graphs(graphs)
    prompt = [[(7 * i) % 1000 + 2 for i in range(cfg["batch1_prompt"])]]
    n = cfg["batch1_tokens"]
    engine.generate(prompt, [2])                                        # warm-up: the first call compiles
    one = engine.generate(prompt, [1])["seconds"]
    many = engine.generate(prompt, [n + 1])["seconds"]
    engine.set_graphs(True)
    return {"ms_per_step": (many - one) / n * 1e3}


def device_seconds(profiler) -> float:
    """Summed duration of the device-side events (kernels, copies) of a torch.profiler run, seconds.

    Only events that run on the device are counted: a CPU op's own device time is the sum of its
    kernels, which are listed as device events too (summing both would count every kernel twice)."""
    from torch.autograd import DeviceType

    total_us = sum(event.device_time_total for event in profiler.events() if event.device_type == DeviceType.CUDA)
    return total_us / 1e6


def busy_fraction(engine: Engine, cfg: dict, graphs: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine.set_graphs(graphs)
    prompts, _ = workload(cfg["busy_seqs"], cfg["busy_prompt"], cfg["busy_prompt"], cfg["shape"]["vocab_size"], 7)
    outputs = [cfg["busy_tokens"]] * len(prompts)
    engine.generate(prompts[:2], [2, 2])                               # warm-up outside the profile
    row = {"graphs": graphs}
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run = engine.generate(prompts, outputs)
        row.update(wall_s=run["seconds"], device_s=device_seconds(prof),
                   busy_pct=100.0 * device_seconds(prof) / run["seconds"], steps=run["steps"])
    else:
        run = engine.generate(prompts, outputs)
        row.update(wall_s=run["seconds"], steps=run["steps"])
    row["wall_ms_per_step"] = run["seconds"] / max(1, run["steps"]) * 1e3
    engine.set_graphs(True)
    return row


def replay_ms(engine: Engine, bucket: int, repeats: int = 20) -> float | None:
    """GPU time of one replay of ``bucket``'s graph (back-to-back replays, synchronised once)."""
    graphs = engine.graphs
    if graphs is None or bucket not in graphs.graphs:
        return None
    graph = graphs.graphs[bucket]
    padding = graphs.host_batch([], bucket)
    graphs.static[:padding.shape.size].copy_(padding.packed)
    graph.replay()
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    _sync()
    return (time.perf_counter() - start) / repeats * 1e3


def prefill_kernel_rows() -> list[dict]:
    import torch

    from benchmarks.kernels import FULL as KERNEL_SHAPES
    from benchmarks.kernels import bench_prefill

    rows = []
    for tokens in KERNEL_SHAPES["prefill_tokens"]:
        for history in (0, tokens):
            rows.append(bench_prefill(tokens, history, "bfloat16", KERNEL_SHAPES, torch.device("cuda"), True))
            torch.cuda.empty_cache()
    return rows


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def run_throughput(engine: Engine, cfg: dict, num_rounds: int, out: str, **pace) -> dict:
    prompts, outputs = workload(cfg["num_seqs"], cfg["low"], cfg["high"], cfg["shape"]["vocab_size"])
    engine.generate(prompts[:2], [4, 4])                                # warm-up

    def run(system: str, _round: int) -> dict:
        engine.set_async_scheduling(system == ASYNC_SCHEDULING)
        try:
            return engine.generate(prompts, outputs)
        finally:
            engine.set_async_scheduling(False)

    runs = rounds.run_rounds(["pagedray", ASYNC_SCHEDULING], num_rounds, run, on_run=print_run, **pace)
    metrics = [rounds.Metric("output_tok_s", "output tok/s"), rounds.Metric("seconds", higher_is_better=False)]
    ratios = [rounds.Ratio(ASYNC_SCHEDULING, ("pagedray",), label="async / synchronous")]
    return finish_rounds("gpu_throughput", out, runs, metrics, ratios, {**cfg, "shape": "qwen3-0.6b"})


def run_batch1(engine: Engine, cfg: dict, num_rounds: int, out: str, **pace) -> dict:
    measure = {"graphs": lambda: batch1_ms_per_step(engine, cfg, True),
               "eager": lambda: batch1_ms_per_step(engine, cfg, False)}
    runs = rounds.run_rounds(list(measure), num_rounds, lambda s, i: measure[s](), on_run=print_run, **pace)
    metrics = [rounds.Metric("ms_per_step", "ms per decode step", higher_is_better=False)]
    ratios = [rounds.Ratio("graphs", ("eager",), label="graphs / eager")]
    return finish_rounds("gpu_batch1", out, runs, metrics, ratios, {"prompt": cfg["batch1_prompt"],
                                                                      "tokens": cfg["batch1_tokens"]})


def run_vs_hf(folder: str, cfg: dict, num_rounds: int, hf_seqs: int, hf_max_s: float, out: str, **pace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    prompts, outputs = workload(hf_seqs, cfg["hf_low"], cfg["hf_high"], cfg["shape"]["vocab_size"], seed=1)
    engine = Engine(folder, cfg, gpu_memory_utilization=0.5)            # leaves room for the peer's cache
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, cfg["dtype"]))
    model = model.to(cfg["device"]).eval()
    try:
        engine.generate(prompts[:2], [4, 4])

        def hf() -> dict:
            result = hf_continuous_batching(model, prompts, outputs, pad_token_id=0, timeout_s=hf_max_s,
                                            deadline_s=hf_max_s)
            return {**result, "output_tok_s": result["output_tokens"] / result["seconds"]}

        measure = {"pagedray": lambda: engine.generate(prompts, outputs), "hf_generate_batch": hf}
        runs = rounds.run_rounds(list(measure), num_rounds, lambda s, i: measure[s](),
                                 catch=(RuntimeError, TimeoutError), on_run=print_run, **pace)
    finally:
        engine.shutdown()
    metrics = [rounds.Metric("output_tok_s", "output tok/s")]
    ratios = [rounds.Ratio("pagedray", ("hf_generate_batch",), label="pagedray / HF continuous batching")]
    return finish_rounds("gpu_vs_hf", out, runs, metrics, ratios,
                         {"num_seqs": hf_seqs, "low": cfg["hf_low"], "high": cfg["hf_high"], "hf_max_s": hf_max_s})


def print_rows(rows: list[dict], columns: list[str]) -> None:
    from benchmarks.common import print_table

    print_table(rows, columns)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"need an integer >= 1, got {text}")
    return value


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-seqs", type=int, default=16)
    parser.add_argument("--hf-max-s", type=float, default=120.0, help="time limit of one HF round, seconds")
    parser.add_argument("--num-seqs", type=_positive_int, default=None,
                        help="sequences of the throughput section (default: 256, the nano-vllm shape)")
    add_round_args(parser, "gpu")
    args = parser.parse_args()
    if args.dry_run:
        cfg = DRY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.gpu_engine needs a CUDA GPU (use --dry-run to check the script on CPU)")
        cfg = FULL
    if args.num_seqs is not None:
        cfg = {**cfg, "num_seqs": args.num_seqs}
    stem = args.out.removesuffix(".json")
    # a dry run checks the plumbing: no waiting for the load average to settle on a busy CI machine
    pace = {"sleep": (lambda _seconds: None) if args.dry_run else time.sleep}
    report = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if cfg["device"] == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory(prefix="pagedray-qwen3-") as folder:
        save_random_qwen3(folder, cfg["shape"], getattr(torch, cfg["dtype"]))
        engine = Engine(folder, cfg, gpu_memory_utilization=0.9)
        try:
            section("start-up")
            report["startup"] = engine.startup()
            print(report["startup"])
            section(f"throughput: {cfg['num_seqs']} sequences (goal on an H100: >= 15,000 output tok/s)")
            throughput = run_throughput(engine, cfg, args.rounds, f"{stem}_throughput.json", **pace)
            report["throughput"] = throughput["summary"]
            section("batch-1 decode: ms per step (goal: <= 2.5 ms)")
            report["batch1"] = run_batch1(engine, cfg, args.rounds, f"{stem}_batch1.json", **pace)["summary"]
            section(f"busy fraction of batch-{cfg['busy_seqs']} decode (goal: >= 80%)")
            busy = [busy_fraction(engine, cfg, graphs) for graphs in (True, False)]
            replay = replay_ms(engine, cfg["max_num_seqs"])
            for row in busy:
                if replay is not None:
                    row["replay_ms"] = replay
                    row["replay_pct_of_step"] = 100.0 * replay / row["wall_ms_per_step"]
            print_rows(busy, ["graphs", "wall_s", "steps", "wall_ms_per_step", "device_s", "busy_pct", "replay_ms",
                              "replay_pct_of_step"])
            report["busy"] = busy
        finally:
            engine.shutdown()
        if not args.skip_hf:
            section(f"pagedray vs transformers continuous batching, {args.hf_seqs} sequences")
            report["vs_hf"] = run_vs_hf(folder, cfg, args.rounds, args.hf_seqs, args.hf_max_s,
                                        f"{stem}_vs_hf.json", **pace)["summary"]
    if not args.dry_run:
        section("prefill kernel vs torch SDPA (goal: >= 1.25x at 4k-16k)")
        report["prefill_kernel"] = prefill_kernel_rows()
        print_rows(report["prefill_kernel"], ["tokens", "history", "ms", "tflops", "sdpa_ms", "sdpa_backend",
                                              "speedup_vs_sdpa"])
    report["environment"] = rounds.environment()
    write_json("gpu", report, args.out)
    _summary(report)


def _summary(report: dict) -> None:
    def median(summary, system, metric):
        value = (summary or {}).get("systems", {}).get(system, {}).get(metric)
        return None if value is None else value["median"]

    section("summary")
    print(f"throughput: {rounds.fmt(median(report.get('throughput'), 'pagedray', 'output_tok_s'))} output tok/s "
          f"(async scheduling: {rounds.fmt(median(report.get('throughput'), ASYNC_SCHEDULING, 'output_tok_s'))})")
    print(f"batch-1 decode: {rounds.fmt(median(report.get('batch1'), 'graphs', 'ms_per_step'))} ms per step "
          f"(eager {rounds.fmt(median(report.get('batch1'), 'eager', 'ms_per_step'))})")
    graphs_busy = next((r for r in report.get("busy", []) if r["graphs"]), {})
    print(f"busy fraction (graphs): {rounds.fmt(graphs_busy.get('busy_pct'))}% by the profiler, "
          f"{rounds.fmt(graphs_busy.get('replay_pct_of_step'))}% by graph replay / step")
    ratio = (report.get("vs_hf") or {}).get("ratios", {}).get("pagedray / HF continuous batching", {})
    value = ratio.get("output_tok_s") if ratio else None
    if value:
        print(f"vs HF continuous batching: {value['median']:.2f}x [{value['min']:.2f}-{value['max']:.2f}]")
    speedups = [r["speedup_vs_sdpa"] for r in report.get("prefill_kernel", [])]
    if speedups:
        print(f"prefill kernel vs SDPA: {min(speedups):.2f}x-{max(speedups):.2f}x "
              f"(median {statistics.median(speedups):.2f}x)")


if __name__ == "__main__":
    main()
