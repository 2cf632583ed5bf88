"""The in-process baselines of ``benchmarks/serving.py``: the offline engine on the same requests, and the
arithmetic floor of the workload (the model's own forward time for the same tokens).

Offline engine (``offline_engine_run``): ``pagedray.cluster.LLM`` in this process (LocalExecutor, TP=1,
``threads_per_worker`` = the servers' thread count), ``max_num_seqs`` = the closed loop's concurrency (at
most that many requests in flight, as under the closed-loop load), the same prompt texts and max_tokens,
greedy and stopping at EOS like the served requests (they carry no ``ignore_eos``). One warm-up call, then
output tok/s = generated tokens / wall time of ``generate``. ``serving / offline`` is then what HTTP,
Serve, streaming and detokenization cost on top of the engine.

Arithmetic floor (``arithmetic_floor``): an estimate of the seconds the model's arithmetic alone needs for
the workload's tokens on the same threads (the engine's step shapes are not visible from outside):

- Hugging Face ``AutoModelForCausalLM``, float32, eval, ``torch.no_grad``, torch threads = ``threads``.
- Prefill: the prompts, tokenized as the servers tokenize a completion prompt, sorted by length and
  grouped (``prefill_groups``) so that a group's padded size (count x longest) stays within
  ``chunk_tokens`` -- pagedray's token budget per step, ``SchedulerConfig.max_num_batched_tokens``
  (2048 by default). Each group is one left-padded forward with logits at the last position only (the
  engines compute logits only where they sample). Padding is arithmetic the engines do not do, so each
  group's time is scaled by real / padded tokens (the linear layers, which dominate at these prompt
  lengths, cost in proportion to tokens). One untimed warm-up forward first.
- Decode: the closed loop keeps ``batch`` requests in flight (its concurrency, capped by the number of
  requests). One wave of ``batch`` sequences of the mean prompt length is prefilled (untimed), then
  ``mean max_tokens - 1`` decode steps are timed through HF's KV cache object, so each
  step attends over the right, growing context. The wave's time is scaled to the workload's decode
  tokens: x ``(sum(max_tokens) - requests) / (batch * steps)`` (``scale_decode``; the first output token
  of each request comes from its prefill).
- floor seconds = prefill + decode; floor tok/s = ``sum(max_tokens)`` / floor seconds. A server's
  fraction of the floor is its output tok/s / floor tok/s (1.0: no cost beyond the model's arithmetic).
  A server that stops at EOS early produces fewer tokens; rates stay comparable.
- It is an estimate, not a strict bound: HF's per-call overheads and cache concatenation are included,
  and the load's tail (fewer requests in flight while it drains) is not modelled. At small batches HF's
  per-call cost can dominate, and an engine can then exceed 1.0 of this floor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from pagedray.deploy.loadtest.prompts import PromptSpec

from benchmarks.common import Timer, hf_cache_kwargs, hf_returned_cache


def prefill_groups(lengths: Sequence[int], chunk_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` sorted by length and grouped so that count x longest <= ``chunk_tokens``
    (a prompt longer than the budget is a group of its own)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens!r}")
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[index] <= chunk_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def scale_decode(wave_seconds: float, batch: int, steps: int, decode_tokens: int) -> float:
    """Seconds for ``decode_tokens`` at the rate of a timed wave of ``batch`` x ``steps`` tokens."""
    if batch < 1 or steps < 1:
        raise ValueError(f"batch, steps: must be >= 1, got {batch!r}, {steps!r}")
    return wave_seconds * decode_tokens / (batch * steps)


def offline_engine_run(model_path: str, prompts: list[PromptSpec], *, threads: int, max_num_seqs: int,
                       device: str = "cpu") -> dict:
    from pagedray.cluster import LLM, SamplingParams

    texts = [p.prompt for p in prompts]
    llm = LLM(model_path, dtype="float32", device=device, threads_per_worker=threads, max_num_seqs=max_num_seqs)
    try:
        llm.generate(texts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=0) for p in prompts]
        with Timer() as t:
            results = llm.generate(texts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return {"completed": len(results), "duration_s": t.seconds, "output_tokens": produced,
            "output_tok_per_s": produced / t.seconds}


def _prefill_seconds(model, token_ids: list[list[int]], chunk_tokens: int, pad_id: int) -> float:
    import torch

    def forward(group: list[int]) -> float:
        longest = max(len(token_ids[i]) for i in group)
        ids = torch.full((len(group), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):   # left padding: every row's last position is a real token
            ids[row, longest - len(token_ids[i]):] = torch.tensor(token_ids[i])
            mask[row, longest - len(token_ids[i]):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1)
        real = sum(len(token_ids[i]) for i in group)
        return (time.perf_counter() - start) * real / (len(group) * longest)

    groups = prefill_groups([len(t) for t in token_ids], chunk_tokens)
    forward(groups[0])  # warm-up, not counted
    return sum(forward(group) for group in groups)


def _decode_wave_seconds(model, token_ids: list[list[int]], batch: int, steps: int) -> float:
    import torch

    prompt_len = max(1, round(statistics.mean(len(t) for t in token_ids)))
    pool = [t for ids in token_ids for t in ids]
    ids = torch.tensor([[pool[(row * prompt_len + j) % len(pool)] for j in range(prompt_len)]
                        for row in range(batch)])
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)   # the wave's prefill: untimed
    past, last = hf_returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=last, use_cache=True, **hf_cache_kwargs(model, past))
        past, last = hf_returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def floor_seconds(model, token_ids: list[list[int]], max_tokens: list[int], *, batch: int, threads: int,
                  chunk_tokens: int, pad_id: int = 0) -> dict:
    """The floor of a workload (prompt token ids, max_tokens each) for a loaded HF causal LM."""
    import torch

    batch = max(1, min(batch, len(token_ids)))
    steps = max(1, round(statistics.mean(max_tokens)) - 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            prefill_s = _prefill_seconds(model, token_ids, chunk_tokens, pad_id)
            wave_s = _decode_wave_seconds(model, token_ids, batch, steps)
    finally:
        torch.set_num_threads(previous)
    decode_s = scale_decode(wave_s, batch, steps, sum(max_tokens) - len(token_ids))
    seconds = prefill_s + decode_s
    return {"duration_s": seconds, "prefill_s": prefill_s, "decode_s": decode_s, "decode_wave_s": wave_s,
            "batch": batch, "decode_steps": steps, "chunk_tokens": chunk_tokens,
            "prompt_tokens": sum(len(t) for t in token_ids), "output_tokens": sum(max_tokens),
            "output_tok_per_s": sum(max_tokens) / seconds}


def arithmetic_floor(model_path: str, prompts: list[PromptSpec], *, batch: int, threads: int,
                     chunk_tokens: int | None = None) -> dict:
    """The floor described in the module docstring for a model folder and the load's prompts."""
    import torch
    from pagedray.workers.contract.config import SchedulerConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return floor_seconds(model, [tokenizer.encode(p.prompt) for p in prompts], [p.max_tokens for p in prompts],
                         batch=batch, threads=threads,
                         chunk_tokens=chunk_tokens or SchedulerConfig().max_num_batched_tokens,
                         pad_id=tokenizer.pad_token_id or 0)
