"""One step's model inputs, built from the scheduled sequences of a plan: on the host, then one copy.

A batch freely mixes prefill chunks (many tokens, possibly starting after a prefix-cache hit) and
decode tokens (one token each). Sequence i contributes the tokens at positions
``[computed_i, computed_i + scheduled_i)``; they are laid out back to back, in batch order.

Python touches each sequence once (token slice, block table row); everything per token (positions,
slot ids) is computed with a handful of vectorised NumPy ops on the host:

    seq_of_token = repeat_interleave(arange(seqs), q_lens)                     # [tokens]
    position     = arange(tokens) - cu_q[seq_of_token] + computed[seq_of_token]
    slot         = block_tables[seq_of_token, position // B] * B + position % B

Logits are needed only at the last scheduled token of each sequence that samples, and, for a
sequence with speculative drafts (its last scheduled tokens), at its own last token and at every
draft: one row each, in position order (``row_drafts`` says which drafts precede a row's position).

Host first, one copy (``HostBatch``): every input is int32 and lives in ONE host tensor (pinned when
the target is CUDA), in the order of ``FIELDS``; the runner checks the attention metadata on these host
tensors (no device sync), and ``HostBatch.to_device`` moves the whole step with a single copy and hands
out views. On CPU the "copy" is the host tensor itself.

``state_slots`` [seqs]: each sequence's slot of a hybrid model's state pool (``NewSequence.state_slot``; -1
for models without one, and for padding rows).

Padding (``rows=``, decode-only steps, for the CUDA-graph buckets of ``decode_graphs``): rows past the
real sequences are dummies that write no KV (slot -1), attend one key of block 0 (seq_len 1, a zero
block-table row) and are never sampled; ``width=`` fixes the block-table width so every step of a
bucket has the same shapes.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.attention import AttentionMetadata, LastLayerRows
from .seq_mirror import BatchedSequence, SequenceState

FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens_k", "cu_seqlens_q", "logits_indices",
          "block_tables", "state_slots")


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor        # [tokens] int32
    positions: torch.Tensor        # [tokens] int32
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [sampling rows] int32: index of each sampling row's token
    sampling_seqs: list[SequenceState]       # one per sampling row (a sequence with drafts: one per position)
    row_drafts: tuple[tuple[int, ...], ...] = ()   # per row: the drafts before its position (() if none)
    # set when fewer rows sample than the step has tokens: what the last layer must finish (LastLayerRows)
    last_layer: LastLayerRows | None = None


@dataclass(frozen=True)
class PackedShape:
    """Lengths of the packed fields: tokens, sequences (rows), sampling rows, block-table width."""

    tokens: int
    seqs: int
    logits: int
    width: int

    def lengths(self) -> tuple[int, ...]:
        t, s = self.tokens, self.seqs
        return (t, t, t, s, s + 1, self.logits, s * self.width, s)

    @property
    def size(self) -> int:
        return sum(self.lengths())


def unpack(packed: torch.Tensor, shape: PackedShape, max_query_len: int,
           sampling_seqs: list[SequenceState], row_drafts: tuple[tuple[int, ...], ...] = (),
           kept_seqs: KeptSeqs | None = None) -> BatchInputs:
    """Views of one packed int32 tensor (host or device) as the step's inputs (``kept_seqs``: on the
    packed tensor's device)."""
    parts = dict(zip(FIELDS, packed[:shape.size].split(shape.lengths())))
    last_layer = None if kept_seqs is None else LastLayerRows(parts["logits_indices"], kept_seqs.seqs,
                                                              kept_seqs.cu_seqlens_q, kept_seqs.max_query_len)
    meta = AttentionMetadata(
        slot_mapping=parts["slot_mapping"],
        cu_seqlens_q=parts["cu_seqlens_q"],
        seq_lens_k=parts["seq_lens_k"],
        block_tables=parts["block_tables"].view(shape.seqs, shape.width),
        max_query_len=max_query_len,
        state_slots=parts["state_slots"],
    )
    return BatchInputs(parts["input_ids"], parts["positions"], meta, parts["logits_indices"], sampling_seqs,
                       row_drafts, last_layer)


