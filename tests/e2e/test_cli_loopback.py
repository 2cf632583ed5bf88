"""`pagedray serve` with its private Ray listens on loopback only: every listening TCP socket of the
CLI's process tree (the CLI, GCS, raylet, dashboard and agents, the Serve controller and proxy, the
ingress and engine replicas, the TP worker) is on 127.0.0.0/8, ::1 or an IPv4-mapped loopback address.
The served app is also checked with the official openai client (chat, streamed chat, tool calls, Responses)
and anthropic client (Messages, tool use), whole and streamed (cheaper here than in a server of their own).
The engine runs in a deployment of its own (``--no-engine-in-ingress``), so both of pagedray's replica
kinds are covered. Runs the real CLI in a subprocess; the time limits only end a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from pagedray.deploy.serve.loopback import is_loopback
from test_cli_serve_failure import CLI, free_port

from benchmarks.listening_sockets import listening_sockets

# slow: the extended tier (README: -m slow); CI keeps test_loopback.py's units; .ci/serve_smoke starts `pagedray serve`
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process

HANG_GUARD_S = 900


def _get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


def _responses_and_messages_clients(url: str) -> None:
    """The official openai and anthropic clients against the served /v1/responses and /v1/messages."""
    import anthropic
    import openai

    oai = openai.OpenAI(api_key="none", base_url=url + "/v1", timeout=HANG_GUARD_S)
    model = oai.models.list().data[0].id
    response = oai.responses.create(model=model, input="Say hi.", max_output_tokens=4, temperature=0)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
    with oai.responses.stream(model=model, input="Say hi.", max_output_tokens=4, temperature=0) as stream:
        assert [event.type for event in stream][0] == "response.created"
    claude = anthropic.Anthropic(api_key="none", base_url=url, timeout=HANG_GUARD_S)
    message = claude.messages.create(model=model, max_tokens=4,
                                     messages=[{"role": "user", "content": "Say hi."}])
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens >= 1
    with claude.messages.stream(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        assert s.get_final_message().usage.output_tokens >= 1
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": None}}]
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                                       temperature=0)
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0, stream=True)
        if c.choices)
    assert chat.choices[0].message.content == streamed_chat and chat.usage.completion_tokens == 4
    # tools, with the choice forced (the grammar makes this small model call): whole and streamed
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
            "required": ["city"]}
    ask = "Weather in Oslo?"
    weather = [{"type": "function", "name": "get_weather", "parameters": city}]
    response = oai.responses.create(model=model, input=ask, max_output_tokens=60, temperature=0,
                                    tool_choice="required", parallel_tool_calls=False, tools=weather)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Paris")
    with oai.responses.stream(model=model, input=ask, max_output_tokens=60, temperature=0,
                              tool_choice="required", parallel_tool_calls=False, tools=weather) as stream:
        final = stream.get_final_response()
    assert [item.name for item in final.output if item.type == "function_call"] == ["get_weather"]
    chat_tools[0]["function"]["parameters"] = city
    forced = dict(model=model, messages=[{"role": "user", "content": ask}], max_tokens=60, temperature=0,
                  tools=chat_tools, tool_choice="required", parallel_tool_calls=False)
    (chat_call,) = oai.chat.completions.create(**forced).choices[0].message.tool_calls
    with oai.chat.completions.stream(**forced) as chat_stream:
        (streamed_call,) = chat_stream.get_final_completion().choices[0].message.tool_calls
    assert chat_call.function.name == streamed_call.function.name == "get_weather"
    assert json.loads(streamed_call.function.arguments) == json.loads(chat_call.function.arguments)
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": city}]
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    message = claude.messages.create(model=model, max_tokens=60, tools=tools, tool_choice=one_call,
                                     messages=[{"role": "user", "content": ask}])
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Oslo", "Paris")
    assert set(use.input) == {"city"}                      # strict by default: no keys the schema does not list
    with claude.messages.stream(model=model, max_tokens=60, tools=tools, tool_choice=one_call,
                                messages=[{"role": "user", "content": ask}]) as s:
        streamed = s.get_final_message()   # sampled (this client sends no temperature): a call, maybe another city
    (use,) = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and use.input == {"city": use.input["city"]}


def test_a_served_app_and_its_private_ray_listen_on_loopback_only(default_model_path, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS")}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--model", str(default_model_path),
                               "--port", str(port), "--no-engine-in-ingress"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_GUARD_S
        while _get(url + "/health")[0] != 200:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no /health within the hang guard"
            time.sleep(1)
        status, _ = _get(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert status == 200                     # the ingress reached the engine replica over Serve
        _responses_and_messages_clients(url)
        sockets = listening_sockets(server.pid)
        names = {name for *_, name in sockets}
        assert any(p == port for _, p, _, _ in sockets), sockets        # the served port is seen
        assert len(sockets) >= 8 and "gcs_server" in names and "raylet" in names, sockets
        public = [s for s in sockets if not is_loopback(s[0])]
        assert public == [], public
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
