"""Soak: many thousands of mixed requests against one ``pagedray serve``, and whether the server loses or
leaks anything over the run.

    python -m benchmarks.soak [--requests 20000] [--concurrency 16] [--sample-s 5] [--out ...]

Starts ``pagedray serve`` (the default model, ``--reasoning-parser think``) on a free port, then sends
``--requests`` requests, ``--concurrency`` at a time, of mixed kinds drawn from a seeded generator
(``KINDS``): completions and chat, whole and streamed; n = 2 seeded samples; logprobs; grammars of distinct
texts (a JSON schema whose enum is new for every request); tools; Responses and Messages; prompts sharing a
long prefix; and streams the client drops after their first chunk (aborts). ``--lora`` serves three random
adapters (``--enable-lora``, two slots, so slots change hands all the time) and adds their kinds (``LORA_KINDS``):
requests to an adapter, whole, streamed and dropped, and ``lora_swap``: ``POST /v1/load_lora_adapter`` of a
new name, a request to it, ``POST /v1/unload_lora_adapter`` (the three calls count as one request, ok only
if all three are). ``--serve-args`` passes more flags to ``pagedray serve`` (a small ``--num-blocks`` for
preemptions and evictions, ``--kv-offload-gib`` for the second KV tier). Every ``--sample-s`` seconds it
samples, for each process of the server (the CLI, the ingress / engine replicas, the TP ranks), its RSS,
open file descriptors and threads, and the KV blocks in use (``/metrics``: the free blocks at idle minus the
free blocks now).

Reported: per kind, requests answered / aborted on purpose / lost (an error status, a transport error or a
stream without its end marker); per process, RSS, descriptors and threads at 10% of the run and at its end
(growth in %); KV blocks in use once the run is over and the server idle (must be 0); requests lost (must be
0). A table, JSON (default benchmarks/results/soak.json) and a plot of RSS over the run (``soak.png`` beside
the JSON). No peer: a design measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from benchmarks.common import print_table, write_json

PAGEDRAY_CLI = "import sys; from pagedray.deploy.cli.main import main; sys.exit(main(sys.argv[1:]))"
KINDS = ("completion", "completion_stream", "chat", "chat_stream", "n2", "logprobs", "grammar", "tools",
         "responses", "responses_stream", "messages", "messages_stream", "prefix", "abort")
LORA_KINDS = ("lora", "lora_stream", "lora_abort", "lora_swap")
ADAPTERS = 3          # served from the start (``--lora``); a fourth folder is the one ``lora_swap`` loads by new names
END_MARKERS = {"/v1/completions": ("[DONE]",), "/v1/chat/completions": ("[DONE]",),
               "/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}
WORDS = ("river stone lamp cloud orange violin garden copper winter candle harbor meadow silver thunder "
         "pepper marble falcon velvet canyon lantern").split()
SHARED_PREFIX = " ".join(WORDS * 6) + ". "
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
FREE_BLOCKS = re.compile(r"^pagedray:num_free_kv_blocks\{[^}]*\} ([0-9.e+]+)$", re.M)
COUNTERS = ("num_preemptions", "prefix_cache_hits")   # summed over replicas at the end: what the run exercised


def request_of(rng: random.Random, kind: str, model: str) -> tuple[str, dict, int | None]:
    """(route, body, chunks to read before dropping the stream, None: read to the end) of one request.
    ``lora_swap``'s route is the folder its new adapter name loads (``send_swap`` makes the three calls)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    tokens = rng.randint(4, 24)
    user = [{"role": "user", "content": text}]
    if kind in LORA_KINDS:
        if kind == "lora_swap":
            return "swap", {"model": f"swap{rng.randrange(1 << 40)}", "prompt": text, "max_tokens": tokens,
                            "temperature": 0}, None
        streamed = kind != "lora"
        body = {"model": f"a{rng.randrange(ADAPTERS)}", "prompt": text, "max_tokens": tokens, "temperature": 0,
                "stream": streamed}
        return "/v1/completions", body, 1 if kind == "lora_abort" else None
    if kind in ("completion", "completion_stream", "prefix", "abort"):
        prompt = SHARED_PREFIX + text if kind == "prefix" else text
        streamed = kind in ("completion_stream", "abort")
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": streamed}
        return "/v1/completions", body, 1 if kind == "abort" else None
    if kind == "n2":
        return "/v1/completions", {"prompt": text, "max_tokens": tokens, "n": 2, "temperature": 0.8,
                                   "seed": rng.randrange(1 << 30)}, None
    if kind == "logprobs":
        body = {"messages": user, "max_tokens": tokens, "logprobs": True, "top_logprobs": 2}
        return "/v1/chat/completions", body, None
    if kind == "grammar":
        choices = rng.sample(WORDS, 3) + [f"w{rng.randrange(10**9)}"]     # a new grammar text every time
        schema = {"type": "object", "properties": {"pick": {"enum": choices}}, "required": ["pick"]}
        return "/v1/chat/completions", {"messages": user, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}, None
    if kind == "tools":
        return "/v1/chat/completions", {"messages": user, "max_tokens": tokens, "tools": [WEATHER],
                                        "tool_choice": rng.choice(["auto", "required"])}, None
    if kind.startswith("responses"):
        return "/v1/responses", {"input": text, "max_output_tokens": tokens, "stream": kind.endswith("stream")}, None
    if kind.startswith("messages"):
        return "/v1/messages", {"model": model, "messages": user, "max_tokens": tokens,
                                "stream": kind.endswith("stream")}, None
    return "/v1/chat/completions", {"messages": user, "max_tokens": tokens, "stream": kind == "chat_stream"}, None


