"""The FastAPI application of the ingress: routes, API-key auth, body-size limit, error bodies.

Routes: POST /v1/completions, POST /v1/chat/completions (both with ``stream: true`` -> SSE),
POST /v1/responses (OpenAI's Responses API) and POST /v1/messages (Anthropic's Messages API), both
translated to a chat request (bridges/responses_api.py, bridges/messages_api.py) and streamed with named
SSE events; /v1/messages answers every error in Anthropic's shape and takes the key from ``x-api-key``
too. GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, POST /v1/load_lora_adapter,
POST /v1/unload_lora_adapter (vLLM's shapes; openai/lora_adapters.py), POST /v1/embeddings, POST /v1/rerank (also
/rerank), POST /score (also /v1/score) (openai/embeddings.py), GET /health, GET /metrics. An
``X-Session-Id`` header on completions, chat and responses stands for the body's ``prompt_cache_key``.

Decisions: docs/design/deploy.md, ``pagedray.deploy.http.routes``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..bridges import messages_api, responses_api
from ..bridges.bridged import run_bridged
from ..bridges.chat_bridge import named_sse_event
from ..bridges.messages_stream import message_events
from ..bridges.responses_stream import response_events
from ..openai.embeddings import PoolingEndpoints
from ..openai.errors import APIError, bad_request, health_reason, to_api_error
from ..openai.metrics import METRICS_CONTENT_TYPE
from ..openai.prepare_lanes import input_within
from ..openai.service import OpenAIService
from ..openai.service_table import ServiceTable
from ..openai.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event
from .guard import DEFAULT_MAX_BODY_BYTES
from .tenants import ApiKeys

MAX_SESSION_CHARS = 256     # as prompt_cache_key (openai/protocol.py)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def presented_key(request: Request) -> str | None:
    """The key of ``Authorization: Bearer <key>``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def check_api_key(request: Request, keys: ApiKeys, x_api_key: bool = False) -> str | None:
    """401 unless the request's key is one ``keys`` takes (``Authorization: Bearer``; with ``x_api_key``, for
    Anthropic's clients, an ``x-api-key`` header too); returns its tenant (None: the default one)."""
    if x_api_key and request.headers.get("x-api-key") is not None:
        try:
            return keys.tenant_of(request.headers["x-api-key"])
        except APIError:
            pass
    return keys.tenant_of(presented_key(request))


def check_content_type(request: Request) -> None:
    """JSON bodies only: a Content-Type other than ``application/json`` / ``*/*+json`` is a 415 (a
    missing one is accepted, as most HTTP clients and curl with ``-H`` set it anyway)."""
    header = request.headers.get("content-type")
    if header is None:
        return
    media_type = header.split(";", 1)[0].strip().lower()
    is_json = media_type == "application/json" or (media_type.startswith("application/")
                                                    and media_type.endswith("+json"))
    if not is_json:
        raise APIError(415, f"Content-Type must be application/json, got {header!r}", "invalid_request_error",
                       code="unsupported_media_type")


def _lone_surrogate_path(value) -> str | None:
    """Where a decoded JSON value holds a string with an unpaired UTF-16 surrogate (``"\\ud800"``),
    which no tokenizer or UTF-8 response can carry; None when there is none. Iterative (no recursion)."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), child) for key, child in item.items())
            stack.extend((path or "body", key) for key in item)
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None


def decode_json(raw: bytes):
    """Bytes -> JSON value; APIError 400 for anything that is not one well-formed UTF-8 JSON document."""
    try:
        # strict UTF-8 first: json.loads(bytes) would let UTF-8-encoded surrogates (ED A0 80) through
        text = raw.decode("utf-8").removeprefix("\ufeff")   # a leading byte-order mark is ignored
    except UnicodeDecodeError as exc:
        raise bad_request(f"malformed JSON body: invalid UTF-8 at byte {exc.start} ({exc.reason})",
                          code="invalid_json") from None
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, integers over 4300 digits
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from None
    if "\\u" in text:
        where = _lone_surrogate_path(value)
        if where is not None:
            param = where.split(".", 1)[0]
            raise bad_request(f"{where}: a string holds an unpaired UTF-16 surrogate escape; send valid Unicode",
                              param=None if param == "body" else param, code="invalid_json")
    return value


async def read_json_body(request: Request, max_bytes: int):
    check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                       "invalid_request_error", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes",
                           "invalid_request_error", code="request_too_large")
        chunks.append(chunk)
    return decode_json(b"".join(chunks))


def with_session_header(request: Request, body):
    """An ``X-Session-Id`` header is the body's ``prompt_cache_key`` (the session whose blocks stay cached) when
    the body names none."""
    session = request.headers.get("x-session-id")
    if session is None or not isinstance(body, dict) or body.get("prompt_cache_key") is not None:
        return body
    if not 0 < len(session) <= MAX_SESSION_CHARS:
        raise bad_request(f"X-Session-Id: must be 1-{MAX_SESSION_CHARS} characters, got {len(session)}",
                          param="X-Session-Id")
    return {**body, "prompt_cache_key": session}


# a body with more string characters + entries than this is encoded on a worker thread (module docstring)
SMALL_OUTPUT = 16_384


def json_bytes(content) -> bytes:
    """The JSON encoding of JSONResponse (compact, UTF-8, no NaN)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def json_response(content) -> Response:
    """A JSON response; a big body is encoded on a worker thread, not on the event loop."""
    if input_within(content, SMALL_OUTPUT):
        return JSONResponse(content)
    return Response(await asyncio.to_thread(json_bytes, content), media_type="application/json")


