"""Reliability figures of the Serve app: 5xx under fuzz, overload rejection latency, drain, leaked blocks.

    python -m benchmarks.reliability [--model default] [--examples 1000] [--overload-factor 10]

Starts a local Ray instance and the real app (small KV cache, fp32, capacity = max_num_seqs running +
max_queued_requests waiting), then measures:
- fuzz: ``--examples`` hypothesis-generated requests (tests/helpers/fuzz_requests.py): 2xx / 4xx / 5xx
  counts, and the KV blocks still referenced once the engine is idle (leaked blocks);
- overload: ``factor x capacity`` concurrent greedy requests: admitted / rejected counts, rejection
  latency p50 / p99, admitted latency p50, admitted texts that differ from the same prompt run alone,
  the most requests ever waiting (vs the bound), the engine replica's RSS before / after. Ratios are
  against the peer run in this script (the solo request latency);
- drain: one short and one long stream in flight, then ``drain(timeout)``: whether the short one
  finished exactly, whether the long one was aborted at the timeout, the status new requests got.
Prints a table and writes JSON (default benchmarks/results/reliability.json). Needs ``hypothesis``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import platform
import socket
import sys
import threading
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
# the fuzz strategies and the burst client are test-support code, kept beside the tests that use them
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import httpx
from helpers.burst_load import StatsSampler, burst, percentile, rss_bytes

APP_NAME = "pagedray-reliability"
APP_ARGS = {"num_blocks": 128, "max_model_len": 512, "max_num_seqs": 4, "max_queued_requests": 4,
            "dtype": "float32", "engine_in_ingress": False}   # the engine deployment is what it kills and reads
BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def start(model: str, ray_address: str) -> tuple[str, object]:
    import ray
    from pagedray.deploy.serve.app import build_app
    from pagedray.deploy.serve.engine_deployment import ENGINE_DEPLOYMENT_NAME
    from ray import serve

    ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": model, **APP_ARGS}), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}", serve.get_deployment_handle(ENGINE_DEPLOYMENT_NAME, APP_NAME)


def wait_idle(engine, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats.remote().result()
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            time.sleep(0.3)   # let release-only steps land
            return engine.stats.remote().result()
        time.sleep(0.1)


def fuzz(url: str, engine, examples: int, concurrency: int) -> dict:
    from helpers.fuzz_requests import run_fuzz

    meta = engine.model_meta.remote().result()
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        start_s = time.monotonic()
        report = run_fuzz(client, None, meta.vocab_size, examples, concurrency)
        wall = time.monotonic() - start_s
    idle = wait_idle(engine)
    return {"examples": sum(report.tally.values()), "concurrency": concurrency, "ok_2xx": report.tally["ok"],
            "client_4xx": report.tally["client_error"], "server_5xx": report.tally["server_error"],
            "statuses": {str(k): v for k, v in sorted(report.statuses.items())}, "seconds": wall,
            "leaked_blocks": idle.num_blocks - idle.num_free_blocks,
            "failures": [(r.path, r.body.decode(errors="replace"), status, text)
                         for r, status, text in report.failures[:20]]}


def run_overload(url: str, engine, factor: int) -> dict:
    capacity = APP_ARGS["max_num_seqs"] + APP_ARGS["max_queued_requests"]
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        start_s = time.monotonic()
        reference = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
        solo_s = time.monotonic() - start_s
    pid = engine.process_id.remote().result()
    asyncio.run(burst(url, {}, BODY, capacity))   # warm-up at capacity
    wait_idle(engine)
    rss_before = rss_bytes(pid)
    with StatsSampler(lambda: engine.stats.remote().result()) as sampler:
        result = asyncio.run(burst(url, {}, BODY, factor * capacity))
    rss_after = rss_bytes(pid)
    admitted, rejected = result.with_status(200), result.with_status(429, 503)
    reject_lat = [r.latency_s for r in rejected]
    idle = wait_idle(engine)
    return {
        "requests": factor * capacity, "capacity": capacity, "admitted": len(admitted), "rejected": len(rejected),
        "other_status": len(result.replies) - len(admitted) - len(rejected),
        "admitted_text_mismatches": sum(r.text != reference for r in admitted),
        "reject_p50_s": percentile(reject_lat, 50), "reject_p99_s": percentile(reject_lat, 99),
        "admitted_p50_s": percentile([r.latency_s for r in admitted], 50), "solo_request_s": solo_s,
        "reject_p50_over_solo": percentile(reject_lat, 50) / solo_s,
        "max_waiting_seen": sampler.max_of("num_waiting"), "waiting_bound": APP_ARGS["max_queued_requests"],
        "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_after / 2**20,
        "leaked_blocks": idle.num_blocks - idle.num_free_blocks,
    }


def _stream(url: str, body: dict, out: dict, started: threading.Event) -> threading.Thread:
    from pagedray.deploy.openai.sse import parse_sse

    def go() -> None:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
        chunks = [e for e in parse_sse("\n\n".join(lines)) if isinstance(e, dict) and e.get("choices")]
        out["text"] = "".join(c["choices"][0]["text"] for c in chunks)
        out["finish"] = next((c["choices"][0]["finish_reason"] for c in reversed(chunks)
                              if c["choices"][0]["finish_reason"]), None)
        started.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def run_drain(url: str, timeout_s: float) -> dict:
    from ray import serve

    short = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    long = {"prompt": "Count:", "max_tokens": APP_ARGS["max_model_len"] - 16, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        reference = client.post("/v1/completions", json=short).json()["choices"][0]["text"]
        outs, events = ({}, {}), (threading.Event(), threading.Event())
        threads = [_stream(url, long, outs[1], events[1])]
        events[1].wait(120)
        threads.append(_stream(url, short, outs[0], events[0]))
        events[0].wait(120)
        report = serve.get_app_handle(APP_NAME).drain.remote(timeout_s)
        statuses = collections.Counter()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            statuses[client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code] += 1
            time.sleep(0.1)
        report = report.result()
    for thread in threads:
        thread.join(120)
    return {"timeout_s": timeout_s, "drain_s": report.seconds, "in_flight": report.in_flight_at_start,
            "aborted": report.aborted, "short_exact": outs[0].get("text") == reference,
            "short_finish": outs[0].get("finish"), "long_finish": outs[1].get("finish"),
            "new_request_statuses": dict(statuses)}


def print_table(results: dict) -> None:
    rows = [("fuzz examples", results["fuzz"]["examples"]), ("fuzz 5xx", results["fuzz"]["server_5xx"]),
            ("fuzz 2xx / 4xx", f'{results["fuzz"]["ok_2xx"]} / {results["fuzz"]["client_4xx"]}'),
            ("leaked blocks after fuzz", results["fuzz"]["leaked_blocks"])]
    ov = results["overload"]
    rows += [("overload requests (x capacity)", f'{ov["requests"]} ({ov["requests"] // ov["capacity"]}x)'),
             ("admitted / rejected / other", f'{ov["admitted"]} / {ov["rejected"]} / {ov["other_status"]}'),
             ("admitted text mismatches", ov["admitted_text_mismatches"]),
             ("rejection latency p50 / p99", f'{ov["reject_p50_s"] * 1e3:.1f} / {ov["reject_p99_s"] * 1e3:.1f} ms'),
             ("admitted latency p50", f'{ov["admitted_p50_s"] * 1e3:.1f} ms'),
             ("rejection p50 / solo request", f'{ov["reject_p50_over_solo"]:.2f}'),
             ("max waiting seen / bound", f'{ov["max_waiting_seen"]} / {ov["waiting_bound"]}'),
             ("replica RSS before / after", f'{ov["rss_before_mib"]:.0f} / {ov["rss_after_mib"]:.0f} MiB'),
             ("leaked blocks after overload", ov["leaked_blocks"])]
    dr = results["drain"]
    rows += [("drain: short finished exactly", f'{dr["short_exact"]} ({dr["short_finish"]})'),
             ("drain: long stream", f'{dr["long_finish"]} at {dr["drain_s"]:.1f} s (timeout {dr["timeout_s"]} s)'),
             ("drain: new requests got", dr["new_request_statuses"])]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--fuzz-concurrency", type=int, default=4)
    parser.add_argument("--overload-factor", type=int, default=10)
    parser.add_argument("--drain-timeout", type=float, default=5.0)
    parser.add_argument("--out", default="benchmarks/results/reliability.json")
    parser.add_argument("--ray-address", default="local",
                        help="'local' (default): a fresh private Ray instance, even if one runs on this machine")
    args = parser.parse_args(argv)
    url, engine = start(args.model, args.ray_address)
    results = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                           "cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0]},
               "app_args": APP_ARGS, "date": time.strftime("%Y-%m-%d")}
    results["fuzz"] = fuzz(url, engine, args.examples, args.fuzz_concurrency)
    results["overload"] = run_overload(url, engine, args.overload_factor)
    results["drain"] = run_drain(url, args.drain_timeout)
    print_table(results)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