async def send_swap(client: httpx.AsyncClient, folder: str, body: dict) -> str:
    """Load ``body``'s model name as a new adapter from ``folder``, complete with it, unload it: 'ok' or 'lost'."""
    name = body["model"]
    try:
        loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder})
        if loaded.status_code != 200:
            return "lost"
        answer = await client.post("/v1/completions", json=body)
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        return "ok" if answer.status_code == 200 and answer.json() and unloaded.status_code == 200 else "lost"
    except (httpx.HTTPError, ValueError):
        return "lost"


async def send(client: httpx.AsyncClient, route: str, body: dict, drop_after: int | None) -> str:
    """'ok', 'aborted' (dropped on purpose) or 'lost' (an error status, a transport error, a stream cut short)."""
    try:
        if not body.get("stream"):
            response = await client.post(route, json=body)
            return "ok" if response.status_code == 200 and response.json() else "lost"
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                return "lost"
            chunks, ended = 0, False
            async for line in response.aiter_lines():
                if line.startswith("data:") or line.startswith("event:"):
                    chunks += 1
                    ended = ended or any(marker in line for marker in END_MARKERS[route])
                    if drop_after is not None and chunks >= drop_after:
                        return "aborted"
            return "ok" if ended else "lost"
    except (httpx.HTTPError, ValueError):
        return "lost"


def server_processes(root_pid: int) -> dict[str, object]:
    """role -> psutil.Process of the server's tree: the CLI, each Serve replica and each TP rank."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    roles = {}
    for proc in tree:
        try:
            name = " ".join(proc.cmdline())[:120]
        except psutil.Error:
            continue
        if proc.pid == root_pid:
            roles["cli"] = proc
        elif "ServeReplica" in name or "RayWorker" in name:
            roles[name.split()[0].removeprefix("ray::") + f" ({proc.pid})"] = proc
    return roles


class Sampler(threading.Thread):
    """Every ``period_s``: per server process RSS / fds / threads, and the KV blocks in use."""

    def __init__(self, url: str, root_pid: int, total_blocks: int, progress, period_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.root_pid, self.total_blocks, self.progress, self.period_s = url, root_pid, total_blocks, \
            progress, period_s
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def sample(self) -> dict:
        import psutil

        procs = {}
        for role, proc in server_processes(self.root_pid).items():
            try:
                procs[role] = {"rss": proc.memory_info().rss, "fds": proc.num_fds(), "threads": proc.num_threads()}
            except psutil.Error:
                pass
        return {"t": time.monotonic(), "done": self.progress(), "procs": procs,
                "blocks_in_use": self.total_blocks - free_blocks(self.url)}

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.samples.append(self.sample())


def free_blocks(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return int(sum(float(v) for v in FREE_BLOCKS.findall(text)))


def engine_counters(url: str) -> dict[str, int]:
    """``COUNTERS`` from /metrics (``pagedray:<name>_total``), summed over the replicas' series."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return {name: int(sum(float(v) for v in re.findall(rf"^pagedray:{name}_total(?:\{{[^}}]*\}})? ([0-9.e+]+)$",
                                                         text, re.M)))
            for name in COUNTERS}


