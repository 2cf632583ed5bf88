"""Helpers to run the real Serve application (real engine, default model, fp32) inside the test session."""

from __future__ import annotations

import pathlib
import threading
import time
from dataclasses import dataclass

import httpx
from pagedray.deploy.cli.main import free_port
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.serve.engine_deployment import ENGINE_DEPLOYMENT_NAME
from pagedray.deploy.serve.ingress import INGRESS_DEPLOYMENT_NAME

API_KEY = "test-key"
APP_NAME = "pagedray-test"
# small and fast on a 2-core CPU: 128 blocks x 16 tokens, short contexts, a small queue bound
# the engine in a deployment of its own unless a test asks otherwise (test_serve_engine_in_ingress.py runs
# the same behaviours with the engine in the ingress, the default layout of a one-replica app)
APP_ARGS = {"num_blocks": 128, "max_model_len": 512, "max_num_seqs": 4, "max_queued_requests": 4,
            "dtype": "float32", "api_key": API_KEY, "max_body_bytes": 64 * 1024, "engine_in_ingress": False}


@dataclass
class RunningApp:
    url: str
    name: str
    model: str
    max_model_len: int
    vocab_size: int
    engine_deployment: str = ENGINE_DEPLOYMENT_NAME   # the ingress' name with engine_in_ingress

    def engine_handle(self):
        """A handle with the engine's ``stats`` and ``model_meta``."""
        from ray import serve

        return serve.get_deployment_handle(self.engine_deployment, self.name)

    def engine_stats(self):
        return self.engine_handle().stats.remote().result()

    def wait_idle(self, timeout_s: float = 30.0):
        """Engine stats once nothing runs or waits, no KV block is referenced and two snapshots 0.2 s
        apart agree (release-only steps done); the last snapshot seen when the timeout passes."""
        deadline = time.monotonic() + timeout_s
        previous = None
        while True:
            stats = self.engine_stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0
            if (idle and stats == previous) or time.monotonic() > deadline:
                return stats
            previous = stats if idle else None
            time.sleep(0.2)


def start_app(model_path: str, **overrides) -> RunningApp:
    """Deploy the app with ``APP_ARGS`` (``overrides`` replace single keys)."""
    from pagedray.deploy.serve.app import build_app
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": model_path, **APP_ARGS, **overrides}), name=APP_NAME, route_prefix="/")
    engine = INGRESS_DEPLOYMENT_NAME if overrides.get("engine_in_ingress") else ENGINE_DEPLOYMENT_NAME
    meta = serve.get_deployment_handle(engine, APP_NAME).model_meta.remote().result()
    return RunningApp(f"http://127.0.0.1:{port}", APP_NAME, pathlib.Path(model_path).name,
                      meta.max_model_len, meta.vocab_size, engine)


def stop_app(app: RunningApp) -> None:
    from ray import serve

    serve.delete(app.name)
    serve.shutdown()


def counter_total(client: httpx.Client, series: str) -> float:
    """The ingress's counter ``series`` (``pagedray:..._total``) from /metrics (``client``: its base URL set)."""
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(series))
    return float(line.rsplit(" ", 1)[1])


def failovers_total(client: httpx.Client) -> float:
    """The ingress's ``pagedray:request_failovers_total``."""
    return counter_total(client, "pagedray:request_failovers_total")


def stream_in_thread(url: str, body: dict, started: threading.Event, out: dict,
                     path: str = "/v1/completions") -> threading.Thread:
    """POST ``body`` with ``stream: true`` to ``path`` in a thread; ``started`` is set at the first event;
    ``out`` gets ``status`` and the parsed ``events``."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def run() -> None:
        with httpx.Client(base_url=url, headers=auth, timeout=300, trust_env=False) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                out["status"] = response.status_code
                lines = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
        out["events"] = parse_sse("\n\n".join(lines))
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stream_text(events: list) -> tuple[str, str | None, int]:
    """(text, last finish_reason, number of content chunks) of a completion SSE stream."""
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    return "".join(c["choices"][0]["text"] for c in chunks), (reasons or [None])[-1], len(chunks)


def tp_worker_pids() -> list[int]:
    """This session's TP worker processes: descendants of the test process whose command line names
    the RayWorker actor class."""
    import os

    import psutil

    pids = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "RayWorker" in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            pass
    return pids
