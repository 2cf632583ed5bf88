"""The host part of an engine step: the engine and one in-process worker at batch 64 / 256 / 512, every
sequence decoding, with the model's forward replaced by a stub (a slice of fixed random logits), so what is
timed is what the host does per step: schedule, plan, the worker's mirror and inputs, sampling, applying
the result, building outputs. One row runs the real forward of a tiny model (1 layer, hidden 64, vocab
1,024) for comparison.

Each system is an engine built once; each round adds ``batch`` requests of ``--prompt-len`` random token
ids (greedy, ``ignore_eos``), steps until every one has sampled its first token, then times ``--steps``
decode steps, and finishes the requests. Reported per system: ms per step and its parts (median of the
round's steps; median [min-max] over interleaved rounds), the msgpack round trip of the step's plan (what a
Ray or socket rank would decode; outside the step here), and the slope: the cost of one more running
sequence, from the stub rows at the smallest and the largest batch.

    python -m benchmarks.host_step [--batches 64,256,512] [--rounds 3] [--steps 32] [--ref REF] [--dry-run]

``--tenants N`` adds a ``fair-B`` row per stub batch B: the same, with fair share among N tenants
(``SchedulerConfig.tenants``, cluster/fair_share.py), the requests spread over them round-robin, and the ratio
``fair-B / stub-B``: what fair share costs the host step.

``--ref REF`` (a git commit) measures every system twice, ``name`` on this checkout and ``name@REF`` on a
worktree of REF, each run in a fresh process (this script with ``--child``), interleaved: the before and
after of a change in one run. ``--dry-run`` (CI): batches 4 and 8, 3 steps, no JSON unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common import REPO, add_round_args, finish_rounds, print_run, ref_import_root
from benchmarks.rounds import Metric, Ratio, run_rounds

PARTS = ("schedule", "plan", "prepare", "forward", "sample", "apply", "outputs")
VOCAB = 1024


def save_tiny_model(folder: Path) -> str:
    """A 1-layer Llama (hidden 64, vocab 1,024), random weights; no tokenizer (prompts are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


class StepClock:
    """Wraps the engine's and the worker's step parts (instance attributes) and sums their time per step."""

    def __init__(self, engine, stub_forward: bool) -> None:
        self.engine, self.parts = engine, dict.fromkeys(PARTS, 0.0)
        worker = engine.executor.worker
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.plan_builder, "build", "plan")
        self._wrap(worker.runner, "prepare", "prepare")
        self._wrap(worker.runner, "run", "forward")
        self._wrap(worker, "sample", "sample")
        if hasattr(worker.sampler, "argmax"):     # the plain-greedy path skips Worker.sample (not in older code)
            self._wrap(worker.sampler, "argmax", "sample")
        self._wrap(engine, "_apply", "apply")
        self._wrap(engine, "_outputs_of", "outputs")
        self.plans = []
        build = engine.plan_builder.build

        def keep_plan(out):
            plan = build(out)
            self.plans.append(plan)
            return plan
        engine.plan_builder.build = keep_plan
        if stub_forward:
            from pagedray.workers.runner.model_runner import StepOutput

            logits = torch.randn(4096, VOCAB, generator=torch.Generator().manual_seed(1))   # [rows, vocab]

            def forward(inputs, prompt_rows=None, pool_rows=None):
                rows = len(inputs.sampling_seqs)
                return StepOutput(logits[:rows] if rows else None, inputs.sampling_seqs, [], inputs.row_drafts)
            worker.runner.forward = forward

    def _wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - start
        setattr(owner, name, timed)

    def step(self) -> dict[str, float]:
        """One engine step: its wall ms and each part's ms."""
        self.parts = dict.fromkeys(PARTS, 0.0)
        start = time.perf_counter()
        self.engine.step()
        total = (time.perf_counter() - start) * 1e3
        return {"step": total, **{part: seconds * 1e3 for part, seconds in self.parts.items()}}


def _tenants_field(tenants: int) -> dict:
    """``SchedulerConfig(tenants=...)`` for ``tenants`` tenants; nothing for none (a ``--ref`` commit may predate
    the field)."""
    if not tenants:
        return {}
    from pagedray.workers.contract.config import TenantConfig

    return {"tenants": tuple(TenantConfig(f"t{i}") for i in range(tenants))}


def build_engine(model_path: str, batch: int, prompt_len: int, steps: int, stub_forward: bool,
                 device: str = "cpu", tenants: int = 0):
    from pagedray.cluster.engine import Engine
    from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    block_size = 16
    blocks = batch * (-(-(prompt_len + steps + 8) // block_size)) + 64
    config = EngineConfig(model=ModelConfig(model=model_path, dtype="float32", device=device),
                          cache=CacheConfig(block_size=block_size, num_blocks=blocks),
                          scheduler=SchedulerConfig(max_num_seqs=batch,
                                                    max_num_batched_tokens=max(2048, batch * prompt_len),
                                                    **_tenants_field(tenants)))
    engine = Engine(config)
    return engine, StepClock(engine, stub_forward)


def measure(engine, clock: StepClock, batch: int, prompt_len: int, steps: int, round_index: int,
            tenants: int = 0) -> dict:
    """Adds ``batch`` requests (round-robin over ``tenants`` tenants), steps to an all-decode batch, times
    ``steps`` steps, finishes the requests."""
    from pagedray.workers.contract.sampling_params import SamplingParams
    from pagedray.workers.contract.wire import decode_plan, encode_plan

    rng = random.Random(round_index)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"r{round_index}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        tenant = {"tenant": f"t{i % tenants}"} if tenants else {}
        engine.add(request_id, [rng.randrange(2, VOCAB) for _ in range(prompt_len)], params, **tenant)
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids)
                                          for s in engine.scheduler.running):
        engine.step()
    engine.step()                     # every sequence has its first token; the next steps are pure decodes
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"{engine.scheduler.num_running} of {batch} sequences running")
    samples, wire = [], []
    for _ in range(steps):
        clock.plans.clear()
        samples.append(clock.step())
        start = time.perf_counter()
        for plan in clock.plans:
            decode_plan(encode_plan(plan))
        wire.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    values = {f"{key}_ms": statistics.median(s[key] for s in samples) for key in ("step", *PARTS)}
    values["wire_ms"] = statistics.median(wire)
    return values


