"""Pooling endpoints (#66): POST /v1/embeddings (OpenAI's shape), POST /v1/rerank (the Jina / Cohere shape vLLM
serves) and POST /score (vLLM's). Each input is one pooling request to the engine (cluster/pooling.py: what is
asked and what is done with the result), run as a prefill beside the generation requests.

- /v1/embeddings: ``input`` a string, a list of strings, a list of token ids or a list of such lists (at most
  ``MAX_INPUTS``); ``encoding_format`` "float" or "base64" (little-endian float32, as OpenAI's); ``dimensions``
  (Matryoshka models only); ``normalize`` (an extension; default: the ``embed_normalize`` option). Pooled as the
  ``pooling_type`` option says. Usage counts the input tokens.
- /v1/rerank: ``query``, ``documents`` (strings, or {"text": ...}), ``top_n`` (default: all), ``return_documents``
  (default true), ``instruction`` (an extension: the reranker's task instruction). Results sorted by
  ``relevance_score``: P("yes") of a yes/no reranker (Qwen3-Reranker), or a sequence-classification checkpoint's
  score head (cluster/pooling.py).
- /score: ``text_1`` (a string, or a list as long as ``text_2``) against ``text_2`` (a string or a list): one
  score per pair, in ``text_2``'s order.
Rerank and score need a model served with ``task: score`` (its template is a yes/no reranker's); embeddings work
with any model. Every input is checked (its length against the context) before any runs: a bad one is a 400
naming it, and nothing was sent to the engine.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from contextlib import aclosing
from typing import Literal, Union

from pagedray.cluster.pooling import Scorer, embedding_params, finish_embedding, rerank_prompt
from pydantic import Field

from .errors import bad_request, to_api_error
from .protocol import Int64, _Request
from .service import outcome_of, parse_body
from .streaming import EngineRequestError
from .validation import check_model, check_prompt_chars, check_token_ids

MAX_INPUTS = 2048   # inputs (or documents) of one request, as OpenAI's embeddings limit

EmbeddingInput = Union[str, list[str], list[Int64], list[list[Int64]]]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: bool | None = None
    user: str | None = None


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[Union[str, RerankDocument]] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: Int64 | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = None


class ScoreRequest(_Request):
    model: str | None = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    instruction: str | None = None


def _embedding_inputs(value) -> list[str | list[int]]:
    """The inputs of an embedding request, one per vector (a lone string or token list is one input)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise bad_request("input: must not be empty", param="input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input: at most {MAX_INPUTS} inputs per request, got {len(value)}", param="input")
    return list(value)


