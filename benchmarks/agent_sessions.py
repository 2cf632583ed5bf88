"""Multi-turn agent sessions next to one-shot traffic: session pins and the second KV tier off and on (#64):
``python -m benchmarks.agent_sessions [--sessions 6] [--turns 5] [--rounds 3] [--vllm] [--dry-run]``

Workload (fixed seed, token ids): ``--sessions`` sessions, each starting from a system prompt of its own
(``--system-tokens``); each turn appends ``--turn-tokens`` new tokens to the session's last prompt and output
and generates ``--max-tokens`` (EOS ignored, greedy). Turns go round-robin over the sessions (turn t of every
session, then turn t + 1), and after each round of turns ``--flood`` one-shot prompts of ``--flood-tokens``
tokens run: together they need more blocks than the pool has (an LRU cache evicts the previous flood's blocks
first, then every session's), so without pins the sessions' contexts are gone by their next turn. The pool
(``--num-blocks`` of 16 tokens) holds every session's final context within the pin budget (half the pool) with
room to spare for one flood prompt at a time; requests run one at a time (an agent waits for its answer), the
offline engine in this process, the model at its default dtype.

Systems, interleaved by rounds, each in a fresh engine: ``pins-off`` (``kv_pin_max_fraction`` 0: plain LRU
prefix cache), ``pins-on`` (each turn's request carries its session: ``kv_pin_max_fraction`` 0.5) and
``tier-on`` (no pins; a second KV tier of ``--tier-gib`` per rank in a temporary folder: evicted blocks are
saved there and loaded back when a turn reaches them).

With ``--vllm`` (``--vllm-tuning``) also ``vllm`` (``vllm-bind``): vLLM for CPU's engine on the same requests in its
own venv (``vllm_agent_sessions_run.py``; the workload comes from ``agent_workload.py``, shared), at its defaults
(prefix caching on: an LRU, no pins, no tier; its 128-token CPU blocks) but for a pool of the same tokens
(``--num-blocks`` of 16);
``vllm-bind`` binds its OpenMP threads to every core (its first tuning). ``--systems`` runs a subset.

Reported, over the turns >= 2: mean TTFT (add -> first token, ms) and prompt tokens prefilled (not served
from the prefix cache, a tier load counting as cached), and the ratios pins-off / pins-on and pins-off /
tier-on (how many times lower). The issue's goal: >= 3x lower TTFT and >= 5x fewer prefill tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.agent_workload import drive
from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

SYSTEMS = ("pins-off", "pins-on", "tier-on")


def run_request(engine, request_id: str, prompt: list[int], params,
                session: str | None) -> tuple[list[int], float, int]:
    """(output tokens, TTFT seconds, prompt tokens prefilled) of one request run alone."""
    start = time.perf_counter()
    engine.add(request_id, prompt, params, session=session)
    tokens, ttft, cached = [], None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.outputs[0].token_ids if out.outputs else []
            cached = max(cached, out.num_cached_prompt_tokens)
    return tokens, ttft, len(prompt) - cached


def workload(args, vocab: int) -> dict:
    """The workload's parameters as ``agent_workload`` (and vLLM's runner) takes them."""
    keys = ("sessions", "turns", "system_tokens", "turn_tokens", "max_tokens", "flood", "flood_tokens", "seed")
    return {**{key: getattr(args, key) for key in keys}, "vocab": vocab}


def measure(system: str, args, vocab: int) -> dict:
    from pagedray.cluster import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(args.model, block_size=16, num_blocks=args.num_blocks, watermark=0.0,
             kv_pin_max_fraction=0.5 if system == "pins-on" else 0.0,
             kv_offload_gib=args.tier_gib if system == "tier-on" else 0.0) as llm:
        engine = llm.engine
        ttfts, prefilled = drive(workload(args, vocab), lambda rid, prompt, session: run_request(
            engine, rid, prompt, params, session if system == "pins-on" else None))
        stats = engine.block_manager.stats()
    return {"mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts), "prefill_tokens": prefilled,
            "pinned_blocks_at_end": stats.num_pinned_blocks, "pin_evictions": stats.num_pin_evictions,
            "tier_loaded_blocks": stats.num_tier_loaded, "tier_saves": stats.num_tier_saves}


def measure_vllm(system: str, args, vocab: int) -> dict:
    """The workload on vLLM for CPU's engine (``vllm_agent_sessions_run.py`` in its venv): its prefix cache (LRU,
    no pins, no tier) over a pool of the same tokens."""
    from benchmarks import vllm_cpu
    from benchmarks.vllm_agent_sessions_run import RESULT_PREFIX

    job = {**workload(args, vocab), "model": args.model, "pool_tokens": 16 * args.num_blocks,
           "gpu_memory_utilization": float(vllm_cpu.MEMORY_FRACTION)}
    result = vllm_cpu.run_job(Path(__file__).with_name("vllm_agent_sessions_run.py"), job, system, RESULT_PREFIX,
                              timeout=3600)
    return {"mean_ttft_ms": result["mean_ttft_ms"], "prefill_tokens": result["prefill_tokens"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.agent_sessions", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "agent_sessions")
    parser.add_argument("--model", default="default")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--flood", type=int, default=5)
    parser.add_argument("--flood-tokens", type=int, default=2500)
    parser.add_argument("--num-blocks", type=int, default=768)
    parser.add_argument("--tier-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="also vLLM for CPU at its defaults (system vllm)")
    parser.add_argument("--vllm-tuning", action="store_true", help="also vLLM bound to every core (vllm-bind)")
    parser.add_argument("--systems", default=None, help="run only these systems (comma-separated)")
    parser.add_argument("--dry-run", action="store_true", help="2 sessions, 2 turns, small prompts: the plumbing")
    args = parser.parse_args(argv)
    from pagedray.workers.models.model_info import model_info
    from pagedray.workers.weights.default_model import resolve_model_path

    if args.dry_run:
        args.sessions, args.turns, args.system_tokens, args.turn_tokens = 2, 2, 32, 16
        args.max_tokens, args.flood, args.flood_tokens, args.num_blocks = 4, 2, 120, 24
    args.model = str(resolve_model_path(args.model))
    vocab = model_info(args.model).vocab_size
    systems = SYSTEMS + (("vllm",) if args.vllm else ()) + (("vllm-bind",) if args.vllm_tuning else ())
    if args.systems:
        chosen = args.systems.split(",")
        unknown = sorted(set(chosen) - set(systems))
        if unknown:
            parser.error(f"--systems: {unknown} are not among {list(systems)}")
        systems = tuple(s for s in systems if s in chosen)
    runs = run_rounds(systems, args.rounds, lambda system, _: (measure_vllm if system.startswith("vllm") else measure)(
        system, args, vocab), on_run=print_run)
    metrics = [Metric("mean_ttft_ms", "mean TTFT turn>=2 ms", higher_is_better=False),
               Metric("prefill_tokens", "prefill tokens turn>=2", higher_is_better=False)]
    ratios = [Ratio("pins-off", ("pins-on",), None, "pins-off / pins-on"),
              Ratio("pins-off", ("tier-on",), None, "pins-off / tier-on")]
    for peer in ("vllm", "vllm-bind"):
        ratios += [Ratio(peer, (ours,), None, f"{peer} / {ours}") for ours in ("pins-on", "tier-on", "pins-off")]
    ratios = [r for r in ratios if r.system in systems and all(p in systems for p in r.peers)]
    out = "/dev/null" if args.dry_run and args.out == parser.get_default("out") else args.out
    return finish_rounds("agent_sessions", out, runs, metrics, ratios, vars(args))


if __name__ == "__main__":
    main()
