"""TEST DOUBLE: a tiny fake OpenAI streaming server for the load-tester tests (not a model server).

It listens on 127.0.0.1 on a free port, in a background thread with its own event loop (aiohttp), and
answers ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming only), ``GET /v1/models``
(``FakeBehavior.models``) and ``GET /metrics``.

Behaviour is fully deterministic and set by ``FakeBehavior``:
- output token i of a prompt is ``fake_token(prompt, i)`` (a word picked by crc32), ``max_tokens`` of them;
- the first token is written ``first_token_delay_s`` after the request arrives, each next one
  ``inter_token_delay_s`` after the previous one;
- ``faults`` is cycled over requests in arrival order: ``ok``, ``429`` / ``500`` (HTTP error before any
  streaming), ``stall`` (headers, then silence for ``stall_s``), ``stream_error`` (an error event after
  the first token), ``disconnect`` (the connection is cut after the first token);
- with ``corrupt_min_in_flight`` set, a response whose token ``corrupt_at`` is produced while at least
  that many requests are in flight gets that token dropped, duplicated or replaced (``corruption``), and
  its prompt is appended to ``FakeOpenAIServer.corrupted`` -- the oracle for ``--check`` tests;
- with ``strict_model``, a request naming a model that ``models`` does not list gets a 404 with an
  OpenAI error body (what a server started with ``--model PATH`` answers to ``"model": "default"``);
- ``usage.completion_tokens`` (when ``stream_options.include_usage``) counts the pieces actually sent;
- ``/metrics`` exports the gauges the load tester polls: running = requests in flight, waiting = 0,
  KV usage = in flight / ``kv_capacity``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import zlib
from dataclasses import dataclass

from aiohttp import web

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa")


def fake_token(prompt: str, i: int) -> str:
    return " " + WORDS[zlib.crc32(f"{prompt}|{i}".encode()) % len(WORDS)]


def expected_pieces(prompt: str, max_tokens: int) -> list[str]:
    return [fake_token(prompt, i) for i in range(max_tokens)]


@dataclass
class FakeBehavior:
    first_token_delay_s: float = 0.0
    inter_token_delay_s: float = 0.0
    faults: tuple[str, ...] = ()
    stall_s: float = 1.0
    corrupt_min_in_flight: int | None = None
    corrupt_at: int = 2
    corruption: str = "duplicate"   # "drop" | "duplicate" | "replace"
    kv_capacity: int = 8
    models: tuple[str, ...] = ("fake",)
    strict_model: bool = False


class FakeOpenAIServer:
    """Context manager: ``with FakeOpenAIServer(FakeBehavior(...)) as server: server.url``."""

    def __init__(self, behavior: FakeBehavior | None = None) -> None:
        self.behavior = behavior or FakeBehavior()
        self.arrivals = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.corrupted: list[str] = []
        self.metrics_polls = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> FakeOpenAIServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(sock), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self, sock: socket.socket) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_polls += 1
        usage = self.in_flight / self.behavior.kv_capacity
        text = ("# HELP pagedray:num_requests_running requests running\n"
                "# TYPE pagedray:num_requests_running gauge\n"
                f'pagedray:num_requests_running{{model="fake"}} {self.in_flight}\n'
                f"pagedray:num_requests_waiting 0\n"
                f'pagedray:kv_cache_usage_perc{{model="fake"}} {usage}\n')
        return web.Response(text=text)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "fake"}
                                                             for name in self.behavior.models]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._serve(request, body, body["prompt"], chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._serve(request, body, body["messages"][-1]["content"], chat=True)

    def _next_fault(self) -> str:
        faults = self.behavior.faults
        fault = faults[self.arrivals % len(faults)] if faults else "ok"
        self.arrivals += 1
        return fault

    async def _serve(self, request: web.Request, body: dict, prompt: str, chat: bool) -> web.StreamResponse:
        fault = self._next_fault()
        if self.behavior.strict_model and body.get("model") not in self.behavior.models:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        if fault in ("429", "500"):
            return web.json_response({"error": {"message": f"fake {fault}"}}, status=int(fault))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if fault == "stall":
                await asyncio.sleep(self.behavior.stall_s)
                return response
            await self._stream_tokens(request, response, body, prompt, chat, fault)
            return response
        finally:
            self.in_flight -= 1

    def _pieces_at(self, prompt: str, i: int) -> list[str]:
        token = fake_token(prompt, i)
        b = self.behavior
        if b.corrupt_min_in_flight is None or i != b.corrupt_at or self.in_flight < b.corrupt_min_in_flight:
            return [token]
        self.corrupted.append(prompt)
        return {"drop": [], "duplicate": [token, token], "replace": [" CORRUPT"]}[b.corruption]

    async def _stream_tokens(self, request, response, body, prompt, chat, fault) -> None:
        b = self.behavior
        sent = 0
        if chat:
            await _event(response, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(b.first_token_delay_s)
        for i in range(body["max_tokens"]):
            if i > 0:
                await asyncio.sleep(b.inter_token_delay_s)
            if i == 1 and fault == "stream_error":
                await _event(response, {"error": {"message": "fake failure mid-stream"}})
                return
            if i == 1 and fault == "disconnect":
                request.transport.close()
                return
            for piece in self._pieces_at(prompt, i):
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await _event(response, {"choices": [choice]})
                sent += 1
        final = {"choices": [{"index": 0, "finish_reason": "length",
                              **({"delta": {}} if chat else {"text": ""})}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            final["usage"] = {"prompt_tokens": len(prompt.split()), "completion_tokens": sent}
        await _event(response, final)
        await response.write(b"data: [DONE]\n\n")


async def _event(response: web.StreamResponse, chunk: dict) -> None:
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
