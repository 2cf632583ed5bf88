"""Stream failover across engine replicas: how long a stream pauses when its replica is killed, and
whether its text changes (deploy/serve/failover.py).

    python -m benchmarks.failover [--model default] [--rounds 3] [--streams 4] [--max-tokens 120]

Starts a local Ray instance and the Serve app with two engine replicas (in-process model, fp32, the
engine in a deployment of its own). Each round: the undisturbed text of ``--streams`` requests (greedy
and seeded, one after the other), then the same requests as concurrent streams; once every stream has
sent its first token, one engine replica's process gets SIGKILL (the pid a ``process_id`` call returns);
every stream is read to its end; then the app is given time to replace the replica (hang guard only).
Per stream: whether its text equals the undisturbed one, and the time from the kill to its next token.
The streams the kill moved are those ``pagedray:request_failovers_total`` counts; their pause is the
``failovers`` largest of a round's pauses (the others only wait one decode step). No peer continues a
stream after losing its replica, so there is no ratio: a design measurement.
Prints a table and writes JSON (default benchmarks/results/failover.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import statistics
import sys
import threading
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

# the /metrics reader is test-support code, kept beside the tests that use it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import httpx
from helpers.serve_fixtures import failovers_total

from benchmarks.common import print_table, write_json

APP_NAME = "pagedray-failover"
APP_ARGS = {"num_blocks": 256, "max_model_len": 512, "max_num_seqs": 8, "dtype": "float32", "num_replicas": 2,
            "executor": "local", "engine_in_ingress": False}
PROMPTS = ["Count from one to fifty in words:", "Once upon a time", "List every animal you know:",
           "Describe the sea in detail:"]
HANG_GUARD_S = 300.0


def _bodies(streams: int, max_tokens: int) -> list[dict]:
    bodies = []
    for i in range(streams):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}
        bodies.append({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True, **sampling})
    return bodies


def _stream(url: str, body: dict, out: dict, started: threading.Event) -> threading.Thread:
    """Reads one completion stream: its text and the arrival time of each chunk (``out``)."""
    def go() -> None:
        text, times = [], []
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event.get("choices"):
                            text.append(event["choices"][0]["text"])
                            times.append(time.monotonic())
                            started.set()
                        out["error"] = out.get("error") or event.get("error")
        out["text"], out["times"] = "".join(text), times
        started.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _engine_replicas() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and "PagedEngine" in a["name"])


def run_round(url: str, bodies: list[dict]) -> dict:
    with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
        expected = [client.post("/v1/completions", json=body).json()["choices"][0]["text"] for body in bodies]
        before = failovers_total(client)
        outs = [{} for _ in bodies]
        started = [threading.Event() for _ in bodies]
        threads = [_stream(url, body, out, event) for body, out, event in zip(bodies, outs, started)]
        for event in started:
            event.wait(HANG_GUARD_S)
        from ray import serve

        pid = serve.get_deployment_handle("PagedEngine", APP_NAME).process_id.remote().result()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for thread in threads:
            thread.join(HANG_GUARD_S)
        moved = int(failovers_total(client) - before)
        pauses = sorted((next((t for t in out["times"] if t > killed_at), float("nan")) - killed_at
                         for out in outs), reverse=True)
        deadline = time.monotonic() + HANG_GUARD_S      # Serve replaces the replica before the next round
        while len(_engine_replicas()) < 2 and time.monotonic() < deadline:
            time.sleep(1.0)
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(1.0)
    return {"streams": len(bodies), "exact": sum(out.get("text") == text for out, text in zip(outs, expected)),
            "errors": sum(bool(out.get("error")) for out in outs), "failovers": moved,
            "moved_pause_s": pauses[:moved], "other_pause_s": pauses[moved:]}


@contextlib.contextmanager
def two_replica_app(model: str, app_name: str):
    """A local Ray with the Serve app of ``APP_ARGS`` (two engine replicas) named ``app_name`` on a free port;
    yields its URL; Serve and Ray are shut down afterwards (also used by ``benchmarks.chaos``)."""
    import ray
    from pagedray.deploy.serve.app import build_app
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, num_cpus=8)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": model, **APP_ARGS}), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with two_replica_app(args.model, APP_NAME) as url:
        rounds = [run_round(url, _bodies(args.streams, args.max_tokens)) for _ in range(args.rounds)]
    moved = [p for r in rounds for p in r["moved_pause_s"]]
    others = [p for r in rounds for p in r["other_pause_s"]]
    rows = [{"round": i, **{k: v for k, v in r.items() if not k.endswith("_s")},
             "moved pause s": ", ".join(f"{p:.2f}" for p in r["moved_pause_s"])} for i, r in enumerate(rounds)]
    print_table(rows, ["round", "streams", "exact", "errors", "failovers", "moved pause s"])
    summary = {"streams": sum(r["streams"] for r in rounds), "exact": sum(r["exact"] for r in rounds),
               "errors": sum(r["errors"] for r in rounds), "failovers": len(moved),
               "moved_pause_p50_s": statistics.median(moved) if moved else None,
               "moved_pause_max_s": max(moved) if moved else None,
               "other_pause_p50_s": statistics.median(others) if others else None}
    print(json.dumps(summary))
    write_json("failover", {"config": vars(args), "app": APP_ARGS, "rounds": rounds, "summary": summary}, args.out)
    return summary


if __name__ == "__main__":
    main()