async def sse_body(chunks) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse_event(chunk) if input_within(chunk, SMALL_OUTPUT) else await asyncio.to_thread(sse_event, chunk)
    except Exception as exc:  # noqa: BLE001 - the status is already sent; report in-band
        yield sse_event(to_api_error(exc).body())
    finally:
        await chunks.aclose()
    yield SSE_DONE


async def named_sse_body(events) -> AsyncIterator[str]:
    """Events that name their ``type`` (Responses, Messages) as SSE with ``event:`` lines; no ``[DONE]``. The
    event generators report errors in-band themselves."""
    try:
        async for event in events:
            if input_within(event, SMALL_OUTPUT):
                yield named_sse_event(event["type"], event)
            else:
                yield await asyncio.to_thread(named_sse_event, event["type"], event)
    finally:
        await events.aclose()


def create_api(services: OpenAIService | ServiceTable, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tenant_keys: dict[bytes, str] | None = None) -> FastAPI:
    """``services``: the served model's OpenAIService, or a ServiceTable of several models (a request goes to the
    model its body names: service_table.py). ``api_key``: the admin key; ``tenant_keys``: the tenants' keys
    (``tenants.parse_tenants``)."""
    table = services if isinstance(services, ServiceTable) else ServiceTable([services])
    keys = ApiKeys(api_key, tenant_keys)
    # redirect_slashes off: Starlette's trailing-slash redirect builds its Location from the Host header
    app = FastAPI(title="pagedray", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _any_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

    async def _generate(request: Request, chat: bool):
        tenant = check_api_key(request, keys)
        body = with_session_header(request, await read_json_body(request, max_body_bytes))
        service = table.for_body(body)
        whole, open_stream = ((service.chat, service.open_chat_stream) if chat
                              else (service.completion, service.open_completion_stream))
        if isinstance(body, dict) and body.get("stream") is True:
            chunks = await open_stream(body, tenant)
            return StreamingResponse(sse_body(chunks), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS,
                                     background=BackgroundTask(chunks.aclose))
        return await json_response(await whole(body, tenant))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _bridged(body, api, events_of, tenant: str | None) -> Response:
        """Run a Responses / Messages body through the chat path (``api``: its translation module)."""
        result = await run_bridged(table.for_body(body), api, events_of, body, tenant=tenant)
        if isinstance(result, dict):
            return await json_response(result)
        return StreamingResponse(named_sse_body(result), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS,
                                 background=BackgroundTask(result.aclose))

    @app.post("/v1/responses")
    async def responses(request: Request):
        tenant = check_api_key(request, keys)
        body = with_session_header(request, await read_json_body(request, max_body_bytes))
        return await _bridged(body, responses_api, response_events, tenant)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            tenant = check_api_key(request, keys, x_api_key=True)
            body = await read_json_body(request, max_body_bytes)
            return await _bridged(body, messages_api, message_events, tenant)
        except Exception as exc:  # noqa: BLE001 - every error in Anthropic's shape
            err = to_api_error(exc)
            return JSONResponse(messages_api.error_body(err), status_code=err.status, headers=err.headers)

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, keys)
        return JSONResponse(table.models())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        if not model_id:   # "/v1/models/": an unknown route, like any other trailing slash
            raise StarletteHTTPException(404, "Not Found")
        check_api_key(request, keys)
        return JSONResponse(table.for_model(model_id).model(model_id))

    async def _pooled(request: Request, endpoint):
        tenant = check_api_key(request, keys)
        body = await read_json_body(request, max_body_bytes)
        return await json_response(await endpoint(PoolingEndpoints(table.for_body(body)))(body, tenant))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await _pooled(request, lambda pooling: pooling.embeddings)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(request: Request):
        return await _pooled(request, lambda pooling: pooling.rerank)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        return await _pooled(request, lambda pooling: pooling.score)

    async def _admin(request: Request, load: bool) -> Response:
        keys.check_admin(presented_key(request))
        body = await read_json_body(request, max_body_bytes)
        service = table.for_body(body)
        run = service.load_lora_adapter if load else service.unload_lora_adapter
        return PlainTextResponse(await run(body))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await _admin(request, load=True)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await _admin(request, load=False)

    async def _tokenizer_call(request: Request, encode: bool) -> Response:
        check_api_key(request, keys)
        body = await read_json_body(request, max_body_bytes)
        service = table.for_body(body)
        return await json_response(await (service.tokenize if encode else service.detokenize)(body))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _tokenizer_call(request, encode=True)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _tokenizer_call(request, encode=False)

    @app.get("/health")
    async def health() -> Response:
        try:
            await table.check_ready()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return JSONResponse({"status": "unhealthy", "reason": health_reason(exc)}, status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_api_key(request, keys)
        return Response(await table.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    return app
