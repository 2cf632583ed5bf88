"""Benchmark: recovery from a TP rank death (TP=2 on Ray, compiled graph, CPU).

For each way of killing rank 1 mid-decode (``ray.kill`` of its actor; SIGKILL of its process), a batch
of greedy and seeded requests runs on a TP=2 engine; once every request has produced
``--kill-after`` tokens, rank 1 dies. The engine rebuilds its TP group and re-admits the running
sequences by recompute. Reported per mode:

- ``recovery_s``: kill -> the first token streamed after the rebuild (what a client sees);
- ``rebuild_s``: the engine's rebuild alone (reset + new placement group, actors, process group, KV);
- ``cold_start_s``: building a fresh TP=2 engine from nothing in the same script (the peer);
- ``ratio`` = recovery_s / cold_start_s;
- ``outputs_match``: every request's tokens equal an undisturbed in-process (LocalExecutor) run.

The model is a tiny random Llama written to a temporary folder (``--model`` picks another).
Usage: ``python -m benchmarks.recovery [--model PATH] [--kill-after 5]``
Writes benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pagedray.workers.contract.sampling_params import SamplingParams

from benchmarks.common import print_table, write_json

PROMPTS = [[5, 17, 300, 42, 8, 99, 100, 3], [250, 251, 252], list(range(40, 75)), [7, 7, 7, 9]]
PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=35, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, max_tokens=25, ignore_eos=True)]
ENGINE_KWARGS = dict(dtype="float32", block_size=8, num_blocks=96)   # float32: runs compare token for token


def write_tiny_llama(path: str) -> str:
    """A 2-layer random Llama (vocab 512) like the test fixture; returns ``path``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(1234)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(path)
    GenerationConfig(bos_token_id=0, eos_token_id=1).save_pretrained(path)
    return path


def undisturbed_tokens(model: str) -> list[list[int]]:
    from pagedray.cluster.llm import LLM

    llm = LLM(model, **ENGINE_KWARGS)
    try:
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def run_with_kill(engine, kill, kill_after_tokens: int) -> tuple[list[list[int]], float | None]:
    """Adds PROMPTS/PARAMS, calls ``kill()`` once every request has ``kill_after_tokens`` tokens, runs to
    completion. Returns (tokens per request, seconds from the kill to the first token after it).
    Raises RuntimeError when an output carries an error."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    killed_at = first_after = None
    while engine.has_unfinished_requests():
        got_tokens = False
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            for completion in out.outputs:
                tokens[out.request_id] += completion.token_ids
                got_tokens = got_tokens or bool(completion.token_ids)
        if killed_at is None and min(len(t) for t in tokens.values()) >= kill_after_tokens:
            kill()
            killed_at = time.monotonic()
        elif killed_at is not None and first_after is None and got_tokens:
            first_after = time.monotonic() - killed_at
    return [tokens[str(i)] for i in range(len(PROMPTS))], first_after


def _measure(model: str, mode: str, kill_after: int, expected: list[list[int]]) -> dict:
    import ray
    from pagedray.cluster.llm import LLM

    started = time.monotonic()
    llm = LLM(model, tensor_parallel_size=2, step_timeout_s=60.0, **ENGINE_KWARGS)
    cold_start_s = time.monotonic() - started
    try:
        victim = llm.engine.executor.actors[1]
        if mode == "ray.kill":
            def kill():
                ray.kill(victim)
        else:
            pid = llm.engine.executor.rank_pids[1]

            def kill():
                os.kill(pid, signal.SIGKILL)
        tokens, recovery_s = run_with_kill(llm.engine, kill, kill_after)
        return {"mode": mode, "recovery_s": recovery_s, "rebuild_s": llm.engine.last_recovery_s,
                "cold_start_s": cold_start_s, "ratio": recovery_s / cold_start_s,
                "restarts": llm.engine.stats().num_rank_restarts_total, "outputs_match": tokens == expected}
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    parser.add_argument("--kill-after", type=int, default=5, help="tokens per request before the kill")
    args = parser.parse_args(argv)
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_llama(tmp)
        expected = undisturbed_tokens(model)
        rows = [_measure(model, mode, args.kill_after, expected) for mode in ("ray.kill", "SIGKILL")]
    print_table(rows, ["mode", "recovery_s", "rebuild_s", "cold_start_s", "ratio", "restarts", "outputs_match"])
    write_json("recovery", {"model": args.model or "tiny random Llama (2 layers, vocab 512)",
                            "tensor_parallel_size": 2, "kill_after_tokens": args.kill_after, "rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    main()