@dataclass(frozen=True)
class KeptSeqs:
    """``LastLayerRows`` less its rows (those are the packed ``logits_indices``)."""

    seqs: torch.Tensor            # [kept seqs] int32
    cu_seqlens_q: torch.Tensor    # [kept seqs + 1] int32
    max_query_len: int

    def to(self, device: torch.device) -> KeptSeqs:
        return KeptSeqs(self.seqs.to(device, non_blocking=True), self.cu_seqlens_q.to(device, non_blocking=True),
                        self.max_query_len)


def kept_seqs(logits_indices: np.ndarray, cu_seqlens_q: np.ndarray) -> KeptSeqs | None:
    """The sequences whose rows the last layer must finish, when fewer rows sample than there are tokens;
    None when every token samples (a decode step: nothing to leave out) or when some sequence's sampling
    rows are not the last rows of its chunk (the attention call needs them to be; never the case for the
    rows ``build_host_batch`` makes). logits_indices [rows] int32 ascending, cu_seqlens_q [seqs + 1]."""
    if len(logits_indices) == int(cu_seqlens_q[-1]):
        return None
    before = np.searchsorted(logits_indices, cu_seqlens_q).astype(np.int32)      # [seqs + 1] rows before each seq
    counts = np.diff(before)                                                     # [seqs] sampling rows per seq
    if before[-1] != len(logits_indices) or (counts > np.diff(cu_seqlens_q)).any():
        return None
    seq_of_row = np.repeat(np.arange(len(counts)), counts)                       # [rows]
    from_end = before[seq_of_row + 1] - np.arange(len(logits_indices))           # 1 for each seq's last row
    if not np.array_equal(logits_indices, cu_seqlens_q[seq_of_row + 1] - from_end):
        return None
    seqs = np.flatnonzero(counts).astype(np.int32)
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(counts[seqs], out=cu[1:])
    return KeptSeqs(torch.from_numpy(seqs), torch.from_numpy(cu), int(counts.max()) if len(counts) else 0)


@dataclass(frozen=True)
class HostBatch:
    packed: torch.Tensor                # [shape.size] int32 on CPU (pinned for a CUDA target)
    shape: PackedShape
    max_query_len: int
    sampling_seqs: list[SequenceState]
    num_real_rows: int                  # sequences of the plan (rows past them are padding)
    row_drafts: tuple[tuple[int, ...], ...] = ()   # BatchInputs.row_drafts
    kept_seqs: KeptSeqs | None = None   # host tensors (BatchInputs.last_layer)

    @functools.cached_property
    def inputs(self) -> BatchInputs:
        """The host tensors (what the runner checks before the copy; made once)."""
        return unpack(self.packed, self.shape, self.max_query_len, self.sampling_seqs, self.row_drafts,
                      self.kept_seqs)

    def to_device(self, device: torch.device) -> BatchInputs:
        if device.type == "cpu":
            return self.inputs
        packed = self.packed.to(device, non_blocking=True)
        kept = None if self.kept_seqs is None else self.kept_seqs.to(device)
        return unpack(packed, self.shape, self.max_query_len, self.sampling_seqs, self.row_drafts, kept)


def is_decode_only(batch: list[BatchedSequence]) -> bool:
    """Every sequence runs exactly one token and samples it (what a decode graph can replay)."""
    return all(item.num_scheduled_tokens == 1 and item.samples for item in batch)


