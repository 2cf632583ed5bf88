"""Decode steps over static buffers, replayed as CUDA graphs: one graph per batch-size bucket.

A decode-only step (every scheduled sequence runs one token and samples it) of ``n`` sequences runs
at the smallest bucket ``b >= n`` (``bucket_sizes``: 1, 2, 4, 8, then every 16, and
``max_num_seqs``). Its host inputs, padded to ``b`` rows and to the fixed block-table width
``ceil(max_model_len / block_size)`` (``input_batch.build_host_batch(rows=, width=)``), are copied
into the static device buffer with one copy; then bucket ``b``'s graph replays the whole forward:
embedding, every layer (``store_kv`` and the paged decode kernel included; the decode kernel's split
count follows the fixed table width, so it is the same at every replay of a bucket), the final norm
and the LM head of all ``b`` rows, whose logits land in a static ``[max_bucket, vocab]`` buffer.
``run`` returns ``logits[:n]``: a view of that buffer, valid until the next ``run``.

Capture (``capture``, CUDA only, at start-up after the KV cache exists): buckets largest first, all
in one memory pool, each over padding-only inputs (they write no KV). Capture time and the memory
the graphs hold are measured and logged and returned as a ``CaptureReport``.

Without capture (CPU, or before ``capture``), ``run`` calls the same static forward eagerly over the
same buffers and padding: the CPU tests check the bucket/padding path this way.

With LoRA (``model.lora``): each row's adapter slot is one more static input (``slots``, -1 for the base model
and for padding); the graphs capture the Triton LoRA product of every adapted layer over it, so a step with
adapter rows replays like any other (rows without one add nothing). Without capture the rows' slots go to the
usual per-step ``LoraBatch.set``.

Invariants:
- the static buffers and the KV cache never move after capture (graphs hold their addresses);
- a padding row writes no KV slot (slot -1) and its logits are never returned;
- mixed and prefill steps never come here (``ModelRunner`` runs them eagerly).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..kv_cache import KVCache
from ..models.decoder import DecoderForCausalLM
from .input_batch import HostBatch, PackedShape, build_decode_host_batch, build_host_batch, is_decode_only, unpack
from .seq_mirror import MirrorStep

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... (every 16) below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs!r}")
    sizes = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    sizes += list(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return sizes + [max_num_seqs]


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]
    seconds: float
    graph_bytes: int      # device memory taken by capture (graph pool + the graphs themselves)


class DecodeGraphs:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache          # workers.kv_cache.KVCache
        self.block_size = block_size
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)      # block-table columns of every bucket
        largest = self.buckets[-1]
        self.static = torch.zeros(self._shape(largest).size, dtype=torch.int32, device=device)
        self.logits = torch.zeros(largest, model.dims.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora = getattr(model, "lora", None)          # workers/lora/model_lora.ModelLora, when enabled
        self.slots = torch.full((largest,), -1, dtype=torch.int32, device=device)   # [max bucket] LoRA slot per row

    def _shape(self, bucket: int) -> PackedShape:
        return PackedShape(tokens=bucket, seqs=bucket, logits=bucket, width=self.width)

    def bucket_for(self, rows: MirrorStep) -> int | None:
        """The bucket that runs this step, or None (not decode-only, or more rows than the largest)."""
        if not rows or len(rows) > self.buckets[-1] or not is_decode_only(rows.batch):
            return None
        return next(b for b in self.buckets if b >= len(rows))

    def host_batch(self, rows: MirrorStep, bucket: int, tables=None) -> HostBatch:
        """The step's inputs padded to ``bucket`` rows and the fixed width; decode rows only (the usual case)
        come from the mirror's block-table matrix ``tables`` when given."""
        pinned = self.device.type == "cuda"
        if not rows.batch and tables is not None:
            return build_decode_host_batch(rows.decode_states, tables, self.block_size, pin_memory=pinned,
                                           rows=bucket, width=self.width)
        return build_host_batch(rows.as_batch(), self.block_size, pin_memory=pinned, rows=bucket, width=self.width)

    def _forward(self, bucket: int) -> None:
        """The static forward of one bucket: reads ``self.static``, writes ``self.logits[:bucket]``."""
        inputs = unpack(self.static, self._shape(bucket), max_query_len=1, sampling_seqs=[])
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)   # [bucket, hidden]
        self.logits[:bucket].copy_(self.model.compute_logits(hidden))                        # [bucket, vocab]

    @torch.inference_mode()
    def run(self, host: HostBatch, token_slots: np.ndarray | None = None) -> torch.Tensor:
        """One padded decode step -> logits ``[real rows, vocab]`` (a view, valid until the next run).
        ``token_slots`` [real rows]: each row's LoRA slot (-1: none); needed exactly when the model has LoRA."""
        bucket = host.shape.seqs
        if host.shape != self._shape(bucket) or bucket not in self.buckets:
            raise ValueError(f"host: shape {host.shape} is not a decode bucket of this runner")
        if (token_slots is None) != (self.lora is None) or (token_slots is not None
                                                           and len(token_slots) != host.num_real_rows):
            raise ValueError(f"token_slots: one LoRA slot per real row with LoRA, none without; got "
                             f"{None if token_slots is None else len(token_slots)} for {host.num_real_rows} rows")
        self.static[:host.shape.size].copy_(host.packed, non_blocking=True)
        graph = self.graphs.get(bucket)
        if self.lora is not None:
            padded = np.full(bucket, -1, dtype=np.int32)                                    # [bucket]
            padded[:len(token_slots)] = token_slots
            if graph is None:
                self.lora.batch.set(padded)
            else:
                self.slots[:bucket].copy_(torch.from_numpy(padded))
        if graph is None:
            self._forward(bucket)
        else:
            graph.replay()
        return self.logits[:host.num_real_rows]

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture one graph per bucket (CUDA only; largest first, one shared memory pool)."""
        if self.device.type != "cuda":
            raise ValueError(f"device: CUDA graphs need a CUDA device, got {self.device}")
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            padding = self.host_batch(MirrorStep(), bucket)
            self.static[:padding.shape.size].copy_(padding.packed)
            if self.lora is not None:
                self.lora.batch.use_static(self.slots[:bucket])
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):          # warm-up (Triton compiles, allocator settles) off the capture
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        report = CaptureReport(tuple(self.buckets), time.perf_counter() - start, max(0, free_before - free_after))
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, holding %.1f MiB",
                    len(self.buckets), ", ".join(map(str, self.buckets)), report.seconds,
                    report.graph_bytes / 2**20)
        return report
