"""The ingress deployment: OpenAI HTTP API (FastAPI) + Python handle API, in front of the engine.

The ingress validates, applies the chat template, tokenizes, detokenizes incrementally, applies stop
strings and formats responses; the engine deployment only sees token ids and SamplingParams.

Python handle API (the methods below that are not HTTP routes). Request bodies are the same dicts the
HTTP API takes; results are the same JSON objects, as dicts::

    import ray
    from ray import serve
    from pagedray.deploy.app import build_app

    ray.init()
    serve.run(build_app({"model": "default"}), name="pagedray", route_prefix="/")

    handle = serve.get_app_handle("pagedray")
    # one call, the whole result (an OpenAI "text_completion" object)
    result = handle.generate.remote("The capital of France is", {"max_tokens": 8, "temperature": 0}).result()
    print(result["choices"][0]["text"])
    # streaming: OpenAI completion chunks, the last one with usage when include_usage is set
    stream = handle.options(stream=True).generate_stream.remote("Count to five:", {"max_tokens": 16})
    for chunk in stream:
        for choice in chunk["choices"]:
            print(choice["text"], end="", flush=True)
    print()
    # the full OpenAI request bodies work too
    chat = handle.chat.remote({"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}).result()
    for chunk in handle.options(stream=True).chat_stream.remote(
            {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}):
        print(chunk["choices"][0]["delta"].get("content") or "", end="")
    print()

Layouts (``engine_in_ingress``, app.py): with several engine replicas (or autoscaling) the engine runs
in its own deployment and this replica reaches it through a DeploymentHandle (``HandleEngineClient``:
one Ray stream per request, one item per output; ``FailoverEngineClient`` continues a stream on another
replica when its replica is lost). With one replica (by default) this replica holds
the engine itself
(``ServedEngine``; the TP workers stay Ray actors in this replica's placement group): outputs reach
the HTTP responses through asyncio, and ``check_health`` / ``__del__`` act for the engine as the engine
deployment's do.

Before a shutdown, ``handle.drain.remote(timeout_s).result()`` stops admission (503 from then on) and
lets the requests in flight finish (``DrainReport``).

Errors come back as ``pagedray.deploy.openai.errors.APIError`` (``.status``, ``.body()``), wrapped by Ray
(``isinstance(err, APIError)`` holds). Cancelling a streaming call aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagedray.cluster.outputs import EngineDeadError
from pagedray.cluster.stats import EngineStats
from pagedray.workers.contract.config import EngineConfig
from ray import serve
from ray.serve.handle import DeploymentHandle

from ..bridges import messages_api, responses_api
from ..bridges.bridged import run_bridged
from ..bridges.messages_stream import message_events
from ..bridges.responses_stream import response_events
from ..http.guard import use_bounded_protocol
from ..http.routes import DEFAULT_MAX_BODY_BYTES, create_api
from ..openai.embeddings import PoolingEndpoints
from ..openai.errors import to_api_error
from ..openai.metrics import MetricFamilies, ReplicaState, ServerMetrics
from ..openai.prompt_bound import max_prompt_chars
from ..openai.service import OpenAIService
from ..openai.service_table import ServiceTable
from ..openai.validation import ModelLimits
from ..routing.router import replica_summaries
from .disaggregation import DisaggregatedEngineClient
from .engine_deployment import HEALTH_CHECK_PERIOD_S, HEALTH_CHECK_TIMEOUT_S
from .failover import FailoverEngineClient, app_being_deleted
from .loopback import bind_replica_grpc_to_loopback
from .options import GRACEFUL_SHUTDOWN_S
from .served_engine import DrainReport, ModelMeta, ServedEngine

INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"
# /health answers 503 when the engine replica does not answer within this (e.g. while Serve replaces it)
HEALTH_TIMEOUT_S = 5.0


async def _awaited(response):
    return await response


def replica_state(summary: dict) -> ReplicaState:
    """A ReplicaState from an engine replica's routing summary (``ServedEngine.routing_stats``)."""
    return ReplicaState(summary["replica"], EngineStats(**summary["stats"]), summary["healthy"], summary["reason"])


