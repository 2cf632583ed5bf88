"""Load-test targets: an OpenAI-compatible HTTP endpoint, or a Serve app through a DeploymentHandle.

A target is an async context manager with ``send(spec, record)``: it sends one streaming request, fills
the RequestRecord (see record.py) and never raises for a failed request -- the failure cause is
written into the record instead, so one bad request never stops the run.

HTTP target decisions:
- ``POST {url}/v1/completions`` (``prompt``) or ``{url}/v1/chat/completions`` (one user message), always
  with ``stream: true`` and ``stream_options: {"include_usage": true}``; ``temperature`` only when set;
  ``--extra-body`` JSON is merged in (e.g. ``{"ignore_eos": true}`` for servers that know it; servers that
  reject unknown fields, such as ``transformers serve``, get none by default).
- ``--url`` may end with ``/v1``; it is stripped so ``/metrics`` is found at the server root.
- One shared ``httpx.AsyncClient`` without a connection cap (open-loop load must not be throttled by the
  client), ``trust_env=False`` so proxy settings in the environment never divert loopback traffic.
- Each request is bounded by ``timeout_s`` as a whole (connect + full stream).

Handle target: ``serve.get_app_handle(app).options(stream=True)`` and the ingress's streaming method,
called with the same OpenAI request body the HTTP target posts. The method names are the constants
``HANDLE_STREAM_METHOD`` (completions) and ``HANDLE_CHAT_STREAM_METHOD`` (chat), called in exactly one
place, ``open_handle_stream``.
Matched against deploy/serve/ingress.py (OpenAIIngress.completions_stream / chat_stream, body dict in, chunk dicts
out) while it was being written; re-check if the ingress renames them.
Items it yields may be chunk dicts, pydantic chunk models, or SSE text (str/bytes).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from pagedray.deploy.loadtest.prompts import PromptSpec
from pagedray.deploy.loadtest.record import (
    CAUSE_CONNECTION,
    CAUSE_STREAM,
    CAUSE_TIMEOUT,
    RequestRecord,
    StreamError,
    StreamParser,
    http_cause,
)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# The ingress's streaming handle methods (deploy/serve/ingress.py, OpenAIIngress): each takes the OpenAI
# request body as a dict and yields chunk dicts (no [DONE]).
HANDLE_STREAM_METHOD = "completions_stream"
HANDLE_CHAT_STREAM_METHOD = "chat_stream"
CAUSE_HANDLE = "handle_error"
ERROR_BODY_LIMIT = 300


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run carries besides its prompt."""

    model: str
    endpoint: str = "completions"
    temperature: float | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint: must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {self.timeout_s!r}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")


def build_payload(spec: PromptSpec, options: RequestOptions) -> dict:
    """The OpenAI request body for one prompt."""
    payload: dict = {"model": options.model, "max_tokens": spec.max_tokens, "stream": True,
                     "stream_options": {"include_usage": True}}
    if options.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    if options.temperature is not None:
        payload["temperature"] = options.temperature
    payload.update(options.extra_body)
    return payload


