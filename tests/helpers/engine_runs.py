"""One request through an Engine on its own: its output tokens and the prompt tokens it found cached."""

from __future__ import annotations


def run_alone(engine, request_id: str, prompt: list[int], params, **add_kwargs) -> tuple[list[int], int]:
    """Adds the request (``add_kwargs``: ``session``, ``lora``, ...) and steps until the engine is idle:
    (sample 0's tokens, its prompt tokens served from the prefix cache)."""
    engine.add(request_id, prompt, params, **add_kwargs)
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            cached = max(cached, out.num_cached_prompt_tokens)
    return tokens, cached


async def collect_tokens(stream, on_token=None) -> list[int]:
    """Sample 0's tokens of a stream of RequestOutputs; ``on_token(count so far)`` after each output."""
    tokens = []
    async for out in stream:
        tokens += out.outputs[0].token_ids if out.outputs else []
        if on_token is not None:
            on_token(len(tokens))
    return tokens
