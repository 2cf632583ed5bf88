"""ModelRunner: StepPlan -> one forward over this rank's shard -> logits of the sampling rows.

Order of a step (every rank runs the same steps on the same plan, so collectives line up):
1. the mirror validates the plan, drops released ids and applies deltas / new sequences;
2. copy-on-write block copies are applied to every layer's K and V;
3. the inputs are built (``input_batch.build_batch``), their attention metadata is checked once
   (``kernels.check_step_metadata``; the layers then skip the per-call value checks), and one
   forward runs over the mixed batch;
4. the final hidden states of each sampling sequence's last scheduled token go through the LM head
   (vocab-parallel, gathered to rank 0);
5. the mirror marks the scheduled tokens as computed.

Sampling is not done here: ``Worker`` hands ``StepOutput`` to the Sampler on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .contract.wire import StepPlan
from .input_batch import BatchInputs, build_batch
from .kv_cache import check_block_copies, copy_blocks
from .models.decoder import DecoderForCausalLM
from .seq_mirror import ScheduledSequence, SequenceMirror, SequenceState


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor | None            # [rows, vocab] float32 on rank 0; None elsewhere or without rows
    sampling_seqs: list[SequenceState]     # one per logits row, in batch order


@dataclass(frozen=True)
class PreparedStep:
    batch: list[ScheduledSequence]   # the forward's sequences, in batch order
    inputs: BatchInputs


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache        # [layers, 2, blocks, block_size, kv_heads_local, head_dim]
        self.block_size = block_size
        self.device = device
        self.mirror = SequenceMirror(block_size, num_blocks=kv_cache.shape[2])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        step = self.prepare(plan)
        if step is None:
            return StepOutput(None, [])
        output = self.forward(step.inputs)
        self.mirror.mark_computed(step.batch)
        return output

    def prepare(self, plan: StepPlan) -> PreparedStep | None:
        """Steps 1-3 up to the forward: mirror update, block copies, input tensors (None: nothing to run)."""
        check_block_copies(plan.block_copies, self.kv_cache.shape[2])
        batch = self.mirror.apply(plan)
        copy_blocks(self.kv_cache, plan.block_copies)
        if not batch:
            return None
        inputs = build_batch(batch, self.block_size, self.device)
        meta = inputs.meta   # checked here once; the attention layers skip the value checks
        kernels.check_step_metadata(self.kv_cache[0, 0], self.kv_cache[0, 1], inputs.input_ids.shape[0],
                                    meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                                    meta.max_query_len)
        return PreparedStep(batch, inputs)

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs) -> StepOutput:
        """The model forward over the batch, then the LM head at the sampling rows only."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)   # [tokens, hidden]
        logits = None
        if inputs.sampling_seqs:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])                 # [rows, vocab]
        return StepOutput(logits, inputs.sampling_seqs)
