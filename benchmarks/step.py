"""Per-step cost of the worker (CPU) split by phase, against a Hugging Face forward of the same batch.

Both sides compute in float32, or in ``--dtype bfloat16``.

Scenarios (contexts are what a decode step attends over; the KV cache holds random values, since
timing does not depend on them, so no long prefill is needed to set a scenario up):

- ``decode-B``: B sequences with contexts 200..300 tokens, one new token each (B = ``--batch-sizes``);
- ``mixed``: 16 decode tokens (contexts 200..300) plus one fresh 256-token prefill chunk per step.

One pagedray step is timed in the phases of ``Worker.execute``:
``prepare`` (mirror update + input tensors, ``ModelRunner.prepare``), ``forward`` (model + LM head at
the sampling rows, ``ModelRunner.forward``; includes ``attention``, which is the time spent inside
the ``PagedAttention`` modules, measured with forward hooks: 0 for the ``decode-B`` rows on the
one-call CPU decode path, whose layers run inside one C call; ``--enforce-eager`` runs them layer by
layer) and ``sampler`` (greedy rows).
The peer is ``transformers`` ``AutoModelForCausalLM`` (sdpa attention) on the same weights and
threads: one decode forward over the batch left-padded to its longest context with a ``DynamicCache``
(the ``generate`` inner step), plus, for ``mixed``, a separate forward of the prefill chunk
(``logits_to_keep=1``). ``ratio`` = pagedray step (prepare + forward + sampler) / HF forward.
Steps of the two alternate one by one and every figure is a median over ``--steps`` steps, so load
from other processes on the shared machine hits both alike.

    python -m benchmarks.step [--model default|tiny|PATH] [--batch-sizes 1,16,64]
        [--threads 1] [--steps 15] [--dtype float32|bfloat16] [--json benchmarks/results/step.json]

Results of the CPU performance pass (2-core shared CPU, load average 4-10 from other jobs, so absolute
ms drift between runs; SmolLM2-135M-Instruct fp32, 1 thread; two runs each of 15 interleaved steps).
"before" = the code at commit 4b5b0ad with only the prepare/forward split needed to time it.
ratio = pagedray step / HF forward (lower is better); attn/HF = attention ms / HF forward ms.

    scenario    before: ratio  attn/HF    after: ratio  attn/HF    after: step ms (attention ms)
    decode-1    1.09 / 1.12    .17 / .19  1.03 / 1.05   .10 / .12   63.2 (6.0) / 42.6 (4.8)
    decode-16   1.13 / 1.16    .38 / .41  1.10 / 1.09   .33 / .36   204.1 (61.2) / 212.4 (70.6)
    decode-64   1.01 / 1.05    .42 / .44  0.92 / 0.98   .35 / .39   376.1 (142.9) / 566.2 (224.4)
    mixed       1.01 / 1.03    .16 / .18  0.99 / 0.97   .16 / .16   1113.6 (174.8) / 1126.8 (180.9)

What changed: attention metadata is value-checked once per step instead of in 60 kernel calls;
the CPU decode attention sorts sequences by length and gathers per 2 MiB group straight into SDPA
(no transposing copies, one broadcast mask); q and k are rotated in one call with a folded sign
(bit-identical to rotate-half); no ``v.contiguous()`` copy; ``store_kv`` on CPU is one
``index_copy_`` per cache. prepare grows by ~0.2 ms (the once-per-step check); the sampler was
already cheap for greedy rows (2 ms at 64 x 49152). Left: the linear layers (same ``F.linear`` as
HF, ~60-85% of a step) and the K/V gather from DRAM (~60% of the attention time at batch 64).
Threads (same process, steps alternated): 1 vs 2 threads = 40.4 vs 40.1 ms (batch 1), 127 vs 97 ms
(batch 16), 430-480 ms vs 7.9-8.5 s (batch 64, while other jobs kept a core busy: every small
parallel region then waits for a scheduler slice). Pin one thread per worker on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import NewSequence, RunningDelta, StepPlan
from pagedray.workers.layers.attention import PagedAttention
from pagedray.workers.weights.default_model import resolve_model_path
from pagedray.workers.worker import Worker

from benchmarks.common import hf_cache_kwargs
from benchmarks.rounds import environment

BLOCK_SIZE = 16
PREFILL_CHUNK = 256
MIXED_DECODE = 16
GREEDY = SamplingParams(temperature=0.0)


def contexts(num_seqs: int) -> list[int]:
    return [200 + (37 * i) % 101 for i in range(num_seqs)]


@dataclass
class PhaseTimes:
    """Per-step milliseconds of each phase (lists, one entry per timed step)."""

    prepare: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    attention: list[float] = field(default_factory=list)
    sampler: list[float] = field(default_factory=list)
    hf_forward: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float]:
        out = {name: statistics.median(values) for name, values in vars(self).items() if values}
        out["step"] = statistics.median(p + f + s for p, f, s in zip(self.prepare, self.forward, self.sampler))
        out["ratio_vs_hf"] = out["step"] / out["hf_forward"]
        return out


class AttentionClock:
    """Sums the wall time spent inside every ``PagedAttention`` module (forward pre/post hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        self._handles = []
        for module in model.modules():
            if isinstance(module, PagedAttention):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave))

    def _enter(self, *_) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_) -> None:
        self.total += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class PagedrayScenario:
    """A Worker holding ``ctx`` decode sequences (random KV history) and optionally a prefill stream."""

    def __init__(self, model: str, ctx: list[int], prefill: bool, threads: int, max_steps: int,
                 dtype: str = "float32", enforce_eager: bool = False) -> None:
        per_seq = [-(-(n + max_steps + 1) // BLOCK_SIZE) for n in ctx]
        chunk_blocks = -(-PREFILL_CHUNK // BLOCK_SIZE)
        num_blocks = sum(per_seq) + chunk_blocks
        config = EngineConfig(model=ModelConfig(model=model, dtype=dtype, enforce_eager=enforce_eager),
                              cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                              parallel=ParallelConfig(threads_per_worker=threads))
        self.worker = Worker(config)
        self.worker.init_kv_cache(num_blocks)
        self.worker.runner.kv_cache.data.normal_()
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()  # scattered
        self.chunk_blocks, order = order[:chunk_blocks], order[chunk_blocks:]
        new = []
        for i, n in enumerate(ctx):     # history already "computed": only the last token is scheduled
            blocks, order = order[:per_seq[i]], order[per_seq[i]:]
            new.append(NewSequence(i, [(7 + 13 * i + j) % 1000 for j in range(n)], [], n - 1, 1, blocks, GREEDY))
        self.worker.execute(StepPlan(0, new_seqs=new))
        self.num_decode = len(ctx)
        self.prefill = prefill
        self.step_id = 1
        self.clock = AttentionClock(self.worker.model)

    def _plan(self) -> StepPlan:
        running = [RunningDelta(i, 1, [], 11) for i in range(self.num_decode)]
        if not self.prefill:
            return StepPlan(self.step_id, running=running)
        seq_id = 10_000 + self.step_id
        chunk = NewSequence(seq_id, [(5 * seq_id + j) % 1000 for j in range(PREFILL_CHUNK)], [], 0,
                            PREFILL_CHUNK, self.chunk_blocks, GREEDY)
        released = [seq_id - 1] if self.step_id > 1 else []
        return StepPlan(self.step_id, new_seqs=[chunk], running=running, released_seq_ids=released)

    @torch.inference_mode()
    def step(self, times: PhaseTimes | None) -> None:
        runner, plan = self.worker.runner, self._plan()
        self.step_id += 1
        self.clock.total = 0.0
        start = time.perf_counter()
        prepared = runner.prepare(plan)
        middle = time.perf_counter()
        output = runner.forward(prepared.host.to_device(runner.device))
        runner.mirror.mark_computed(prepared.rows)
        after_forward = time.perf_counter()
        self.worker.sample(output)
        end = time.perf_counter()
        if times is not None:
            times.prepare.append((middle - start) * 1e3)
            times.forward.append((after_forward - middle) * 1e3)
            times.attention.append(self.clock.total * 1e3)
            times.sampler.append((end - after_forward) * 1e3)

    def close(self) -> None:
        self.clock.remove()
        self.worker.shutdown()


class HFScenario:
    """The same batch through transformers: a left-padded decode step over a DynamicCache (+ a chunk)."""

    def __init__(self, hf_model, ctx: list[int], prefill: bool) -> None:
        from transformers import DynamicCache

        cfg = hf_model.config
        self.model, self.prefill = hf_model, prefill
        width, batch = max(ctx), len(ctx)
        kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            self.cache.update(torch.randn(batch, kv_heads, width, head_dim, dtype=hf_model.dtype),
                              torch.randn(batch, kv_heads, width, head_dim, dtype=hf_model.dtype), layer)
        self.mask = torch.zeros(batch, width, dtype=torch.long)
        for i, n in enumerate(ctx):
            self.mask[i, width - n:] = 1                                        # left padding
        self.tokens = torch.full((batch, 1), 11, dtype=torch.long)
        self.chunk = torch.arange(PREFILL_CHUNK, dtype=torch.long)[None] % 1000

    @torch.inference_mode()
    def step(self, times: PhaseTimes | None) -> None:
        start = time.perf_counter()
        self.mask = torch.cat([self.mask, torch.ones(self.mask.shape[0], 1, dtype=torch.long)], dim=1)
        self.model(input_ids=self.tokens, attention_mask=self.mask, use_cache=True,
                   **hf_cache_kwargs(self.model, self.cache))
        if self.prefill:
            self.model(input_ids=self.chunk, use_cache=True, logits_to_keep=1)
        if times is not None:
            times.hf_forward.append((time.perf_counter() - start) * 1e3)


def run_scenario(name: str, model: str, hf_model, ctx: list[int], prefill: bool, args) -> dict:
    ours = PagedrayScenario(model, ctx, prefill, args.threads, args.steps + 2, args.dtype, args.enforce_eager)
    peer = HFScenario(hf_model, ctx, prefill)
    times = PhaseTimes()
    for _ in range(2):                     # warm-up
        ours.step(None)
        peer.step(None)
    for _ in range(args.steps):            # alternate step by step: load bursts hit both alike
        ours.step(times)
        peer.step(times)
    ours.close()
    tokens = len(ctx) + (PREFILL_CHUNK if prefill else 0)
    return {"scenario": name, "decode_seqs": len(ctx), "tokens": tokens, **times.medians()}


def run(model: str, batch_sizes: list[int], args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(model))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype),
                                                    attn_implementation="sdpa").eval()
    rows = [run_scenario(f"decode-{b}", path, hf_model, contexts(b), False, args) for b in batch_sizes]
    rows.append(run_scenario("mixed", path, hf_model, contexts(MIXED_DECODE), True, args))
    return rows


def _tiny_model(folder: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


COLUMNS = ("scenario", "tokens", "prepare", "forward", "attention", "sampler", "step", "hf_forward",
           "ratio_vs_hf")


def print_table(rows: list[dict]) -> None:
    print(" ".join(f"{c:>12}" for c in COLUMNS))
    for r in rows:
        print(" ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both sides compute in this dtype")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="decode steps layer by layer (the attention column is 0 on the one-call CPU decode path, "
                             "whose layers run inside one C call)")
    parser.add_argument("--json", default="benchmarks/results/step.json")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        model = _tiny_model(folder) if args.model == "tiny" else args.model
        rows = run(model, batch_sizes, args)
    print_table(rows)
    with open(args.json, "w") as out:
        json.dump({"model": args.model, "threads": args.threads, "steps": args.steps, "dtype": args.dtype,
                   "enforce_eager": args.enforce_eager,
                   "environment": environment(),
                   "unit": "ms per step (median)", "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