async def run_load(url: str, count: int, concurrency: int, seed: int, done: list[int], kinds: tuple[str, ...],
                   swap_folder: str | None = None) -> Counter:
    rng = random.Random(seed)
    model = httpx.get(f"{url}/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    plan = [(kind, *request_of(rng, kind, model)) for kind in (rng.choice(kinds) for _ in range(count))]
    outcomes: Counter = Counter()
    queue = iter(plan)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            for kind, route, body, drop_after in queue:
                outcome = await (send_swap(client, swap_folder, body) if route == "swap"
                                 else send(client, route, body, drop_after))
                outcomes[(kind, outcome)] += 1
                done[0] += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def start_server(port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-c", PAGEDRAY_CLI, "serve", "--port", str(port), "--reasoning-parser", "think",
               *extra]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def lora_flags(folder: Path) -> tuple[list[str], str]:
    """Random adapters of the default model under ``folder`` (benchmarks.lora's): the serve flags that serve
    ``ADAPTERS`` of them as a0, a1, ... in two slots, and the folder ``lora_swap`` loads under new names."""
    from pagedray.workers.weights.default_model import resolve_model_path

    from benchmarks.lora import save_random_adapter

    model = str(resolve_model_path("default"))
    targets = [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"],
               ["q_proj", "v_proj", "down_proj"], ["o_proj", "up_proj"]]
    folders = [save_random_adapter(folder / f"a{i}", model, targets[i], rank=8, alpha=16, seed=i)
               for i in range(ADAPTERS + 1)]
    modules = ",".join(f"a{i}={path}" for i, path in enumerate(folders[:ADAPTERS]))
    return ["--enable-lora", "--lora-modules", modules, "--max-loras", "2", "--max-lora-rank", "8"], folders[-1]


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pagedray serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no /health within {timeout_s:.0f} s")


def wait_idle(url: str, total: int, timeout_s: float = 120.0) -> int:
    """The KV blocks still in use once the server has had ``timeout_s`` to finish (0 at once when idle)."""
    deadline = time.monotonic() + timeout_s
    in_use = total - free_blocks(url)
    while in_use and time.monotonic() < deadline:
        time.sleep(1.0)
        in_use = total - free_blocks(url)
    return in_use


def growth(samples: list[dict], key: str) -> list[dict]:
    """Per process: ``key`` at the sample nearest 10% of the run's requests and at the last one."""
    if not samples:
        return []
    total = samples[-1]["done"] or 1
    early = min(samples, key=lambda s: abs(s["done"] - 0.1 * total))
    rows = []
    for role, last in samples[-1]["procs"].items():
        first = early["procs"].get(role)
        if first:
            rows.append({"process": role, f"{key} at 10%": first[key], f"{key} at end": last[key],
                         "growth %": 100.0 * (last[key] - first[key]) / first[key] if first[key] else 0.0})
    return rows


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for role in samples[-1]["procs"]:
        points = [(s["done"], s["procs"][role]["rss"] / 2**20) for s in samples if role in s["procs"]]
        ax.plot(*zip(*points), label=role)
    ax.set_xlabel("requests done")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=7)
    ax.set_title("pagedray soak: memory per process")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    parser.add_argument("--lora", action="store_true", help="serve adapters and add LORA_KINDS to the mix")
    parser.add_argument("--serve-args", default="", help="more `pagedray serve` flags, one string")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    kinds, extra, swap_folder = KINDS, shlex.split(args.serve_args), None
    adapters = tempfile.TemporaryDirectory(prefix="pagedray-soak-lora-")
    if args.lora:
        flags, swap_folder = lora_flags(Path(adapters.name))
        kinds, extra = KINDS + LORA_KINDS, extra + flags
    server = start_server(port, out.with_suffix(".log"), extra)
    try:
        wait_ready(url, server)
        total = free_blocks(url)                    # idle: every block is free
        done = [0]
        sampler = Sampler(url, server.pid, total, lambda: done[0], args.sample_s)
        sampler.samples.append(sampler.sample())
        sampler.start()
        started = time.monotonic()
        outcomes = asyncio.run(run_load(url, args.requests, args.concurrency, args.seed, done, kinds, swap_folder))
        wall = time.monotonic() - started
        sampler.stop.set()
        sampler.join()
        leaked = wait_idle(url, total)
        counters = engine_counters(url)
        sampler.samples.append(sampler.sample())
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        adapters.cleanup()
    per_kind = [{"kind": kind, **{o: outcomes[(kind, o)] for o in ("ok", "aborted", "lost")}} for kind in kinds]
    memory = growth(sampler.samples, "rss")
    print_table(per_kind, ["kind", "ok", "aborted", "lost"])
    for key in ("rss", "fds", "threads"):
        rows = growth(sampler.samples, key)
        if rows:
            print_table(rows, list(rows[0]))
    lost = sum(row["lost"] for row in per_kind)
    summary = {"requests": args.requests, "wall_s": wall, "req_per_s": args.requests / wall, "lost": lost,
               "aborted": sum(row["aborted"] for row in per_kind), "kv_blocks_in_use_after": leaked,
               "kv_blocks": total, "max_rss_growth_pct": max((r["growth %"] for r in memory), default=None),
               **counters}
    print(json.dumps(summary))
    if len(sampler.samples) > 1:
        plot(sampler.samples, out.with_suffix(".png"))
    write_json("soak", {"config": vars(args), "summary": summary, "per_kind": per_kind,
                        "memory": memory, "samples": sampler.samples}, out)
    return summary


if __name__ == "__main__":
    main()