CHILD_MARK = "HOST_STEP_VALUES "


def run_child(name: str, round_index: int, args: argparse.Namespace, import_root: Path | None) -> dict:
    """One system measured once in a fresh process (this checkout's code, or REF's through ``import_root``)."""
    env = dict(os.environ)
    if import_root is not None:
        env["PYTHONPATH"] = str(import_root)
    argv = [sys.executable, "-m", "benchmarks.host_step", "--child", name, "--child-round", str(round_index),
            "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--threads", str(args.threads),
            "--device", args.device, "--tenants", str(args.tenants)]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK):])
    raise RuntimeError(f"{name}: the child process failed ({done.returncode}): {done.stderr[-1500:]}")


def child(name: str, round_index: int, args: argparse.Namespace) -> None:
    """``--child``: measure system ``name`` once and print its values as one JSON line."""
    import pagedray.cluster

    batch, stub = int(name.split("-")[1]), not name.startswith("tiny")
    tenants = args.tenants if name.startswith("fair") else 0
    with tempfile.TemporaryDirectory() as folder:
        engine, clock = build_engine(save_tiny_model(Path(folder)), batch, args.prompt_len, args.steps, stub,
                                     args.device, tenants)
        try:
            measure(engine, clock, batch, args.prompt_len, args.steps, round_index + 1000, tenants)   # warm-up
            values = measure(engine, clock, batch, args.prompt_len, args.steps, round_index, tenants)
        finally:
            engine.shutdown()
    values["code"] = str(Path(pagedray.cluster.__file__).resolve().parents[1])   # a detail: which tree ran
    print(CHILD_MARK + json.dumps(values), flush=True)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "host_step")
    parser.add_argument("--batches", default="64,256,512", help="stub batch sizes (comma-separated)")
    parser.add_argument("--tiny-batch", type=int, default=256, help="batch of the real tiny forward's row (0: none)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the host step is one thread)")
    parser.add_argument("--device", default="cpu", help="the engine's device (cpu: the host path alone; on a GPU "
                                                         "machine too, where its CPU is another model)")
    parser.add_argument("--dry-run", action="store_true", help="tiny batches and few steps (CI)")
    parser.add_argument("--ref", default=None, help="also measure this git commit's code (NAME@REF rows)")
    parser.add_argument("--tenants", type=int, default=0, help="also fair-B rows: fair share among this many tenants")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child, args.child_round, args)
        return None
    if args.dry_run:
        args.batches, args.tiny_batch, args.steps = "4,8", 4, 3
    batches = [int(b) for b in args.batches.split(",")]
    names = [f"stub-{b}" for b in batches] + ([f"tiny-{args.tiny_batch}"] if args.tiny_batch else [])
    fair = [f"fair-{b}" for b in batches] if args.tenants else []
    systems = names + fair + ([f"{n}@{args.ref}" for n in names] if args.ref else [])
    metrics = [Metric(f"{key}_ms", f"{key} ms", higher_is_better=False) for key in ("step", *PARTS, "wire")]
    with ref_import_root(args.ref) if args.ref else contextlib.nullcontext() as root:
        runs = run_rounds(systems, args.rounds,
                          lambda name, r: run_child(name.split("@")[0], r, args, root if "@" in name else None),
                          on_run=print_run)
    slopes = {}
    for suffix in ("", f"@{args.ref}") if args.ref else ("",):
        low, high = f"stub-{min(batches)}{suffix}", f"stub-{max(batches)}{suffix}"
        medians = [statistics.median(r.values["step_ms"] for r in runs if r.system == name and not r.error)
                   for name in (low, high)]
        if high != low:
            slopes[high] = (medians[1] - medians[0]) / (max(batches) - min(batches)) * 1e3
            print(f"-- {high}: one more running sequence costs {slopes[high]:.2f} us per step ({low} -> {high} "
                  f"medians: {medians[0]:.3f} -> {medians[1]:.3f} ms)")
    ratios = [Ratio(n, (f"{n}@{args.ref}",), ("step_ms",), f"{n} / {n}@{args.ref}") for n in names] if args.ref else []
    ratios += [Ratio(f"fair-{b}", (f"stub-{b}",), ("step_ms",), f"fair-{b} / stub-{b}") for b in batches if fair]
    out = None if args.dry_run and args.out == parser.get_default("out") else args.out
    return finish_rounds("host_step", out or "/dev/null", runs, metrics, ratios, vars(args),
                         {"slope_us_per_sequence": slopes})


if __name__ == "__main__":
    main()
