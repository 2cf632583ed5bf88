"""``benchmarks.soak``'s request mix is valid: every kind, drawn many times, is answered 200 by the HTTP app
(over a scripted TEST DOUBLE engine and SmolLM2's tokenizer), so a request the soak counts as lost is the
server's failure, never its own body's; a stream is read to its end marker or dropped on purpose."""

from __future__ import annotations

import asyncio
import copy
import pathlib
import random

import httpx
import pytest
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits

from benchmarks import soak

TEMPLATE = (pathlib.Path(__file__).parent.parent / "helpers" / "templates" / "qwen3.jinja").read_text()


@pytest.fixture(scope="module")
def app(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    script = tok.encode('{"pick": "river"} and more words', add_special_tokens=False) + [tok.eos_token_id]
    engine = ScriptedEngine(script, eos_token_id=tok.eos_token_id)
    service = OpenAIService(engine, tok, ModelLimits("m", frozenset({"m"}), len(tok), 1024), ServerMetrics("m"),
                            reasoning_parser="think")
    return create_api(service)


def test_every_kind_of_the_mix_is_answered(app):
    rng = random.Random(3)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return {kind: [await soak.send(client, *soak.request_of(rng, kind, "m")) for _ in range(4)]
                    for kind in soak.KINDS}
    outcomes = asyncio.run(go())
    assert outcomes.pop("abort") == ["aborted"] * 4
    assert all(results == ["ok"] * 4 for results in outcomes.values()), outcomes


def test_every_adapter_kind_of_the_lora_mix_is_answered(tokenizer):
    """``--lora``'s kinds against an app serving ``soak.ADAPTERS`` adapters: each is answered (a swap's load,
    request and unload all succeed; a new name every time, so concurrent swaps never collide) or dropped on
    purpose, and each names an adapter the server has."""
    limits = ModelLimits("m", frozenset({"m"}), len(tokenizer), 1024,
                         lora_adapters=tuple((f"a{i}", f"/adapters/a{i}") for i in range(soak.ADAPTERS)))
    engine = ScriptedEngine(tokenizer.encode("some words", add_special_tokens=False) + [tokenizer.eos_token_id],
                            eos_token_id=tokenizer.eos_token_id)
    app = create_api(OpenAIService(engine, tokenizer, limits, ServerMetrics("m")))
    rng = random.Random(5)
    plans = {kind: [soak.request_of(rng, kind, "m") for _ in range(6)] for kind in soak.LORA_KINDS}

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return {kind: [await (soak.send_swap(client, "/adapters/new", body) if route == "swap"
                                  else soak.send(client, route, body, drop_after))
                           for route, body, drop_after in plan] for kind, plan in plans.items()}
    outcomes = asyncio.run(go())
    assert outcomes.pop("lora_abort") == ["aborted"] * 6
    assert all(results == ["ok"] * 6 for results in outcomes.values()), outcomes
    swapped = [body["model"] for _, body, _ in plans["lora_swap"]]
    assert len(set(swapped)) == len(swapped)
    served = {body["model"] for kind in ("lora", "lora_stream", "lora_abort") for _, body, _ in plans[kind]}
    assert served <= {f"a{i}" for i in range(soak.ADAPTERS)}
    used = {lora.name for lora in engine.loras if lora is not None}
    assert served | set(swapped) == used                 # every request reached the engine under its adapter
