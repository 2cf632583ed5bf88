"""Chaos: two engine replicas under a steady streaming load while one replica's process is SIGKILLed again
and again; every stream's text is compared with the undisturbed one.

    python -m benchmarks.chaos [--minutes 10] [--kill-every-s 30] [--clients 4] [--max-tokens 120]

The app of ``benchmarks.failover`` (two engine replicas, the engine in a deployment of its own, fp32,
in-process model) on a local Ray. First the undisturbed text of each body (greedy and seeded, one at a time),
then ``--clients`` clients stream those bodies back to back for ``--minutes``; every ``--kill-every-s`` seconds,
when both engine replicas are up, one gets SIGKILL (the pid its ``process_id`` returns). Reported: streams
finished exactly, changed (another text), errored (an error event) and lost (no end of stream); per kill, the
time from the kill to the next token of each stream in flight then (p50, p99); the KV blocks each engine
replica still holds once the load is over (must be 0). Prints a table, writes JSON (default
benchmarks/results/chaos.json). No peer continues a stream after losing its replica: a design measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import threading
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
# the percentile helper is test-support code, kept beside the tests that use it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import httpx
from helpers.burst_load import percentile

from benchmarks.common import print_table, write_json
from benchmarks.failover import APP_ARGS, _bodies, _engine_replicas, two_replica_app

APP_NAME = "pagedray-chaos"
STREAM_TIMEOUT_S = 300.0


def read_stream(url: str, body: dict) -> dict:
    """One streamed completion: its text, each chunk's arrival time, an error event, whether it ended."""
    text, times, error, ended = [], [], None, False
    try:
        with httpx.Client(base_url=url, timeout=STREAM_TIMEOUT_S, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    return {"text": "", "times": [], "error": f"HTTP {response.status_code}", "ended": False}
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        ended = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        error = error or event.get("error")
                        if event.get("choices"):
                            text.append(event["choices"][0]["text"])
                            times.append(time.monotonic())
    except httpx.HTTPError as exc:
        error = error or f"{type(exc).__name__}: {exc}"
    return {"text": "".join(text), "times": times, "error": error, "ended": ended}


def engine_blocks_held() -> dict[str, int]:
    """Per engine replica: KV blocks held (num_blocks - free), asked until every replica has answered."""
    from ray import serve

    handle = serve.get_deployment_handle("PagedEngine", APP_NAME)
    held, deadline = {}, time.monotonic() + 120
    while len(held) < len(_engine_replicas()) and time.monotonic() < deadline:
        replica, stats = handle.replica_stats.remote().result()
        held[replica] = stats.num_blocks - stats.num_free_blocks
    return held


def run(url: str, bodies: list[dict], minutes: float, kill_every_s: float, clients: int) -> dict:
    with httpx.Client(base_url=url, timeout=STREAM_TIMEOUT_S, trust_env=False) as client:
        expected = [client.post("/v1/completions", json=body).json()["choices"][0]["text"] for body in bodies]
    from ray import serve

    stop, lock, streams, kills = threading.Event(), threading.Lock(), [], []
    counter = iter(range(10**9))

    def client_loop() -> None:
        while not stop.is_set():
            index = next(counter) % len(bodies)
            out = read_stream(url, bodies[index])
            with lock:
                streams.append({**out, "exact": out["text"] == expected[index]})

    def killer() -> None:
        handle = serve.get_deployment_handle("PagedEngine", APP_NAME)
        while not stop.wait(kill_every_s):
            if len(_engine_replicas()) < 2:
                continue                              # the last kill's replacement is not up yet
            pid = handle.process_id.remote().result()
            kills.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    threads.append(threading.Thread(target=killer, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(minutes * 60)
    stop.set()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S)
    deadline = time.monotonic() + 300                 # the last replacement, before the leak check
    while len(_engine_replicas()) < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
    pauses = [next(t for t in s["times"] if t > kill) - kill for kill in kills for s in streams
              if s["times"] and s["times"][0] < kill < s["times"][-1]]
    return {"streams": len(streams), "exact": sum(s["exact"] for s in streams),
            "changed": sum(not s["exact"] and s["ended"] and not s["error"] for s in streams),
            "errored": sum(bool(s["error"]) for s in streams),
            "lost": sum(not s["ended"] and not s["error"] for s in streams), "kills": len(kills),
            "pause_p50_s": percentile(pauses, 50), "pause_p99_s": percentile(pauses, 99),
            "kv_blocks_held_after": engine_blocks_held()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with two_replica_app(args.model, APP_NAME) as url:
        summary = run(url, _bodies(args.clients, args.max_tokens), args.minutes, args.kill_every_s, args.clients)
    print_table([summary], [k for k in summary if k != "kv_blocks_held_after"])
    print(json.dumps(summary))
    write_json("chaos", {"config": vars(args), "app": APP_ARGS, "summary": summary}, args.out)
    return summary


if __name__ == "__main__":
    main()
