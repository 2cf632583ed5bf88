"""Issue #32's red-team cases (fault isolation) for ``benchmarks.red_team``: each takes the server URL and
returns (expected, observed, ok), like the cases there.

Request-level cases: a grammar llguidance finds too complex, penalties that underflow float32, recursive
and deeply nested schemas, grammar + logprobs, malformed tool structures, floods of the prepare thread
(/tokenize, empty chat messages), a huge prompt-logprobs response, costly grammar masks next to a
stream, and no internals in any error body or in /health. After each, the engine must still answer.
CLI cases (their own processes): bad option values, ``--num-replicas 2`` on the private Ray, and the
time an idle server takes to exit after SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from benchmarks.red_team_client import API_KEY, AUTH, in_threads, post, stream_gaps
from benchmarks.serving import PAGEDRAY_CLI

INTERNALS = ("Traceback", 'File "', "site-packages", "actor_id", "pid=")


def _leaks(text: str) -> bool:
    return any(piece in text for piece in INTERNALS)


def _engine_answers(url: str) -> bool:
    response = post(url, {"prompt": "Hello", "max_tokens": 1, "temperature": 0}, timeout=120)
    return response.status_code == 200


def _statuses(responses) -> list:
    return [getattr(r, "status_code", type(r).__name__) for r in responses]


def _timed_short_request(url: str) -> float:
    start = time.monotonic()
    post(url, {"prompt": "Hi", "max_tokens": 1, "temperature": 0}, timeout=300)
    return time.monotonic() - start


def case_grammar_too_complex(url):
    body = {"prompt": "x", "max_tokens": 4, "n": 16, "temperature": 1,
            "structured_outputs": {"regex": "(a{1000}){1000}"}}
    response = post(url, body)
    alive = _engine_answers(url)
    ok = response.status_code == 400 and not _leaks(response.text) and alive
    return ("400 naming structured_outputs; the engine still answers",
            f"{response.status_code} {response.text[:90]!r}; engine answers: {alive}", ok)


def case_penalty_underflow(url):
    bodies = [{"prompt": "Is the sky blue?", "max_tokens": 4, "temperature": 0, "repetition_penalty": 1e-50,
               "structured_outputs": {"choice": ["yes", "no"]}},
              {"prompt": "Is the sky blue?", "max_tokens": 4, "temperature": 0, "repetition_penalty": 1e-50},
              {"prompt": "Is the sky blue?", "max_tokens": 4, "temperature": 1e39}]
    responses = [post(url, body) for body in bodies]
    params = [r.json()["error"]["param"] if r.status_code == 400 else None for r in responses]
    alive = _engine_answers(url)
    ok = params == ["repetition_penalty", "repetition_penalty", "temperature"] and alive
    return "400 naming the field, 3 times; the engine still answers", f"params {params}; engine answers: {alive}", ok


def case_schemas(url):
    recursive = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    nested = "[" * 50_000 + "]" * 50_000
    bodies = [{"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": recursive}},
              {"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": nested}}]
    responses = [post(url, body) for body in bodies]
    statuses = _statuses(responses)
    ok = statuses == [400, 400] and not any(_leaks(r.text) for r in responses)
    return "recursive $ref: 400; a schema nested 50,000 deep: 400", f"statuses {statuses}", ok


def _strict(text: str):
    def reject(constant):
        raise ValueError(f"{constant} in the response")
    return json.loads(text, parse_constant=reject)


def case_grammar_logprobs(url):
    body = {"prompt": "Is the sky blue? Answer:", "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "structured_outputs": {"choice": [" yes", " no"]}}
    plain = post(url, body)
    stream = post(url, {**body, "stream": True})
    try:
        _strict(plain.text)
        for block in stream.text.split("\n\n"):
            if block.startswith("data: {"):
                _strict(block[len("data: "):])
        valid = True
    except ValueError:
        valid = False
    ok = plain.status_code == 200 and stream.status_code == 200 and valid
    return ("200, stream and not; only finite logprobs (valid JSON)",
            f"statuses {plain.status_code}/{stream.status_code}; strict JSON: {valid}", ok)


def case_tools(url):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    user = {"role": "user", "content": "Weather in Oslo?"}
    bodies = [
        {"messages": [user], "tools": [tool], "tool_choice": {"type": "function", "function": "get_weather"}},
        {"messages": [user, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo"}}}]}], "tools": [tool]},
        {"messages": [user, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": "get_weather"}]}], "tools": [tool]},
    ]
    responses = [post(url, {**body, "max_tokens": 4}, path="/v1/chat/completions") for body in bodies]
    forced = {"messages": [user], "tools": [tool], "max_tokens": 40, "temperature": 0,
              "structured_outputs": {"regex": r'<tool_call>\{"name": \[1\], "arguments": \{\}\}</tool_call>'}}
    output = post(url, forced, path="/v1/chat/completions")
    statuses = _statuses(responses) + [output.status_code]
    ok = all(s == 400 for s in statuses[:3]) and statuses[3] in (200, 400) and not _leaks(output.text)
    return ("3 malformed tool structures: 400; a malformed <tool_call> output: plain content (or a 400), no 500",
            f"statuses {statuses}", ok)


def _delay_next_to(url: str, flood) -> tuple[float, float, list]:
    """(a short request's latency alone, its latency while ``flood`` runs in threads, the flood's statuses)."""
    alone = _timed_short_request(url)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("statuses", _statuses(flood())))
    thread.start()
    time.sleep(0.5)
    loaded = _timed_short_request(url)
    thread.join()
    return alone, loaded, out.get("statuses", [])


def case_prepare_floods(url):
    big = "word " * 800_000   # 4 MB
    tokenize = _delay_next_to(url, lambda: in_threads(lambda: post(url, {"prompt": big}, path="/tokenize"),
                                                      [()] * 8))
    messages = [{"role": "user", "content": ""}] * 125_000
    chat = _delay_next_to(url, lambda: in_threads(
        lambda: post(url, {"messages": messages, "max_tokens": 1}, path="/v1/chat/completions"), [()] * 2))
    delays = [loaded - alone for alone, loaded, _ in (tokenize, chat)]
    ok = all(d <= 1.0 for d in delays)
    return ("a short request next to 8 x 4 MB /tokenize or 2 x 125,000-message chats: at most ~1 s later",
            f"delays {delays[0]:.2f} s / {delays[1]:.2f} s; flood statuses {sorted(set(map(str, tokenize[2])))} / "
            f"{sorted(set(map(str, chat[2])))}", ok)


def case_prompt_logprobs_response(url):
    body = {"prompt": "hello " * 6000, "max_tokens": 1, "n": 16, "prompt_logprobs": 20, "temperature": 1}
    start = time.monotonic()
    response = post(url, body)
    seconds = time.monotonic() - start
    size = len(response.content)
    ok = response.status_code in (200, 400)
    return ("a 6,000-token prompt with prompt_logprobs 20 and n 16: answered (or refused up front); "
            "/health stays fast", f"{response.status_code}, {size / 1e6:.1f} MB in {seconds:.1f} s", ok)


def case_costly_masks(url):
    running = {}
    stream = threading.Thread(target=stream_gaps, args=(url, {"prompt": "Count:", "max_tokens": 64,
                                                              "ignore_eos": True}, running))
    stream.start()
    time.sleep(1.0)
    body = {"prompt": "x", "max_tokens": 8, "n": 16, "temperature": 1, "structured_outputs": {"regex": "a{100000}"}}
    statuses = _statuses(in_threads(lambda: post(url, body), [()] * 3))
    stream.join()
    gap = running.get("max_gap_s", 0.0)
    ok = all(s in (200, 400) for s in statuses) and gap <= 1.5
    return ("3 x n=16 a{100000} grammars: refused or served; a running stream's longest gap <= ~1 s",
            f"statuses {statuses}; longest stream gap {gap:.2f} s", ok)


def case_no_internals(url):
    health = httpx.get(url + "/health", timeout=30, trust_env=False)
    wrong = post(url, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": "("}})
    ok = health.status_code == 200 and not _leaks(health.text) and not _leaks(wrong.text)
    return "/health and error bodies carry no traceback, path or pid", f"/health {health.text[:40]!r}", ok


def _cli(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PAGEDRAY_CLI, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_ADDRESS": "local"})


def case_cli_bad_values(url):
    cases = [["serve", "--max-num-seqs", "-5"], ["serve", "--block-size", "7"], ["serve", "--port", "99999"],
             ["serve", "--model", "/nonexistent"], ["serve", "--kv-cache-gib", "1000"]]
    results = [_cli(args) for args in cases]
    codes = [r.returncode for r in results]
    tracebacks = sum("Traceback" in r.stderr for r in results)
    started_ray = sum("Started a local Ray" in r.stderr + r.stdout for r in results)
    ok = codes == [2] * len(cases) and tracebacks == 0 and started_ray == 0
    return ("exit 2 with one line naming the option, before Ray starts",
            f"exit codes {codes}; {tracebacks} tracebacks; {started_ray} started Ray", ok)


def _serve(port: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-c", PAGEDRAY_CLI, "serve", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", API_KEY, *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "RAY_ADDRESS": "local"})


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 900.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def _exit_after_sigterm(proc: subprocess.Popen, timeout_s: float = 120.0) -> float | None:
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None
    return time.monotonic() - start


def case_two_replicas_and_sigterm(url):
    """A second server with ``--num-replicas 2``: both engine replicas in /metrics; then SIGTERM on it
    while idle: it exits within 5 s."""
    port = int(url.rsplit(":", 1)[1]) + 1
    other = f"http://127.0.0.1:{port}"
    proc = _serve(port, ["--num-replicas", "2"])
    replicas, exit_s = 0, None
    try:
        if _wait_healthy(proc, other):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and replicas < 2:
                text = httpx.get(other + "/metrics", headers=AUTH, timeout=30, trust_env=False).text
                replicas = len({line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                                if line.startswith("pagedray:num_requests_running{") and 'replica="' in line})
                time.sleep(2)
        exit_s = _exit_after_sigterm(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ok = replicas == 2 and exit_s is not None and exit_s <= 5.0
    exited = "did not exit" if exit_s is None else f"exited {exit_s:.1f} s after SIGTERM (idle)"
    return "2 engine replicas in /metrics; an idle server exits within 5 s of SIGTERM", \
        f"{replicas} replicas; {exited}", ok


CASES = [("grammar too complex (n=16)", case_grammar_too_complex),
         ("penalty underflow / temperature overflow", case_penalty_underflow),
         ("recursive / deeply nested schemas", case_schemas), ("grammar + logprobs", case_grammar_logprobs),
         ("malformed tools", case_tools), ("prepare-thread floods", case_prepare_floods),
         ("huge prompt-logprobs response", case_prompt_logprobs_response),
         ("costly grammar masks next to a stream", case_costly_masks), ("no internals", case_no_internals),
         ("CLI bad values", case_cli_bad_values), ("--num-replicas 2, then SIGTERM", case_two_replicas_and_sigterm)]
