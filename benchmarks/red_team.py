"""Red-team replay of issues #17's and #32's findings against a live ``pagedray serve``: one row per case.

    python -m benchmarks.red_team [--port 18700] [--out benchmarks/results/red_team.json]

Starts ``pagedray serve`` (the CLI's defaults: private Ray, default model, 127.0.0.1) with an API key,
then replays each finding. While a case runs, a thread polls ``/health`` every 0.25 s and records the
worst status and the slowest answer ("health during"). Each row: case, what is expected, what
happened, the case's wall time, health during, and ``ok`` or ``DEFECT``. Prints the table, writes JSON
and exits 1 when any row is a defect. A measurement script, not a test: it races nothing, it reports.

Cases: big prompts (8 concurrent 3.9 MB prompts while a stream runs), a long prefill (health during a
step of several seconds), raw surrogate bytes, unfinished headers (8 x 8 MiB) and slowloris sockets,
seeded n > 1, partial-character logprobs, one batch request next to a short one, echo of token ids, and
the open surfaces (Host-built redirect, unauthenticated routes, non-loopback listening sockets); then issue
#32's fault-isolation cases (``red_team_isolation.py``: requests that used to kill the engine or stall
other clients, internals in error bodies, and the CLI's bad values, ``--num-replicas 2`` and SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys
import threading
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import httpx

# the polling sampler is test-support code, kept beside the tests that use it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.burst_load import StatsSampler
from pagedray.deploy.serve.loopback import is_loopback

from benchmarks.common import machine
from benchmarks.listening_sockets import listening_sockets
from benchmarks.red_team_client import API_KEY, AUTH, in_threads, post, stream_gaps
from benchmarks.serving import PAGEDRAY_CLI, RunningServer, SystemSpec


def health_watch(url: str) -> StatsSampler:
    """A sampler (tests/helpers/burst_load.py) of (status, seconds) answers of GET /health every 0.25 s."""
    client = httpx.Client(timeout=30, trust_env=False)

    def probe() -> tuple[object, float]:
        start = time.monotonic()
        try:
            status = client.get(url + "/health").status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        return status, time.monotonic() - start

    return StatsSampler(probe, period_s=0.25)


def health_summary(watch: StatsSampler) -> tuple[bool, str]:
    ok = sum(status == 200 for status, _ in watch.samples)
    slowest = max((seconds for _, seconds in watch.samples), default=0.0)
    return ok == len(watch.samples), f"{ok}/{len(watch.samples)} ok, slowest {slowest:.1f} s"


# -- cases: each returns (expected, observed, ok) ---------------------------------------------------
def case_big_prompts(url):
    running = {}
    stream = threading.Thread(target=stream_gaps, args=(url, {"prompt": "Count:", "max_tokens": 48,
                                                              "ignore_eos": True}, running))
    stream.start()
    prompt = "word " * 780_000   # 3.9 MB
    statuses = [getattr(r, "status_code", r) for r in in_threads(lambda: post(url, {"prompt": prompt}),
                                                                    [()] * 8)]
    stream.join()
    ok = all(s == 400 for s in statuses)
    return ("8 x 400 quickly; the running stream keeps flowing",
            f"statuses {sorted(set(map(str, statuses)))}; longest stream gap {running.get('max_gap_s', 0):.1f} s", ok)


def case_long_prefill(url):
    response = post(url, {"prompt": "hello " * 7000, "max_tokens": 1})
    return ("200; /health stays 200 during the long prefill step", f"status {response.status_code}",
            response.status_code == 200)


def case_surrogate_bytes(url):
    bodies = [b'{"prompt":"a\xed\xa0\x80b","max_tokens":2}', b'{"prompt":["x","\xed\xbf\xbf"],"max_tokens":2}',
              b'{"prompt":"a\xed\xa0\x80","max_tokens":2,"stream":true}']
    statuses = [post(url, None, raw=b).status_code for b in bodies]
    chat = post(url, None, raw=b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}],"max_tokens":1}',
                path="/v1/chat/completions").status_code
    statuses.append(chat)
    return "400 invalid_json for each", f"statuses {statuses}", all(s == 400 for s in statuses)


def _header_flood(host: str, port: int, size: int) -> str:
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        sent, chunk = 0, b"X-Pad: " + b"a" * 65_000 + b"\r\n"
        try:
            while sent < size:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            return f"closed after {sent >> 20} MiB"
        return f"accepted {sent >> 20} MiB"


def case_header_limits(url):
    host, port = url.split("//")[1].split(":")
    outcomes = in_threads(_header_flood, [(host, int(port), 8 << 20)] * 8)
    socks = []
    for _ in range(50):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # never finished
        socks.append(sock)
    time.sleep(15)
    alive = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            alive += sock.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
        sock.close()
    accepted = sum("accepted" in str(o) for o in outcomes)
    return ("oversized headers refused (431 / closed); slow headers timed out",
            f"{accepted}/8 floods of 8 MiB accepted; {alive}/50 slowloris sockets open after 15 s",
            accepted == 0 and alive == 0)


def case_seeded_n(url):
    body = {"prompt": "Tell me a story:", "max_tokens": 12, "n": 4, "seed": 7, "temperature": 1.0}
    first = [c["text"] for c in post(url, body).json()["choices"]]
    again = [c["text"] for c in post(url, body).json()["choices"]]
    ok = len(set(first)) == 4 and first == again
    return "4 distinct choices, the same on a rerun", f"{len(set(first))} distinct, rerun equal: {first == again}", ok


def case_partial_logprobs(url):
    choice = post(url, {"prompt": "Emoji time: 🚀🌊🎉 and", "max_tokens": 24, "logprobs": 2,
                        "temperature": 0}).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    replacement = sum("\ufffd" in t for t in lp["tokens"])
    short_tops = sum(len(t) < 2 for t in lp["top_logprobs"])
    offsets_ok = lp["text_offset"] == sorted(lp["text_offset"]) and all(o <= len(text) for o in lp["text_offset"])
    ok = replacement == 0 and short_tops == 0 and offsets_ok
    return ("no U+FFFD tokens, 2 top entries each, offsets inside the text",
            f"{replacement} U+FFFD tokens, {short_tops} short top lists, offsets ok: {offsets_ok}", ok)


def case_batch_next_to_short(url):
    huge = post(url, {"prompt": ["go"] * 64, "n": 16, "max_tokens": 4000, "ignore_eos": True})
    batch_body = {"prompt": ["Write a list:"] * 64, "n": 2, "max_tokens": 96, "ignore_eos": True}
    batch = threading.Thread(target=post, args=(url, batch_body))
    batch.start()
    time.sleep(2)
    start = time.monotonic()
    first_chunk = None
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True},
                      headers=AUTH, timeout=600, trust_env=False) as response:
        for _ in response.iter_lines():
            first_chunk = time.monotonic() - start
            break
    batch.join()
    return ("the 64 x n=16 x 4000 request refused (400); a short request starts next to a 64-prompt batch",
            f"huge: {huge.status_code}; short request's first chunk after {first_chunk:.1f} s",
            huge.status_code == 400 and first_chunk is not None)


def case_echo_token_ids(url):
    choice = post(url, {"prompt": [504, 3575, 282], "echo": True, "max_tokens": 2}).json()["choices"][0]
    return "the decoded prompt, then the completion", repr(choice["text"][:40]), len(choice["text"]) > 0


def case_open_surfaces(url, server_pid: int):
    redirect = httpx.get(url + "/v1/models/", headers={**AUTH, "Host": "evil.example.com"}, trust_env=False,
                         follow_redirects=False)
    routes = httpx.get(url + "/-/routes", trust_env=False).status_code
    listening = listening_sockets(server_pid)
    public = [f"{address}:{port} ({name})" for address, port, _, name in listening if not is_loopback(address)]
    print("non-loopback sockets of the server's processes: " + ", ".join(public), flush=True)
    no_location = "location" not in redirect.headers
    return ("no Host-built redirect; no route without the key; only loopback sockets",
            f"/v1/models/: {redirect.status_code}, Location: {not no_location}; /-/routes without key: {routes}; "
            f"{len(public)} of {len(listening)} listening sockets non-loopback",
            no_location and routes == 401 and not public and len(listening) > 0)


CASES = [("big prompts", case_big_prompts), ("long prefill", case_long_prefill),
         ("surrogate bytes", case_surrogate_bytes), ("header limits", case_header_limits),
         ("seeded n > 1", case_seeded_n), ("partial-character logprobs", case_partial_logprobs),
         ("batch next to a short request", case_batch_next_to_short), ("echo of token ids", case_echo_token_ids),
         ("open surfaces", case_open_surfaces)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.red_team", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--out", default="benchmarks/results/red_team.json")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    command = [sys.executable, "-c", PAGEDRAY_CLI, "serve", "--host", "127.0.0.1", "--port", str(args.port),
               "--api-key", API_KEY]
    out_dir = pathlib.Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with RunningServer(SystemSpec("pagedray", command, None, 1), args.port, out_dir / "red_team_server.log") as server:
        server.wait_healthy(args.startup_timeout)
        from benchmarks.red_team_isolation import CASES as ISOLATION_CASES

        for name, fn in CASES + ISOLATION_CASES:
            start, load_before = time.monotonic(), round(os.getloadavg()[0], 2)
            with health_watch(server.url) as watch:
                try:
                    extra = (server.proc.pid,) if fn is case_open_surfaces else ()
                    expected, observed, ok = fn(server.url, *extra)
                except Exception as exc:  # noqa: BLE001 - a crashed case is a defect of its own
                    expected, observed, ok = "the case runs", f"{type(exc).__name__}: {exc}", False
            healthy, health = health_summary(watch)
            rows.append({"case": name, "expected": expected, "observed": observed,
                         "seconds": round(time.monotonic() - start, 1), "health_during": health,
                         "load_before": load_before,
                         "verdict": "ok" if ok and healthy else "DEFECT"})
            print(f"{name:32} {rows[-1]['verdict']:7} {rows[-1]['seconds']:6.1f} s  health {health}; "
                  f"{observed}", flush=True)
    defects = sum(r["verdict"] != "ok" for r in rows)
    print(f"\n{len(rows)} cases, {defects} defects")
    pathlib.Path(args.out).write_text(json.dumps({"benchmark": "red_team", "environment": machine(),
                                                  "cases": rows, "defects": defects}, indent=1))
    print(f"wrote {args.out}")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
