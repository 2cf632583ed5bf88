"""One step's model inputs, built from the scheduled sequences of a plan.

A batch freely mixes prefill chunks (many tokens, possibly starting after a prefix-cache hit) and
decode tokens (one token each). Sequence i contributes the tokens at positions
``[computed_i, computed_i + scheduled_i)``; they are laid out back to back, in batch order.

Python touches each sequence once (token slice, block table row); everything per token (positions,
slot ids) is computed with a handful of vectorised torch ops on CPU, then moved to the device:

    seq_of_token = repeat_interleave(arange(seqs), q_lens)                     # [tokens]
    position     = arange(tokens) - cu_q[seq_of_token] + computed[seq_of_token]
    slot         = block_tables[seq_of_token, position // B] * B + position % B

Logits are needed only at the last scheduled token of each sequence that samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers.attention import AttentionMetadata
from .seq_mirror import ScheduledSequence, SequenceState


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor        # [tokens] int64
    positions: torch.Tensor        # [tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [sampling rows] int64: index of each sampler's last token
    sampling_seqs: list[SequenceState]


def build_batch(batch: list[ScheduledSequence], block_size: int, device: torch.device) -> BatchInputs:
    if not batch:
        raise ValueError("batch: at least one scheduled sequence is required")
    input_ids: list[int] = []
    computed, q_lens, tables, sampling = [], [], [], []
    for item in batch:
        state, start = item.state, item.state.num_computed_tokens
        input_ids += state.token_slice(start, start + item.num_scheduled_tokens)
        computed.append(start)
        q_lens.append(item.num_scheduled_tokens)
        tables.append(state.block_ids)
        sampling.append(item.samples)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)                        # [seqs]
    computed_t = torch.tensor(computed, dtype=torch.int32)                    # [seqs]
    cu_seqlens_q = torch.zeros(len(batch) + 1, dtype=torch.int32)
    torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
    num_tokens = len(input_ids)
    seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), q_lens_t)  # [tokens]
    positions = (torch.arange(num_tokens) - cu_seqlens_q[seq_of_token] + computed_t[seq_of_token]).long()
    slots = block_tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    last_token = cu_seqlens_q[1:].long() - 1                                  # [seqs]
    logits_indices = last_token[torch.tensor(sampling, dtype=torch.bool)]
    meta = AttentionMetadata(
        slot_mapping=slots.to(device, non_blocking=True),
        cu_seqlens_q=cu_seqlens_q.to(device, non_blocking=True),
        seq_lens_k=(computed_t + q_lens_t).to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        max_query_len=max(q_lens),
    )
    return BatchInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True),
        positions=positions.to(device, non_blocking=True),
        meta=meta,
        logits_indices=logits_indices.to(device, non_blocking=True),
        sampling_seqs=[item.state for item, s in zip(batch, sampling) if s],
    )
