"""Serving benchmark: pagedray (TP=1, TP=2) against ``transformers serve --continuous-batching``.

    python -m pagedray.deploy.bench_serving [--systems peer,pagedray-tp1,pagedray-tp2] [--model default]

Each system is started as a subprocess on 127.0.0.1 (its log goes to ``<out-dir>/<system>.log``), waited
for on ``/health``, warmed up with two requests (model load and first-call costs are not measured), then
given the same load: a closed loop (``--num-requests`` requests, ``--concurrency``) and an open-loop rate
sweep, with the same seeded prompts and greedy decoding. It is stopped before the next system starts.
Prints a comparison table (ratios against the peer) and writes JSON to ``<out-dir>/serving_<date>.json``.

Decisions:
- The peer gets a KV cache sized for this workload (``--peer-num-blocks`` pages of 256 tokens, default
  32 = 8192 tokens) and ``--peer-max-batch-tokens 1024``: with its defaults on CPU it sizes the cache
  from free RAM and pads every attention read to 16k tokens, which made it ~6x slower here -- a
  comparison against that would flatter us.
- Requests carry no non-standard fields (``transformers serve`` rejects unknown ones), so generation
  stops at EOS or ``max_tokens`` on both sides; output tokens are counted from each server's usage.
- ``/v1/models`` tells the model name for pagedray; the peer is pinned to the model path it was started
  with. A system that fails to start is reported as such and left out of the ratios.
- Each pagedray server starts its OWN local Ray: ``pagedray serve`` calls ``ray.init(address="auto")``,
  which would join any Ray instance already running on the machine (another user's test cluster), so
  the server runs with ``RAY_ADDRESS=local`` (Ray then starts a fresh local instance) and ``RAY_TMPDIR`` in
  a private temporary folder (its session files and sockets stay apart); the instance ends with the
  server process.
- ``--ray-num-cpus N`` sets the private Ray's logical CPU count (``RAY_OVERRIDE_RESOURCES``): a replica
  asks for one CPU per TP rank plus one for the engine, so TP=2 on a 2-core machine is never scheduled
  with Ray's default (the cores). Logical CPUs only gate scheduling; torch threads are set by the workers.
- A pagedray TP size that the model's heads cannot be split over (SmolLM2-135M: 9 query / 3 KV heads,
  TP=2) is recorded as ``skipped`` with the workers' own error message instead of being started.
- The workers keep the default torch threads (``cpu_count // tp``; ``--threads-per-worker`` is not passed).
- ``--check``: pagedray's closed-loop run is checked against a sequential greedy reference run of the
  same prompts (tokens lost, duplicated or corrupted under load count as failures); the peer is not
  checked.
- Model load is outside the timing; the machine is shared, so the numbers are only comparable within one
  run of this script (see the JSON's ``machine`` and ``date``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
from pagedray.deploy.loadtest import LoadtestConfig, run_loadtest
from pagedray.deploy.loadtest_client import RequestOptions
from pagedray.deploy.loadtest_prompts import parse_length_range, synthetic_prompts
from pagedray.deploy.loadtest_runner import LoadSpec
from pagedray.deploy.loadtest_stats import format_table

PEER = "peer"
PAGEDRAY_CLI = "import sys; from pagedray.deploy.cli import main; sys.exit(main(sys.argv[1:]))"
TABLE_ROWS = (("completed", ("completed",)), ("failed", ("failed",)), ("output tok/s", ("output_tok_per_s",)),
              ("req/s", ("req_per_s",)), ("TTFT p50 ms", ("ttft_ms", "p50")), ("TTFT p99 ms", ("ttft_ms", "p99")),
              ("TPOT p50 ms", ("tpot_ms", "p50")), ("ITL p99 ms", ("itl_ms", "p99")),
              ("E2E p50 ms", ("e2e_ms", "p50")), ("E2E p99 ms", ("e2e_ms", "p99")))


@dataclass(frozen=True)
class SystemSpec:
    name: str
    command: list[str]
    model_name: str | None   # None: ask the server's /v1/models
    tensor_parallel_size: int | None = None   # pagedray systems only


def skip_reason(spec: SystemSpec, model_path: str) -> str | None:
    """Why a pagedray TP size cannot run this model (the workers' own check), or None."""
    if spec.tensor_parallel_size is None:
        return None
    from pagedray.workers.model_info import model_info

    info = model_info(model_path)  # an unsupported model is an error, not a skip
    try:
        info.check_tensor_parallel_size(spec.tensor_parallel_size)
    except ValueError as err:
        return f"{err} (heads cannot be split over the ranks; vLLM rejects this split too)"
    return None


def system_specs(names: list[str], model_path: str, port: int, args: argparse.Namespace) -> list[SystemSpec]:
    specs = []
    for name in names:
        if name == PEER:
            command = ["transformers", "serve", model_path, "--continuous-batching", "--device", "cpu",
                       "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                       "--cb-num-blocks", str(args.peer_num_blocks),
                       "--cb-max-batch-tokens", str(args.peer_max_batch_tokens)]
            specs.append(SystemSpec(name, command, model_path))
        elif name.startswith("pagedray-tp") and name[len("pagedray-tp"):].isdigit():
            tp = int(name[len("pagedray-tp"):])
            command = [sys.executable, "-c", PAGEDRAY_CLI, "serve", "--model", model_path,
                       "--tensor-parallel-size", str(tp), "--dtype", "float32",
                       "--device", args.device, "--host", "127.0.0.1", "--port", str(port)]
            specs.append(SystemSpec(name, command, None, tp))
        else:
            raise ValueError(f"systems: unknown system {name!r} (peer or pagedray-tpN)")
    return specs


class RunningServer:
    """A server subprocess in its own session; stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, spec: SystemSpec, port: int, log_path: pathlib.Path, ray_num_cpus: int | None = None) -> None:
        self.spec, self.url, self.log_path = spec, f"http://127.0.0.1:{port}", log_path
        self.ray_num_cpus = ray_num_cpus
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RunningServer:
        log = open(self.log_path, "w")  # closed in __exit__
        self._ray_tmp = tempfile.TemporaryDirectory(prefix="prbench-ray-")  # removed in __exit__
        env = dict(os.environ)
        if self.spec.tensor_parallel_size is not None:  # pagedray: a private local Ray, never "auto"
            env.update(RAY_ADDRESS="local", RAY_TMPDIR=self._ray_tmp.name)
            if self.ray_num_cpus is not None:
                env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": self.ray_num_cpus})
        self.proc = subprocess.Popen(self.spec.command, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        self._log = log
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.spec.name} not healthy after {timeout_s} s; see {self.log_path}")

    def model_name(self) -> str:
        if self.spec.model_name is not None:
            return self.spec.model_name
        models = httpx.get(self.url + "/v1/models", timeout=30, trust_env=False).json()
        return models["data"][0]["id"]

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()
        self._ray_tmp.cleanup()


def measure(server: RunningServer, args: argparse.Namespace) -> dict:
    """Warm-up, then the closed-loop load and the sweep; summaries as JSON-ready dicts."""
    model = server.model_name()
    options = RequestOptions(model=model, temperature=0.0, timeout_s=args.timeout)
    prompts = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                                parse_length_range(args.output_len, "output_len"), args.seed)

    check = args.check and server.spec.tensor_parallel_size is not None

    def run(loads: list[LoadSpec], checked: bool = False):
        config = LoadtestConfig(options=options, prompts=prompts, loads=loads, url=server.url,
                                metrics_url="", progress=not args.no_progress, check=checked)
        return asyncio.run(run_loadtest(config))

    run([LoadSpec(num_requests=2, concurrency=2)])  # warm-up, not recorded
    closed = run([LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, seed=args.seed)], check)
    rates = [float(r) for r in args.sweep.split(",") if r.strip()] if args.sweep else []
    sweep = run([LoadSpec(num_requests=args.sweep_requests, rate=r, seed=args.seed) for r in rates]) if rates else None
    out = {"model": model, "load": closed.summaries[0], "sweep": sweep.summaries if sweep else []}
    if check:
        out["check"] = closed.checks[0]
    return out


def _get(summary: dict, path: tuple[str, ...]):
    value = summary
    for key in path:
        value = value[key]
    return value


def ratios(results: dict) -> dict:
    """Per non-peer system: output tok/s and TTFT p99 divided by the peer's."""
    peer = results.get(PEER, {}).get("load")
    out = {}
    for name, result in results.items():
        if name == PEER or peer is None or "load" not in result:
            continue
        load = result["load"]
        ttft, peer_ttft = load["ttft_ms"]["p99"], peer["ttft_ms"]["p99"]
        tok, peer_tok = load["output_tok_per_s"], peer["output_tok_per_s"]
        out[name] = {"output_tok_per_s_x": tok / peer_tok if peer_tok else None,
                     "ttft_p99_x": ttft / peer_ttft if ttft is not None and peer_ttft else None}
    return out


def comparison_table(results: dict, ratio: dict) -> str:
    names = [n for n in results if "load" in results[n]]
    header = ["metric", *names, *(f"{n} / peer" for n in ratio)]
    rows = [header]
    for label, path in TABLE_ROWS:
        values = [_get(results[n]["load"], path) for n in names]
        row = [label, *("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v) for v in values)]
        for name in ratio:
            mine, base = _get(results[name]["load"], path), _get(results[PEER]["load"], path)
            row.append(f"{mine / base:.2f}x" if isinstance(mine, float) and base else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(r, widths))) for r in rows)


def machine_info() -> dict:
    import torch
    import transformers

    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "load_average_at_start": os.getloadavg()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="peer,pagedray-tp1,pagedray-tp2")
    p.add_argument("--model", default="default", help="'default' or a Hugging Face model folder")
    p.add_argument("--device", default="cpu", help="device for pagedray (the peer runs on CPU)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", default="8:120", help="prompt words, MIN:MAX")
    p.add_argument("--output-len", default="64", help="max_tokens, N or MIN:MAX")
    p.add_argument("--sweep", default="0.1,0.2,0.4", help="open-loop rates (req/s); empty to skip")
    p.add_argument("--sweep-requests", type=int, default=12, help="requests per swept rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--peer-num-blocks", type=int, default=32)
    p.add_argument("--peer-max-batch-tokens", type=int, default=1024)
    p.add_argument("--out-dir", default="bench_results")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ray-num-cpus", type=int, default=None,
                   help="logical CPUs of pagedray's private Ray (TP=2 on 2 cores needs >= 3)")
    p.add_argument("--check", action="store_true",
                   help="check pagedray's closed-loop greedy outputs against a sequential reference run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedray.workers.default_model import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = system_specs([s.strip() for s in args.systems.split(",") if s.strip()], model_path, args.port, args)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "workload": vars(args), "systems": {}}
    for spec in specs:
        print(f"== {spec.name}: {' '.join(spec.command)}", flush=True)
        entry: dict = {"command": spec.command}
        reason = skip_reason(spec, model_path)
        if reason is not None:
            entry["skipped"] = reason
            print(f"   {spec.name} skipped: {reason}", flush=True)
            report["systems"][spec.name] = entry
            continue
        try:
            with RunningServer(spec, args.port, out_dir / f"{spec.name}.log", args.ray_num_cpus) as server:
                server.wait_healthy(args.startup_timeout)
                entry.update(measure(server, args))
        except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            print(f"   {spec.name} failed: {entry['error']}", flush=True)
        report["systems"][spec.name] = entry
    report["ratios"] = ratios(report["systems"])
    for name, entry in report["systems"].items():
        if entry.get("sweep"):
            print(f"-- {name}: rate sweep\n{format_table(entry['sweep'])}")
    print(f"-- closed loop, concurrency {args.concurrency}, {args.num_requests} requests")
    print(comparison_table(report["systems"], report["ratios"]))
    for name, entry in report["systems"].items():
        if "skipped" in entry:
            print(f"-- {name} skipped: {entry['skipped']}")
        if entry.get("check"):
            check = entry["check"]
            print(f"-- {name} --check: {check['checked']} checked, {check['mismatched']} mismatched, "
                  f"{check['unchecked']} unchecked")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"serving_{stamp}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"json: {path}")
    ok = all("load" in e or "skipped" in e for e in report["systems"].values())
    mismatched = any(e.get("check") and e["check"]["mismatched"] for e in report["systems"].values())
    return 0 if ok and not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
