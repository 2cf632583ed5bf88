"""A light tenant next to one flooding long prompts: FIFO against fair share (#64 part 3):
``python -m benchmarks.fairness [--light 16] [--rounds 3] [--dry-run]``

Workload (fixed seed, token ids, greedy, EOS ignored), on the offline engine in this process (the model at its
default dtype), its steps run back to back on the wall clock:
- the light tenant sends ``--light`` requests of ``--light-tokens`` prompt tokens, one every
  ``--light-interval-s``, each generating ``--max-tokens``;
- the flood tenant keeps ``--flood-queue`` prompts of ``--flood-tokens`` tokens waiting at every moment of the
  run (each generating ``--max-tokens``), so the KV pool and every step's token budget are always wanted.

Systems, interleaved by rounds, each in a fresh engine: ``solo`` (the light tenant alone), ``fifo`` (both, no
tenants: today's queue order) and ``fair`` (both, as tenants of equal weight: cluster/fair_share.py); with
``--max-prefill-tokens N`` also ``fair-capped`` (``fair`` with the engine option ``max_prefill_tokens`` N: a
step's prompt tokens stop at N, handed out in fair order, so the step in flight when a light request arrives
is short and its own step carries no flood prompt tokens).
``--max-num-batched-tokens`` is the step budget of all three (the engine's default unless given). With
``--vllm``, the peer too: ``vllm-solo`` and ``vllm-fifo``, vLLM for CPU's engine driven the same way in its own
venv (``vllm_fairness_run.py``; it has no tenants, so FIFO is what it offers), at its defaults (on a 2-core
VM it keeps a core for its front end); ``--vllm-tuning`` adds ``vllm-bind-solo`` and ``vllm-bind-fifo``, its
first tuning (``VLLM_CPU_OMP_THREADS_BIND`` over every core). ``--systems`` runs a subset (the ratios between
the systems run). A flood prompt counts as waiting until its first token (the same rule for both engines).

Reported: the light tenant's TTFT (its request's arrival -> first token, ms) p50 and p99, the flood's
output tok/s (it depends on when the run ends: a run ends at the light tenant's last first token), and the
tokens the engine computed per second (prompt chunks and decodes of both tenants: what a smaller step costs;
pagedray's systems only); ratios fifo / solo and fair / solo (how many times the solo TTFT). The issue's goal:
fair's p99 <= 1.5x solo's.
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
PEER_SYSTEMS = ("vllm-solo", "vllm-fifo")
TUNED_PEER_SYSTEMS = ("vllm-bind-solo", "vllm-bind-fifo")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(system: str, args, vocab: int) -> dict:
    from pagedray.cluster import LLM, SamplingParams
    from pagedray.workers.contract.config import TenantConfig

    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    fair = system.startswith("fair")
    tenants = (TenantConfig("flood"), TenantConfig("light")) if fair else ()
    light_tenant, flood_tenant = ("light", "flood") if fair else (None, None)
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    if system == "fair-capped":
        extra["max_prefill_tokens"] = args.max_prefill_tokens
    with LLM(args.model, block_size=16, num_blocks=args.num_blocks, tenants=tenants, **extra) as llm:
        engine = llm.engine
        engine.add("warm-up", [rng.randrange(2, vocab) for _ in range(32)], params)
        while engine.has_unfinished_requests():
            engine.step()
        arrivals, first, flood_ids, flood_waiting, flood_tokens = {}, {}, set(), set(), 0
        computed_before = engine.stats().num_computed_tokens_total
        start = time.perf_counter()
        while len(first) < args.light:
            now = time.perf_counter() - start
            while len(arrivals) < args.light and now >= len(arrivals) * args.light_interval_s:
                rid = f"light-{len(arrivals)}"
                prompt = [rng.randrange(2, vocab) for _ in range(args.light_tokens)]
                engine.add(rid, prompt, params, tenant=light_tenant)
                arrivals[rid] = time.perf_counter()
            if system != "solo":
                for _ in range(args.flood_queue - len(flood_waiting)):
                    rid = f"flood-{len(flood_ids)}"
                    engine.add(rid, [rng.randrange(2, vocab) for _ in range(args.flood_tokens)], params,
                               tenant=flood_tenant)
                    flood_ids.add(rid)
                    flood_waiting.add(rid)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, len(arrivals) * args.light_interval_s - (time.perf_counter() - start)))
                continue
            for out in engine.step():
                got = sum(len(c.token_ids) for c in out.outputs)
                if out.request_id in arrivals and got and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
                if out.request_id in flood_ids:
                    flood_tokens += got
                    if got:
                        flood_waiting.discard(out.request_id)
        elapsed = time.perf_counter() - start
        computed = engine.stats().num_computed_tokens_total - computed_before
    ttfts = [1000 * (first[r] - arrivals[r]) for r in arrivals]
    return {"light_ttft_p50_ms": _percentile(ttfts, 0.5), "light_ttft_p99_ms": _percentile(ttfts, 0.99),
            "flood_tok_s": flood_tokens / elapsed, "computed_tok_s": computed / elapsed}


def measure_vllm(system: str, args, vocab: int) -> dict:
    """The workload on vLLM for CPU (``vllm_fairness_run.py`` in its venv, at its defaults)."""

    from benchmarks import vllm_cpu
    from benchmarks.vllm_fairness_run import RESULT_PREFIX

    job = {"model": args.model, "flood": system.endswith("-fifo"), "light": args.light,
           "light_tokens": args.light_tokens, "light_interval_s": args.light_interval_s,
           "flood_queue": args.flood_queue, "flood_tokens": args.flood_tokens, "max_tokens": args.max_tokens,
           "seed": args.seed, "vocab": vocab, "max_num_batched_tokens": args.max_num_batched_tokens,
           "gpu_memory_utilization": float(vllm_cpu.MEMORY_FRACTION)}
    result = vllm_cpu.run_job(Path(__file__).with_name("vllm_fairness_run.py"), job, system, RESULT_PREFIX,
                              timeout=1800)
    ttfts = result["ttfts_ms"]
    return {"light_ttft_p50_ms": _percentile(ttfts, 0.5), "light_ttft_p99_ms": _percentile(ttfts, 0.99),
            "flood_tok_s": result["flood_tok_s"]}


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
    parser.add_argument("--max-prefill-tokens", type=int, default=0,
                        help="also fair-capped: fair with this many prompt tokens per step (the engine option)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="also vLLM for CPU (vllm-solo, vllm-fifo), at its defaults")
    parser.add_argument("--vllm-tuning", action="store_true", help="also vLLM bound to every core (vllm-bind-*)")
    parser.add_argument("--systems", default=None, help="run only these systems (comma-separated)")
    parser.add_argument("--dry-run", action="store_true", help="3 light requests, small prompts: the plumbing")
    args = parser.parse_args(argv)
    from pagedray.workers.models.model_info import model_info
    from pagedray.workers.weights.default_model import resolve_model_path

    if args.dry_run:
        args.light, args.light_tokens, args.light_interval_s = 3, 16, 0.05
        args.flood_queue, args.flood_tokens, args.max_tokens, args.num_blocks = 2, 96, 4, 64
    args.model = str(resolve_model_path(args.model))
    vocab = model_info(args.model).vocab_size
    systems = (SYSTEMS + (("fair-capped",) if args.max_prefill_tokens else ()) + (PEER_SYSTEMS if args.vllm else ())
               + (TUNED_PEER_SYSTEMS if args.vllm_tuning else ()))
    if args.systems:
        chosen = args.systems.split(",")
        unknown = sorted(set(chosen) - set(systems))
        if unknown:
            parser.error(f"--systems: {unknown} are not among {list(systems)}")
        systems = tuple(s for s in systems if s in chosen)
    runs = run_rounds(systems, args.rounds, lambda system, _: (measure_vllm if system.startswith("vllm") else measure)(
        system, args, vocab), on_run=print_run)
    metrics = [Metric("light_ttft_p50_ms", "light TTFT p50 ms", higher_is_better=False),
               Metric("light_ttft_p99_ms", "light TTFT p99 ms", higher_is_better=False),
               Metric("flood_tok_s", "flood output tok/s"),
               Metric("computed_tok_s", "tokens computed/s")]
    ratios = [Ratio("fifo", ("solo",), ("light_ttft_p50_ms", "light_ttft_p99_ms"), "fifo / solo"),
              Ratio("fair", ("solo",), ("light_ttft_p50_ms", "light_ttft_p99_ms"), "fair / solo"),
              Ratio("fair", ("fifo",), ("flood_tok_s",), "fair / fifo"),
              Ratio("fair-capped", ("solo",), ("light_ttft_p50_ms", "light_ttft_p99_ms"), "fair-capped / solo"),
              Ratio("fair-capped", ("fair",), ("computed_tok_s",), "fair-capped / fair"),
              Ratio("fair-capped", ("fifo",), ("computed_tok_s",), "fair-capped / fifo")]
    ttft = ("light_ttft_p50_ms", "light_ttft_p99_ms")
    for peer in ("vllm", "vllm-bind"):
        ratios += [Ratio(f"{peer}-fifo", (f"{peer}-solo",), ttft, f"{peer}-fifo / {peer}-solo"),
                   Ratio("fair", (f"{peer}-fifo",), ttft, f"fair / {peer}-fifo"),
                   Ratio("fifo", (f"{peer}-fifo",), ttft, f"fifo / {peer}-fifo"),
                   Ratio("fair", (f"{peer}-fifo",), ("flood_tok_s",), f"fair / {peer}-fifo flood")]
    ratios = [r for r in ratios if r.system in systems and all(p in systems for p in r.peers)]
    out = "/dev/null" if args.dry_run and args.out == parser.get_default("out") else args.out
    report = finish_rounds("fairness", out, runs, metrics, ratios, vars(args))
    wanted = [("fair / solo", "<= 1.5x"), ("fair-capped / solo", "<= 1.5x"), ("fifo / solo", "none: today's FIFO"),
              ("fair / vllm-fifo", "< 1"),
              ("fair / vllm-bind-fifo", "< 1")]
    for name, goal in wanted:
        if name in report["summary"]["ratios"]:
            print_ratio(report, name, "light_ttft_p99_ms", f"light TTFT p99, {name}", goal)
    return report


if __name__ == "__main__":
    main()
