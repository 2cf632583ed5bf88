"""The pooling endpoints (#66, deploy/openai/embeddings.py) in front of a real engine in this process: the official
``openai`` client's ``embeddings.create`` (float and base64) against transformers' last hidden state of the same
model, /v1/rerank and /score against its yes/no logits, and bad input answered with a 4xx that names the field
before anything reaches the engine."""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import openai
import pytest
import torch
from helpers.tiny_models import save_tiny_reranker
from pagedray.cluster.pooling import rerank_prompt
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

NAME = "tiny-reranker"
TEXTS = ["Deer, foxes and owls live among the trees.", "The stock market closed higher today.",
         "Bears sleep through the winter in dens."]


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory, default_model_path):
    return save_tiny_reranker(tmp_path_factory.mktemp("reranker"), default_model_path)


@pytest.fixture(scope="module")
def hf(reranker_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(reranker_path, dtype=torch.float32),
            AutoTokenizer.from_pretrained(reranker_path))


def _served(path: str, task: str) -> ServedEngine:
    return ServedEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32", task=task),
                                     cache=CacheConfig(block_size=8, num_blocks=256),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=32),
                                     parallel=ParallelConfig(executor="local", threads_per_worker=1)))


def _run(path: str, task: str, scenario):
    """``scenario(client, served)`` against the API of a served engine of ``path`` (an httpx client on its ASGI app)."""
    from transformers import AutoTokenizer

    async def main():
        served = _served(path, task)
        meta = served.model_meta()
        limits = ModelLimits(NAME, frozenset({NAME}), meta.vocab_size, meta.max_model_len, None, meta.dtype,
                             sequences_in_flight=4, pooling=meta.pooling)
        service = OpenAIService(served, AutoTokenizer.from_pretrained(path), limits, ServerMetrics(NAME))
        transport = httpx.ASGITransport(app=create_api(service))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await scenario(client, served)
        finally:
            await served.close()
    return asyncio.run(main())


def _hf_last_hidden(hf, text: str) -> torch.Tensor:
    model, tokenizer = hf
    with torch.inference_mode():
        out = model(torch.tensor([tokenizer(text).input_ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1]


def test_the_openai_client_gets_transformers_embeddings_as_floats_and_base64(reranker_path, hf):
    async def scenario(client, _):
        api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=client)
        floats = await api.embeddings.create(model=NAME, input=TEXTS)
        packed = await api.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="base64")
        alone = await api.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
        raw = (await client.post("/v1/embeddings", json={"input": TEXTS[1], "normalize": False})).json()
        return floats, packed, alone, raw

    floats, packed, alone, raw = _run(reranker_path, "embed", scenario)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == NAME
    tokens = [len(hf[1](text).input_ids) for text in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(tokens)
    for text, item in zip(TEXTS, floats.data):
        reference = torch.nn.functional.normalize(_hf_last_hidden(hf, text), dim=0)
        assert torch.nn.functional.cosine_similarity(torch.tensor(item.embedding), reference, dim=0) >= 0.99999
        torch.testing.assert_close(torch.tensor(item.embedding), reference, rtol=0, atol=1e-5)
    # without encoding_format the client asks for base64 and decodes it (above); asked for, it is left as sent:
    # the same floats, bit for bit, as the same input asked for as floats (one text alone both times: in a batch
    # of three its rows may meet another product of the CPU's linear-layer plan, equal only to the last bits)
    data = base64.b64decode(packed.data[0].embedding)
    assert torch.equal(torch.tensor(struct.unpack(f"<{len(data) // 4}f", data)),
                       torch.tensor(alone.data[0].embedding, dtype=torch.float32))
    assert alone.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-5)
    torch.testing.assert_close(torch.tensor(raw["data"][0]["embedding"]), _hf_last_hidden(hf, TEXTS[1]),
                               rtol=0, atol=1e-4)


def test_base64_is_little_endian_float32(reranker_path):
    async def scenario(client, _):
        return (await client.post("/v1/embeddings", json={"input": [5, 6, 7], "encoding_format": "base64"})).json()

    body = _run(reranker_path, "embed", scenario)
    data = base64.b64decode(body["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(data) // 4}f", data)
    assert len(vector) == 64 and sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-5)


def test_rerank_and_score_equal_transformers_yes_no_probabilities(reranker_path, hf):
    query = "Which animals live in the forest?"

    async def scenario(client, _):
        rerank = (await client.post("/v1/rerank", json={"model": NAME, "query": query, "documents": TEXTS,
                                                        "top_n": 2})).json()
        score = (await client.post("/score", json={"text_1": query, "text_2": TEXTS})).json()
        return rerank, score

    rerank, score = _run(reranker_path, "score", scenario)
    model, tokenizer = hf
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected = []
    for text in TEXTS:
        with torch.inference_mode():
            last = model(torch.tensor([tokenizer(rerank_prompt(query, text)).input_ids])).logits[0, -1]
        expected.append(torch.softmax(last[[no, yes]], dim=0)[1].item())
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    order = sorted(range(3), key=lambda i: -expected[i])
    assert [r["index"] for r in rerank["results"]] == order[:2]           # top_n, best first
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([expected[i] for i in order[:2]],
                                                                              abs=1e-5)
    assert rerank["results"][0]["document"] == {"text": TEXTS[order[0]]} and rerank["model"] == NAME


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/embeddings", {"input": ""}, 400, "input"),
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": ["fine", [1, 2, 10 ** 9]]}, 400, "input[1]"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "model"),
    ("/v1/embeddings", {"input": [[7] * 600]}, 400, "input"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, 400, "input"),
    ("/v1/embeddings", {"input": [1, "a"]}, 400, "input"),
    ("/v1/embeddings", {"input": [[]]}, 400, "input"),
    ("/v1/embeddings", {"input": "x", "normalize": "yes"}, 400, "normalize"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, 400, "model"),     # not served with task: score
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_1"),
])
def test_bad_input_is_a_4xx_naming_the_field_and_reaches_no_engine(reranker_path, path, body, status, param):
    async def scenario(client, served):
        response = await client.post(path, json=body)
        return response, await served.stats()

    response, stats = _run(reranker_path, "embed", scenario)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param.split("[")[0] or error["message"].startswith(param), error
    assert stats.num_prompt_tokens_total == 0 and stats.num_running == 0 and stats.num_waiting == 0