def server_root(url: str) -> str:
    """``http://host:port/v1/`` -> ``http://host:port``; ValueError naming ``url`` if not http(s)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url: must start with http:// or https://, got {url!r}")
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def served_model(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id of ``GET {root}/v1/models`` (the model a server started with ``--model PATH``
    answers to; vLLM's benchmark client asks the same way); LookupError saying to pass ``--model`` when
    the server does not list one."""
    url = server_root(url) + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=False)
        response.raise_for_status()
        models = [entry["id"] for entry in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        raise LookupError(f"--model not given and {url} lists no model ({type(err).__name__}: {err}); "
                          "pass --model") from None
    if not models:
        raise LookupError(f"--model not given and {url} lists no model; pass --model")
    return models[0]


async def _measured(record: RequestRecord, stream_coro, timeout_s: float) -> None:
    """Run one request's stream coroutine, mapping every failure to a cause on the record."""
    try:
        await asyncio.wait_for(stream_coro, timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.fail(CAUSE_TIMEOUT, f"no complete response within {timeout_s} s")
    except httpx.TransportError as err:
        record.fail(CAUSE_CONNECTION, f"{type(err).__name__}: {err}")
    except StreamError as err:
        record.fail(CAUSE_STREAM, str(err))


class HttpTarget:
    """Streams requests to an OpenAI-compatible server."""

    def __init__(self, url: str, options: RequestOptions, api_key: str | None = None) -> None:
        self.root = server_root(url)
        self.options = options
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: httpx.AsyncClient | None = None

    @property
    def metrics_url(self) -> str:
        return self.root + "/metrics"

    async def __aenter__(self) -> HttpTarget:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.options.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False, headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def send(self, spec: PromptSpec, record: RequestRecord) -> None:
        sent = time.perf_counter()
        parser = StreamParser(record, lambda: time.perf_counter() - sent)
        await _measured(record, self._stream(spec, parser), self.options.timeout_s)
        if record.end_s is None:
            record.end_s = time.perf_counter() - sent

    async def _stream(self, spec: PromptSpec, parser: StreamParser) -> None:
        url = self.root + ENDPOINT_PATHS[self.options.endpoint]
        async with self.client.stream("POST", url, json=build_payload(spec, self.options)) as response:
            if response.status_code >= 400:
                body = (await response.aread())[:ERROR_BODY_LIMIT].decode("utf-8", "replace")
                parser.record.fail(http_cause(response.status_code), body)
                return
            async for line in response.aiter_lines():
                parser.feed_line(line)
        parser.finish()


def open_handle_stream(handle, payload: dict, endpoint: str):
    """The single call site of the ingress's streaming methods (``HANDLE_STREAM_METHOD``, ``..._CHAT_...``)."""
    if endpoint == "chat":
        return handle.chat_stream.remote(payload)
    return handle.completions_stream.remote(payload)


class HandleTarget:
    """Streams requests to a Serve app through ``serve.get_app_handle(app_name)``.

    ``handle`` may be given directly (tests pass a stand-in object); otherwise it is looked up on enter.
    """

    def __init__(self, app_name: str, options: RequestOptions, handle=None) -> None:
        if not app_name:
            raise ValueError("handle: the Serve application name must not be empty")
        self.app_name = app_name
        self.options = options
        self.handle = handle
        self.metrics_url: str | None = None

    async def __aenter__(self) -> HandleTarget:
        if self.handle is None:
            from ray import serve

            self.handle = serve.get_app_handle(self.app_name).options(stream=True)
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def send(self, spec: PromptSpec, record: RequestRecord) -> None:
        sent = time.perf_counter()
        parser = StreamParser(record, lambda: time.perf_counter() - sent)
        try:
            await _measured(record, self._stream(spec, parser), self.options.timeout_s)
        except Exception as err:  # noqa: BLE001 - any error raised through the handle is this request's
            record.fail(CAUSE_HANDLE, f"{type(err).__name__}: {err}")
        if record.end_s is None:
            record.end_s = time.perf_counter() - sent

    async def _stream(self, spec: PromptSpec, parser: StreamParser) -> None:
        async for item in open_handle_stream(self.handle, build_payload(spec, self.options),
                                            self.options.endpoint):
            if isinstance(item, bytes):
                item = item.decode("utf-8")
            if isinstance(item, str):
                parser.feed_text(item)
            elif isinstance(item, dict):
                parser.feed_chunk(item)
            elif hasattr(item, "model_dump"):
                parser.feed_chunk(item.model_dump())
            else:
                raise StreamError(f"unexpected item from the handle: {type(item).__name__}")
        parser.finish()


def parse_extra_body(text: str | None) -> dict:
    """``--extra-body`` JSON object; ValueError naming the option otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"extra_body: not valid JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise ValueError("extra_body: must be a JSON object")
    return value