def build_host_batch(batch: list[BatchedSequence], block_size: int, pin_memory: bool = False,
                     rows: int | None = None, width: int | None = None) -> HostBatch:
    """The step's inputs in one host tensor. ``rows``/``width``: pad a decode-only batch (module doc)."""
    if not batch and rows is None:
        raise ValueError("batch: at least one scheduled sequence is required")
    if rows is not None and (rows < len(batch) or not is_decode_only(batch)):
        raise ValueError(f"rows: padding to {rows} rows needs a decode-only batch of at most {rows} sequences")
    input_ids: list[int] = []
    computed, q_lens, tables, sampling, state_slots = [], [], [], [], []
    for item in batch:
        state, start = item.state, item.state.num_computed_tokens
        input_ids += state.token_slice(start, start + item.num_own_tokens)
        input_ids += item.draft_token_ids
        computed.append(start)
        q_lens.append(item.num_scheduled_tokens)
        tables.append(state.block_ids)
        sampling.append(item.samples)
        state_slots.append(state.state_slot)
    num_pad = 0 if rows is None else rows - len(batch)
    # padding rows: token 0 at position 0 (computed = 0, q_len = 1), table row of zeros, sampled rows
    input_ids += [0] * num_pad
    computed += [0] * num_pad
    q_lens += [1] * num_pad
    tables += [[]] * num_pad
    state_slots += [-1] * num_pad
    num_seqs = len(tables)
    num_used = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)          # [seqs]
    needed = int(num_used.max()) if num_seqs else 0
    if width is not None and needed > width:
        raise ValueError(f"width: {width} block-table columns, but a sequence uses {needed} blocks")
    if width is None:
        width = max(needed, 1 if num_pad else 0)   # a padding row reads column 0
    # NumPy for the host-side index work: a few microseconds an op where a torch op on a small CPU
    # tensor costs tens (a step at batch 256 ran 0.2-0.3 ms of boolean-mask fill alone)
    block_tables = np.zeros((num_seqs, width), dtype=np.int32)                         # [seqs, width]
    flat_ids = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(num_used.sum()))
    row_of_id = np.repeat(np.arange(num_seqs), num_used)
    block_tables[row_of_id, np.arange(flat_ids.size) - np.repeat(np.cumsum(num_used) - num_used, num_used)] = flat_ids
    q_lens_a = np.array(q_lens, dtype=np.int32)                                        # [seqs]
    computed_a = np.array(computed, dtype=np.int32)                                    # [seqs]
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(q_lens_a, out=cu_seqlens_q[1:])
    num_tokens = len(input_ids)
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens_a)                            # [tokens]
    positions = (np.arange(num_tokens, dtype=np.int32) - cu_seqlens_q[seq_of_token]
                 + computed_a[seq_of_token])                                           # [tokens] int32
    slots = (block_tables[seq_of_token, positions // block_size] * block_size
             + positions % block_size)                                                 # [tokens] int32
    if num_pad:
        slots[len(batch):] = -1
    last_token = cu_seqlens_q[1:] - 1                                                  # [seqs]
    sampling_seqs, row_drafts = [item.state for item, s in zip(batch, sampling) if s], ()
    if rows is not None:
        logits_indices = last_token                                           # decode buckets sample every row
    elif any(item.draft_token_ids for item in batch):
        logits_indices, sampling_seqs, row_drafts = _speculative_rows(batch, last_token)
    else:
        logits_indices = last_token[np.array(sampling, dtype=bool)]
    shape = PackedShape(num_tokens, num_seqs, len(logits_indices), width)
    packed = np.concatenate([np.array(input_ids, dtype=np.int32), positions, slots, computed_a + q_lens_a,
                             cu_seqlens_q, logits_indices, block_tables.reshape(-1),
                             np.array(state_slots, dtype=np.int32)]).astype(np.int32, copy=False)
    host = torch.from_numpy(packed)                                           # [shape.size] int32
    if pin_memory:
        host = torch.empty(shape.size, dtype=torch.int32, pin_memory=True).copy_(host)
    kept = None if rows is not None else kept_seqs(logits_indices, cu_seqlens_q)
    return HostBatch(host, shape, max(q_lens), sampling_seqs, len(batch), row_drafts, kept)


def build_decode_host_batch(states: list[SequenceState], tables: np.ndarray, block_size: int,
                            pin_memory: bool = False, rows: int | None = None,
                            width: int | None = None) -> HostBatch:
    """``build_host_batch`` of a step whose every row decodes its last known token and samples it (the
    mirror's decode rows), from the mirror's persistent block-table matrix ``tables [table rows, columns]``
    (``SequenceState.row``): the same packed tensor, from a few gathers instead of a walk over every
    token slice and block table. ``rows``/``width`` pad as there."""
    n = len(states)
    if not n and rows is None:
        raise ValueError("states: at least one decoding sequence is required")
    num_rows = n if rows is None else rows
    if num_rows < n:
        raise ValueError(f"rows: padding to {rows} rows needs at most {rows} sequences, got {n}")
    computed = np.zeros(num_rows, dtype=np.int32)                                   # [rows] = positions
    computed[:n] = np.fromiter(map(_COMPUTED, states), dtype=np.int32, count=n)
    num_used = np.zeros(num_rows, dtype=np.int64)                                   # [rows]
    num_used[:n] = np.fromiter(map(len, map(_BLOCKS, states)), dtype=np.int64, count=n)
    needed = int(num_used.max()) if num_rows else 0
    if width is not None and needed > width:
        raise ValueError(f"width: {width} block-table columns, but a sequence uses {needed} blocks")
    if width is None:
        width = max(needed, 1 if num_rows > n else 0)
    table_rows = np.fromiter(map(_ROW, states), dtype=np.intp, count=n)
    block_tables = np.zeros((num_rows, width), dtype=np.int32)                      # [rows, width]
    used = min(width, tables.shape[1])
    block_tables[:n, :used] = tables[table_rows, :used]
    block_tables[np.arange(width) >= num_used[:, None]] = 0       # entries past a table are stale in ``tables``
    input_ids = np.zeros(num_rows, dtype=np.int32)                                  # [rows]
    input_ids[:n] = np.fromiter(map(_LAST, map(_OUTPUT, states)), dtype=np.int32, count=n)
    row = np.arange(num_rows, dtype=np.int32)
    slots = block_tables[row, computed // block_size] * block_size + computed % block_size   # [rows]
    slots[n:] = -1
    state_slots = np.full(num_rows, -1, dtype=np.int32)                            # [rows]; padding: -1
    state_slots[:n] = np.fromiter(map(_STATE_SLOT, states), dtype=np.int32, count=n)
    shape = PackedShape(num_rows, num_rows, num_rows, width)
    packed = np.concatenate([input_ids, computed, slots, computed + 1, np.arange(num_rows + 1, dtype=np.int32),
                             row, block_tables.reshape(-1), state_slots]).astype(np.int32, copy=False)
    host = torch.from_numpy(packed)                                                 # [shape.size] int32
    if pin_memory:
        host = torch.empty(shape.size, dtype=torch.int32, pin_memory=True).copy_(host)
    return HostBatch(host, shape, 1, list(states), n)


_COMPUTED = operator.attrgetter("num_computed_tokens")
_BLOCKS = operator.attrgetter("block_ids")
_ROW = operator.attrgetter("row")
_OUTPUT = operator.attrgetter("output_token_ids")
_LAST = operator.itemgetter(-1)
_STATE_SLOT = operator.attrgetter("state_slot")


def _speculative_rows(batch: list[BatchedSequence], last_token: np.ndarray):
    """(logits indices [rows], the sequence of each row, the drafts before each row's position) for a
    batch where some sampling sequence has drafts: k drafts give k + 1 rows, its last k + 1 tokens."""
    indices, seqs, drafts = [], [], []
    for item, last in zip(batch, last_token.tolist()):
        if not item.samples:
            continue
        k = len(item.draft_token_ids)
        indices += range(last - k, last + 1)
        seqs += [item.state] * (k + 1)
        drafts += [item.draft_token_ids[:i] for i in range(k + 1)]
    return np.array(indices, dtype=np.int32), seqs, tuple(drafts)


def build_batch(batch: list[BatchedSequence], block_size: int, device: torch.device) -> BatchInputs:
    """``build_host_batch`` then ``to_device`` (callers without a metadata check of their own)."""
    host = build_host_batch(batch, block_size, pin_memory=device.type == "cuda")
    return host.to_device(device)
