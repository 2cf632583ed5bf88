"""The agent_sessions workload as a stream of requests: shared by ``benchmarks.agent_sessions`` (pagedray's
engine) and ``vllm_agent_sessions_run.py`` (vLLM's, in its own venv). Pure Python: it imports nothing of
pagedray's, so vLLM's venv can import it from this folder.

``requests(job, rng)`` is a generator of ``(request_id, session, turn, prompt)``: each session starts from its
own ``system_tokens`` random tokens; turn t of every session (round-robin) appends ``turn_tokens`` new tokens to
the session's context; after each round of turns come ``flood`` one-shot prompts of ``flood_tokens`` tokens
(``session`` None). A session's output must be sent back (``gen.send(output_tokens)``) so that its next turn
carries it; a flood request is answered with ``gen.send(None)``. The random draws do not depend on the outputs,
so every engine sees the same new tokens in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Generator

Request = tuple[str, "str | None", int, list[int]]


def requests(job: dict, rng: random.Random) -> Generator[Request, list[int] | None, None]:
    vocab = job["vocab"]
    contexts = {f"s{i}": [rng.randrange(2, vocab) for _ in range(job["system_tokens"])]
                for i in range(job["sessions"])}
    for turn in range(job["turns"]):
        for session, context in contexts.items():
            context += [rng.randrange(2, vocab) for _ in range(job["turn_tokens"])]
            output = yield f"{session}-{turn}", session, turn, list(context)
            context += output
        for i in range(job["flood"]):
            yield f"flood-{turn}-{i}", None, turn, [rng.randrange(2, vocab) for _ in range(job["flood_tokens"])]


def drive(job: dict, run_one) -> tuple[list[float], int]:
    """Runs the workload one request at a time through ``run_one(request_id, prompt, session) -> (output tokens,
    TTFT seconds, prompt tokens prefilled)``; returns the turns >= 2's TTFTs and their prefilled tokens."""
    gen = requests(job, random.Random(job["seed"]))
    ttfts, prefilled = [], 0
    item = next(gen)
    while True:
        request_id, session, turn, prompt = item
        output, ttft, computed = run_one(request_id, prompt, session)
        if session is not None and turn >= 1:
            ttfts.append(ttft)
            prefilled += computed
        try:
            item = gen.send(output if session is not None else None)
        except StopIteration:
            return ttfts, prefilled