class PoolingEndpoints:
    """The pooling endpoints of one served model (``service``: its OpenAIService: engine, tokenizer, limits)."""

    def __init__(self, service) -> None:
        self.service = service

    def _tokens(self, item, where: str) -> list[int]:
        """One input as token ids, checked against the vocabulary and the context (a pooling request samples one
        token, so at most max_model_len - 1)."""
        limits = self.service.limits
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where}: must not be empty", param=where.split("[")[0])
            check_prompt_chars(len(item), limits, where)
            ids = self.service._tok.encode(item)
        else:
            ids = list(item)
            if not ids:
                raise bad_request(f"{where}: must not be empty", param=where.split("[")[0])
            check_token_ids(ids, limits.vocab_size, where)
        if len(ids) >= limits.max_model_len:
            raise bad_request(f"{where}: {len(ids)} tokens; at most {limits.max_model_len - 1} fit the maximum "
                              f"context length of {limits.max_model_len} tokens", param=where.split("[")[0])
        return ids

    async def _run(self, endpoint: str, prepare, body, tenant: str | None):
        """Prepare on a prepare lane (parse, check, tokenize), then run every input's pooling request: (what
        ``prepare`` returned, the finished RequestOutputs in input order). Counts the outcome."""
        service = self.service
        try:
            prepared = await service._lanes.call(prepare, body)
            outputs = await self._pool(prepared["ids"], prepared["params"], prepared["lora"], tenant)
        except Exception as exc:
            service.metrics.record_outcome(endpoint, outcome_of(exc))
            raise to_api_error(exc) from exc
        service.metrics.record_outcome(endpoint, "stop")
        service.metrics.prompt_tokens.inc(sum(map(len, prepared["ids"])))
        return prepared, outputs

    async def _pool(self, ids: list[list[int]], params, lora, tenant: str | None) -> list:
        """Each token list's pooling request, at most ``sequences_in_flight`` at once; their finished outputs."""
        rid = f"pool-{uuid.uuid4().hex}"
        window = self.service.limits.sequences_in_flight or len(ids)
        semaphore = asyncio.Semaphore(window)

        async def one(i: int, token_ids: list[int]):
            async with semaphore:
                async with aclosing(self.service.engine.generate(f"{rid}-{i}", token_ids, params, lora=lora,
                                                                 tenant=tenant)) as outputs:
                    async for out in outputs:
                        if out.error is not None:
                            raise EngineRequestError(out.error)
                        if out.finished:
                            return out
            raise EngineRequestError("the engine stream ended before the pooling request finished")
        return await asyncio.gather(*(one(i, token_ids) for i, token_ids in enumerate(ids)))

    # -- /v1/embeddings
    def _prepare_embeddings(self, body) -> dict:
        req = parse_body(EmbeddingRequest, body)
        lora = check_model(req.model, self.service.limits)
        pooling = self.service.limits.pooling
        if req.dimensions is not None:   # checked before anything runs
            finish_embedding([0.0] * pooling.hidden_size, False, req.dimensions, pooling.matryoshka)
        ids = [self._tokens(item, f"input[{i}]") for i, item in enumerate(_embedding_inputs(req.input))]
        return {"req": req, "ids": ids, "lora": lora, "params": embedding_params(pooling.pooling_type)}

    async def embeddings(self, body, tenant: str | None = None) -> dict:
        prepared, outputs = await self._run("embeddings", self._prepare_embeddings, body, tenant)
        req, pooling = prepared["req"], self.service.limits.pooling
        normalize = pooling.embed_normalize if req.normalize is None else req.normalize
        data = []
        for i, out in enumerate(outputs):
            vector = finish_embedding(out.pooled, normalize, req.dimensions, pooling.matryoshka)
            encoded = vector if req.encoding_format == "float" else base64.b64encode(
                struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        tokens = sum(map(len, prepared["ids"]))
        return {"object": "list", "data": data, "model": self._answering(prepared["lora"]),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # -- /v1/rerank and /score
    def _scored_pairs(self, req, pairs: list[tuple[str, str]]) -> dict:
        service = self.service
        lora = check_model(req.model, service.limits)
        if service.limits.pooling.task != "score":
            raise bad_request(f"model: {service.limits.served_name!r} is not served as a reranker (start it with "
                              f"task: score)", param="model")
        if service.scorer is None:     # the model's way of scoring, built once (a classifier head is read)
            service.scorer = Scorer(service.limits.pooling, service._tok)
        ids = [self._tokens(rerank_prompt(query, document, req.instruction), f"documents[{i}]")
               for i, (query, document) in enumerate(pairs)]
        return {"req": req, "ids": ids, "lora": lora, "params": service.scorer.params}

    def _prepare_rerank(self, body) -> dict:
        req = parse_body(RerankRequest, body)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        prepared = self._scored_pairs(req, [(req.query, text) for text in texts])
        prepared["texts"] = texts
        return prepared

    async def rerank(self, body, tenant: str | None = None) -> dict:
        prepared, outputs = await self._run("rerank", self._prepare_rerank, body, tenant)
        req, texts = prepared["req"], prepared["texts"]
        scorer = self.service.scorer
        results = [{"index": i, "relevance_score": scorer.score(out)} for i, out in enumerate(outputs)]
        results.sort(key=lambda r: -r["relevance_score"])
        for result in results:
            if req.return_documents:
                result["document"] = {"text": texts[result["index"]]}
        tokens = sum(map(len, prepared["ids"]))
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self._answering(prepared["lora"]),
                "usage": {"total_tokens": tokens}, "results": results[:req.top_n]}

    def _prepare_score(self, body) -> dict:
        req = parse_body(ScoreRequest, body)
        seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        firsts = [req.text_1] * len(seconds) if isinstance(req.text_1, str) else req.text_1
        if not seconds or len(seconds) > MAX_INPUTS:
            raise bad_request(f"text_2: give 1-{MAX_INPUTS} texts", param="text_2")
        if len(firsts) != len(seconds):
            raise bad_request(f"text_1: a list must be as long as text_2 ({len(seconds)}), got {len(firsts)}",
                              param="text_1")
        return self._scored_pairs(req, list(zip(firsts, seconds)))

    async def score(self, body, tenant: str | None = None) -> dict:
        prepared, outputs = await self._run("score", self._prepare_score, body, tenant)
        data = [{"index": i, "object": "score", "score": self.service.scorer.score(out)}
                for i, out in enumerate(outputs)]
        tokens = sum(map(len, prepared["ids"]))
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self._answering(prepared["lora"]), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _answering(self, lora) -> str:
        return self.service.limits.served_name if lora is None else lora.name
