"""ModelRunner: StepPlan -> one forward over this rank's shard -> logits of the sampling rows.

Order of a step (every rank runs the same steps on the same plan, so collectives line up):
1. the mirror validates the plan, drops released ids and applies deltas / new sequences;
2. copy-on-write block copies are applied to every layer's K and V; with a draft model
   (``draft_model.py``) the same copies go to its cache, and it fills the step's draft placeholders;
3. the inputs are built on the host in one int32 tensor (``input_batch.build_host_batch``; a step of
   decode rows only, from the mirror's persistent block tables: ``build_decode_host_batch``), their
   attention metadata is checked there once (``kernels.check_step_metadata`` on CPU tensors: no device
   sync; the layers then skip the per-call value checks), and one copy moves them to the device;
4. one forward runs over the mixed batch; the final hidden states of each sampling sequence's last
   scheduled token go through the LM head (vocab-parallel, gathered to rank 0). A decode-only step
   goes to ``decode_graphs`` instead when the runner has one (CUDA graphs; padded to a bucket);
5. sequences that asked for prompt logprobs get them for the prompt positions computed this step
   (``prompt_logprobs.py``; eager steps only: a decode-only step has no prompt positions);
6. the mirror marks the scheduled tokens as computed.

Sampling is not done here: ``Worker`` hands ``StepOutput`` to the Sampler on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from ... import kernels
from ..contract.wire import PooledPart, PromptLogprobs, StepPlan
from ..kv_cache import KVCache, check_block_copies, copy_blocks
from ..models.decoder import DecoderForCausalLM
from .decode_graphs import DecodeGraphs
from .input_batch import BatchInputs, HostBatch, build_decode_host_batch, build_host_batch
from .pooling import PoolRows, compute_pooled, plan_pool_rows
from .prompt_logprobs import PromptRows, compute_prompt_logprobs, plan_prompt_rows
from .seq_mirror import BatchedSequence, MirrorStep, SequenceMirror, SequenceState


class Drafter(Protocol):
    """What a runner asks of its draft model (draft_model.DraftModel, which runs a ModelRunner of its own)."""

    def apply_plan_bookkeeping(self, released_seq_ids: list[int], block_copies: list[tuple[int, int]]) -> None: ...

    def propose(self, batch: list[BatchedSequence]) -> list[BatchedSequence]: ...


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor | None            # [rows, vocab] float32 on rank 0; None elsewhere or without rows
    sampling_seqs: list[SequenceState]     # one per logits row, in batch order
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)   # rank 0 only
    row_drafts: tuple[tuple[int, ...], ...] = ()   # per logits row: drafts before its position (input_batch)
    pooled: list[PooledPart] = field(default_factory=list)   # rank 0 only (pooling.py)


@dataclass(frozen=True)
class PreparedStep:
    rows: MirrorStep                 # the forward's sequences, in batch order
    host: HostBatch                  # checked host inputs (padded to the bucket when ``bucket`` is set)
    bucket: int | None               # decode-graph bucket, or None for the eager forward
    token_slots: np.ndarray | None = None   # [tokens] each token's LoRA slot (-1: none); None without LoRA
    state_snapshots: tuple[tuple[int, int, int], ...] = ()   # StepPlan.state_snapshots, taken during the forward


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, drafter: Drafter | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache        # data [layers, 2, blocks, block_size, kv_heads_local, head_dim] (+ scales)
        self.block_size = block_size
        self.device = device
        self.drafter = drafter          # speculative_model: fills MODEL_DRAFT placeholders in ``prepare``
        self.mirror = SequenceMirror(block_size, num_blocks=kv_cache.num_blocks, model_drafts=drafter is not None)
        self.decode_graphs: DecodeGraphs | None = None   # set by the worker (CUDA graphs) or a test
        self.lora = getattr(model, "lora", None)          # workers/lora/model_lora.ModelLora, when enabled

    def use_decode_graphs(self, graphs: DecodeGraphs) -> None:
        """Route decode-only steps through ``graphs`` (captured or, on CPU, run eagerly)."""
        if graphs.kv_cache is not self.kv_cache:
            raise ValueError("graphs: built over a different KV cache than this runner's")
        self.decode_graphs = graphs

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.run(self.prepare(plan))

    @torch.inference_mode()
    def run(self, step: PreparedStep | None) -> StepOutput:
        """Steps 4-6 for a prepared step (``prepare``'s result; None: nothing to run)."""
        if step is None:
            return StepOutput(None, [])
        if step.bucket is not None:
            output = StepOutput(self.decode_graphs.run(step.host, step.token_slots), step.host.sampling_seqs)
        else:
            rows = step.rows
            if self.lora is not None:
                self.lora.batch.set(step.token_slots)
            first_row = len(rows.decode_states)
            inputs = step.host.to_device(self.device)
            if step.state_snapshots:
                inputs = replace(inputs, meta=replace(inputs.meta, state_snapshots=step.state_snapshots))
            output = self.forward(inputs, plan_prompt_rows(rows.batch, first_row),
                                  plan_pool_rows(rows.batch, first_row))
        self.mirror.mark_computed(step.rows)
        return output

    def prepare(self, plan: StepPlan) -> PreparedStep | None:
        """Steps 1-3 up to the copy: mirror update, block copies, checked host inputs (None: nothing to run)."""
        check_block_copies(plan.block_copies, self.kv_cache.num_blocks)
        self._load_adapters(plan)
        if (plan.state_copies or plan.state_snapshots) and not hasattr(self.model, "copy_states"):
            raise ValueError("state_copies / state_snapshots: this model keeps no per-sequence state")
        if plan.state_snapshots:
            self.model.check_snapshots(plan.state_snapshots)
        rows = self.mirror.apply(plan)
        copy_blocks(self.kv_cache, plan.block_copies)
        if plan.state_copies:
            self.model.copy_states(plan.state_copies)     # forked samples continue from their parent's state
        if self.drafter is not None:
            self.drafter.apply_plan_bookkeeping(plan.released_seq_ids, plan.block_copies)
            rows = MirrorStep(batch=self.drafter.propose(rows.as_batch()))
        if not rows:
            return None
        graphs = self.decode_graphs is not None and not plan.state_snapshots
        bucket = self.decode_graphs.bucket_for(rows) if graphs else None
        if bucket is not None:
            host = self.decode_graphs.host_batch(rows, bucket, self.mirror.table_rows.tables)
        elif rows.batch:
            host = build_host_batch(rows.as_batch(), self.block_size, pin_memory=self.device.type == "cuda")
        else:       # decode rows only: the steady decode step
            host = build_decode_host_batch(rows.decode_states, self.mirror.table_rows.tables, self.block_size,
                                           pin_memory=self.device.type == "cuda")
        self.check_host_metadata(host)
        return PreparedStep(rows, host, bucket, self._token_slots(rows, host) if self.lora is not None else None,
                            tuple(plan.state_snapshots))

    def _load_adapters(self, plan: StepPlan) -> None:
        """The plan's LoRA loads, after checking every slot it names (ValueError, nothing loaded); then its
        host-memory drops and reads (wire.py: the reads run on the adapters' reader thread)."""
        loads, used = plan.lora_loads, [new.lora_slot for new in plan.new_seqs if new.lora_slot != -1]
        orders = plan.lora_reads or plan.lora_drops
        if (loads or used or orders) and self.lora is None:
            raise ValueError("lora_loads / lora_slot / lora_reads: this model runs without LoRA (enable_lora is off)")
        if not (loads or used or orders):
            return
        resident = set(self.lora.resident) | {load.slot for load in loads}
        for slot in used:
            if slot not in resident:
                raise ValueError(f"new_seqs: lora_slot {slot} holds no adapter")
        for load in loads:
            self.lora.load(load.slot, load.name, load.path)
        for files in plan.lora_drops:
            self.lora.drop(files.name, files.path)
        for files in plan.lora_reads:
            self.lora.start_read(files.name, files.path)

    @staticmethod
    def _token_slots(rows: MirrorStep, host: HostBatch) -> np.ndarray:
        """[tokens] the LoRA slot of each token of the step, in batch order (decode rows, then the rest)."""
        states = rows.decode_states + [item.state for item in rows.batch]
        per_seq = np.fromiter((state.lora_slot for state in states), dtype=np.int64, count=len(states))
        counts = np.diff(host.inputs.meta.cu_seqlens_q.numpy())[:len(states)]
        return np.repeat(per_seq, counts)

    def check_host_metadata(self, host: HostBatch) -> None:
        """Every metadata check (values included) on the host tensors, against this cache's shape."""
        meta = host.inputs.meta
        kernels.check_host_step_metadata(self.kv_cache.data.shape[2:], self.kv_cache.data.dtype, host.shape.tokens,
                                         meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens_k,
                                         meta.block_tables, meta.max_query_len)

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, prompt_rows: list[PromptRows] | None = None,
                pool_rows: list[PoolRows] | None = None) -> StepOutput:
        """The eager model forward over the batch, then the LM head at the sampling rows (and at the
        prompt rows of sequences that asked for prompt logprobs), and the pooling requests' parts.
        When only the sampling rows' hidden states are wanted (no prompt logprobs, no pooling, no LoRA, whose
        per-token slots cover every row) the last layer finishes only those rows (``LastLayerRows``)."""
        keep = inputs.last_layer
        if (keep is not None and not prompt_rows and not pool_rows and self.lora is None
                and getattr(self.model, "takes_last_layer_rows", False)):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, keep)   # [rows, hidden]
            sampled = hidden
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)   # [tokens, hidden]
            sampled = hidden[inputs.logits_indices] if inputs.sampling_seqs else None
        logits = None
        if inputs.sampling_seqs:
            logits = self.model.compute_logits(sampled)                                        # [rows, vocab]
        prompt = compute_prompt_logprobs(self.model, hidden, prompt_rows) if prompt_rows else []
        pooled = compute_pooled(self.model, hidden, pool_rows) if pool_rows else []
        return StepOutput(logits, inputs.sampling_seqs, prompt, inputs.row_drafts, pooled)