class HandleEngineClient:
    """EngineClient over a DeploymentHandle to the engine deployment.

    ``replica_states`` and ``check_ready`` see every engine replica when a CacheAwareRouter routes this
    handle (``routing.replica_summaries``); otherwise (one replica, Serve's router) the one that answers."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    def _summaries(self) -> list[dict] | None:
        return replica_summaries(self._handle.deployment_id.app_name, self._handle.deployment_id.name)

    async def replica_states(self) -> list[ReplicaState]:
        summaries = self._summaries()
        if summaries is not None:
            return [replica_state(s) for s in summaries]
        replica, stats = await self._handle.replica_stats.remote()
        return [ReplicaState(replica, stats)]

    async def generate(self, request_id: str, prompt_token_ids: list[int], params,
                       resume_tokens: list[int] = (), lora=None, session=None, tenant=None, kv=None,
                       exclude: str | None = None) -> AsyncIterator:
        args = (request_id, prompt_token_ids, params, list(resume_tokens), lora, session, tenant)
        moved = {name: value for name, value in (("kv", kv), ("exclude", exclude)) if value is not None}
        response = self._handle.options(stream=True).generate.remote(*args, **moved)
        exhausted = False
        try:
            async for output in response:
                yield output
            exhausted = True
        finally:
            if not exhausted:
                response.cancel()

    async def stats(self):
        return await self._handle.stats.remote()

    async def check_lora(self, lora) -> None:
        """The check of the replica this call reaches (every replica reads the same folder, as for requests)."""
        await self._handle.check_lora.remote(lora)

    async def check_ready(self) -> None:
        for summary in self._summaries() or []:
            if not summary["healthy"]:
                raise EngineDeadError(f"engine replica {summary['replica']}: {summary['reason']}")
        response = self._handle.check_ready.remote()
        try:
            await asyncio.wait_for(_awaited(response), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            raise EngineDeadError(f"the engine did not answer a health check within {HEALTH_TIMEOUT_S} s") from None


def served_names(model: str, meta: ModelMeta, served_model_name: str | None) -> tuple[str, frozenset[str]]:
    from pathlib import Path

    from pagedray.workers.weights.default_model import DEFAULT_MODEL_NAME

    name = served_model_name or (DEFAULT_MODEL_NAME if model == "default" else Path(meta.model_path).name)
    return name, frozenset({name, model, meta.model_path})


@serve.deployment(name=INGRESS_DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, engine: DeploymentHandle | EngineConfig, model: str = "default",
                       served_model_name: str | None = None, api_key: str | None = None,
                       max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, reasoning_parser: str = "auto",
                       tool_call_parser: str = "auto", ingress_replicas: int = 1,
                       tenant_keys: dict[bytes, str] | None = None,
                       prefill_engine: DeploymentHandle | None = None, models: list[dict] | None = None) -> None:
        """``engine``: a handle to the engine deployment, or (``engine_in_ingress``) the EngineConfig of
        the engine this replica runs itself. ``ingress_replicas``: the most replicas this deployment may
        have (more than one: LoRA adapters are not loaded at run time, ``openai/lora_adapters.py``).
        ``tenant_keys``: the tenants' API keys (``http/tenants.py``). ``prefill_engine``: a handle to the prefill
        replicas (prefill/decode disaggregation, ``disaggregation.py``; ``engine`` is then the decode one).
        ``models``: more models behind this API, each ``{"engine": handle, "model", "served_model_name",
        "reasoning_parser", "tool_call_parser"}`` (service_table.py: a request goes to the model it names; one
        without a name to the first)."""
        use_bounded_protocol()   # before Serve starts this replica's own HTTP server (direct ingress)
        bind_replica_grpc_to_loopback()   # before Serve starts the replica's gRPC server (loopback nodes)
        self._served: ServedEngine | None = None
        self._families = MetricFamilies()
        self._metas: list[ModelMeta] = []       # each model's, in table order
        if isinstance(engine, EngineConfig):
            self._served = ServedEngine(engine)
        first = await self._model_service(engine, model, served_model_name, reasoning_parser, tool_call_parser,
                                          prefill_engine)
        services = [first] + [await self._model_service(entry["engine"], entry["model"],
                                                        entry.get("served_model_name"),
                                                        entry.get("reasoning_parser", "auto"),
                                                        entry.get("tool_call_parser", "auto"))
                              for entry in models or []]
        self._table = ServiceTable(services)
        self._client = first.engine           # the first model's: stats(), as with one model
        self._engine, self._limits_meta = engine, self._metas[0]
        if ingress_replicas > 1:
            for service in services:
                service.lora_refusal = (
                    f"lora_name: this app has up to {ingress_replicas} ingress replicas (engine_in_ingress), each "
                    "with its own adapter table, so adapters are not loaded at run time here; list them in "
                    "lora_modules")
        self._api_key = api_key
        self._tenant_keys = tenant_keys
        self._max_body_bytes = max_body_bytes

    async def _model_service(self, engine, model: str, served_model_name: str | None, reasoning_parser: str,
                             tool_call_parser: str, prefill_engine: DeploymentHandle | None = None) -> OpenAIService:
        """The OpenAIService of one served model (its engine: this replica's own, or a handle's replicas)."""
        from transformers import AutoTokenizer

        holder: list[ServerMetrics] = []
        if isinstance(engine, EngineConfig):
            meta, client = self._served.model_meta(), self._served
        else:           # streams continue on another replica when theirs is lost (failover.py)
            meta = await engine.model_meta.remote()
            app_name = engine.deployment_id.app_name
            client = FailoverEngineClient(HandleEngineClient(engine), on_failover=lambda: holder[0].failovers.inc(),
                                          app_deleting=lambda: app_being_deleted(app_name),
                                          on_move=lambda: holder[0].moves.inc())
            if prefill_engine is not None:
                client = DisaggregatedEngineClient(prefill_engine, client)
        name, aliases = served_names(model, meta, served_model_name)
        tokenizer = AutoTokenizer.from_pretrained(meta.tokenizer_path)
        limits = ModelLimits(name, aliases, meta.vocab_size, meta.max_model_len,
                             max_prompt_chars(tokenizer, meta.max_model_len), meta.dtype,
                             sequences_in_flight=max(1, meta.max_num_seqs // 2), lora_adapters=meta.lora_adapters,
                             pooling=meta.pooling)
        holder.append(ServerMetrics(name, self._families))
        self._metas.append(meta)
        return OpenAIService(client, tokenizer, limits, holder[0], reasoning_parser, tool_call_parser)

    def __serve_build_asgi_app__(self):
        return create_api(self._table, self._api_key, self._max_body_bytes, self._tenant_keys)

    # ------------------------------------------------------------------ handle API
    async def completions(self, body: dict, tenant: str | None = None) -> dict:
        """POST /v1/completions with ``stream`` false, as a Python call. ``tenant`` (this and the methods below):
        the tenant the request counts for (a name of the ``tenants`` option; handle callers are trusted)."""
        return await self._table.for_body(body).completion({**body, "stream": False}, tenant)

    async def completions_stream(self, body: dict, tenant: str | None = None) -> AsyncIterator[dict]:
        """POST /v1/completions with ``stream`` true: yields the chunk objects (no ``[DONE]``)."""
        async for chunk in self._stream(self._table.for_body(body).open_completion_stream, body, tenant):
            yield chunk

    async def chat(self, body: dict, tenant: str | None = None) -> dict:
        return await self._table.for_body(body).chat({**body, "stream": False}, tenant)

    async def chat_stream(self, body: dict, tenant: str | None = None) -> AsyncIterator[dict]:
        async for chunk in self._stream(self._table.for_body(body).open_chat_stream, body, tenant):
            yield chunk

    async def generate(self, prompt: str | list[int], params: dict | None = None, tenant: str | None = None) -> dict:
        """Complete ``prompt`` (text or token ids) with OpenAI completion ``params``; the whole result."""
        return await self.completions({**(params or {}), "prompt": prompt}, tenant)

    async def generate_stream(self, prompt: str | list[int], params: dict | None = None,
                              tenant: str | None = None) -> AsyncIterator[dict]:
        async for chunk in self.completions_stream({**(params or {}), "prompt": prompt}, tenant):
            yield chunk

    async def responses(self, body: dict) -> dict:
        """POST /v1/responses (OpenAI's Responses API) with ``stream`` false, as a Python call."""
        return await run_bridged(self._table.for_body(body), responses_api, response_events, body, stream=False)

    async def responses_stream(self, body: dict) -> AsyncIterator[dict]:
        """POST /v1/responses with ``stream`` true: yields the Responses event objects."""
        async for event in self._bridged_stream(responses_api, response_events, body):
            yield event

    async def messages(self, body: dict) -> dict:
        """POST /v1/messages (Anthropic's Messages API) with ``stream`` false, as a Python call."""
        return await run_bridged(self._table.for_body(body), messages_api, message_events, body, stream=False)

    async def messages_stream(self, body: dict) -> AsyncIterator[dict]:
        """POST /v1/messages with ``stream`` true: yields the Messages event objects."""
        async for event in self._bridged_stream(messages_api, message_events, body):
            yield event

    async def _bridged_stream(self, api, events_of, body: dict) -> AsyncIterator[dict]:
        events = await run_bridged(self._table.for_body(body), api, events_of, body, stream=True)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def tokenize(self, body: dict) -> dict:
        """POST /tokenize as a Python call: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
        return await self._table.for_body(body).tokenize(body)

    async def detokenize(self, body: dict) -> dict:
        """POST /detokenize as a Python call: ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        return await self._table.for_body(body).detokenize(body)

    async def embeddings(self, body: dict, tenant: str | None = None) -> dict:
        """POST /v1/embeddings as a Python call: ``{"input": ...}`` -> OpenAI's embeddings list."""
        return await PoolingEndpoints(self._table.for_body(body)).embeddings(body, tenant)

    async def rerank(self, body: dict, tenant: str | None = None) -> dict:
        """POST /v1/rerank as a Python call: ``{"query": ..., "documents": [...]}`` (a model served with task
        score)."""
        return await PoolingEndpoints(self._table.for_body(body)).rerank(body, tenant)

    async def score(self, body: dict, tenant: str | None = None) -> dict:
        """POST /score as a Python call: ``{"text_1": ..., "text_2": ...}``."""
        return await PoolingEndpoints(self._table.for_body(body)).score(body, tenant)

    async def drain(self, timeout_s: float = GRACEFUL_SHUTDOWN_S) -> DrainReport:
        """Drain the engine replica this call reaches (see served_engine.py): new requests get 503,
        the ones in flight get ``timeout_s`` to finish. With one replica: the whole app."""
        if self._served is not None:
            return await self._served.drain(timeout_s)
        return await self._engine.drain.remote(timeout_s)

    async def load_lora_adapter(self, body: dict) -> str:
        """POST /v1/load_lora_adapter as a Python call: ``{"lora_name": ..., "lora_path": ...}``."""
        return await self._table.for_body(body).load_lora_adapter(body)

    async def unload_lora_adapter(self, body: dict) -> str:
        """POST /v1/unload_lora_adapter as a Python call: ``{"lora_name": ...}``."""
        return await self._table.for_body(body).unload_lora_adapter(body)

    async def stats(self):
        """EngineStats of the engine replica this call reaches."""
        return await self._client.stats()

    def model_meta(self) -> ModelMeta:
        """The served model's paths, vocabulary size and context length."""
        return self._limits_meta

    # ------------------------------------------------------------------ Serve hooks
    async def check_health(self) -> None:
        """With ``engine_in_ingress``: the engine's replica health (a dead rank, a failed or stalled step
        loop makes Serve replace this replica). Otherwise the engine deployment has its own hook."""
        if self._served is not None:
            await self._served.check_health()

    async def __del__(self) -> None:
        if getattr(self, "_served", None) is not None:
            await self._served.close()

    async def _stream(self, open_stream, body: dict, tenant: str | None = None) -> AsyncIterator[dict]:
        try:
            chunks = await open_stream({**body, "stream": True}, tenant)
        except Exception as exc:
            raise to_api_error(exc) from None
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
