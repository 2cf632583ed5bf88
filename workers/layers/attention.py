"""Paged attention over this rank's KV shard, through ``pagedray.kernels`` only.

Per layer and step: write the new K/V of the scheduled tokens into their cache slots, then attend every
query over its sequence's cached history plus itself (``kernels.store_kv_and_attend``: ``store_kv`` then
``paged_attention``, which picks the decode or prefill kernel; a CPU decode step does both in one C
call), within the model's
sliding window when it has one (Mistral). The kernels are looked up
on the module at call time (``kernels.paged_attention``), never copied into this package.

``AttentionMetadata`` is built once per step by the input builder and passed down the forward
explicitly (there is no global batch context). The runner checks it once per step
(``kernels.check_step_metadata``), so the per-layer calls pass ``validate_values=False``: the value
checks read tensor contents (a device sync each, 60 calls a step); the structural checks of q/k/v
still run on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedray.kernels.kv_quant import static_scale
from torch import nn

from ... import kernels
from ..kv_cache import KVLayer


@dataclass(frozen=True)
class AttentionMetadata:
    """Shared by every layer of one step; checked once per step by ``ModelRunner.prepare``."""

    slot_mapping: torch.Tensor    # [tokens] int32 (int64 accepted): cache slot of each scheduled token
    cu_seqlens_q: torch.Tensor    # [seqs + 1] int32: query token offsets per sequence
    seq_lens_k: torch.Tensor      # [seqs] int32: history + scheduled tokens per sequence
    block_tables: torch.Tensor    # [seqs, max_blocks] int32 (padded with 0)
    max_query_len: int
    state_slots: torch.Tensor | None = None   # [seqs] int32: hybrid models' state slot per sequence (-1: none)
    state_snapshots: tuple = ()   # hybrid models: (seat, position, snapshot slot) taken during this forward (wire.py)


@dataclass(frozen=True)
class LastLayerRows:
    """The rows the last decoder layer finishes when only the sampling rows' hidden states are wanted.

    Every token's key and value are still written into the cache; only the sampling rows' queries are
    attended, and only their rows go through ``o_proj``, the MLP and the final norm. Each sequence's kept
    rows are the last ones of its chunk (its last token, then its drafts'), so attending them is the same
    causal varlen call over fewer queries. Built on the host by ``runner.input_batch.kept_seqs``.
    """

    rows: torch.Tensor            # [kept] int32: the kept token rows (= logits_indices), ascending
    seqs: torch.Tensor            # [kept seqs] int32: the sequences holding them, in batch order
    cu_seqlens_q: torch.Tensor    # [kept seqs + 1] int32: kept rows per such sequence, cumulated
    max_query_len: int            # the most kept rows of one sequence (1 unless drafts are verified)


class PagedAttention(nn.Module):
    """q [tokens, heads_local, head_dim], k/v [tokens, kv_heads_local, head_dim] -> [tokens, heads_local, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window   # None: full causal attention
        self.logit_softcap = logit_softcap     # Gemma 2: scores soft-capped (kernels.paged_decode)
        self.checkpoint_kv_scales: tuple[float, float] | None = None   # (k, v) for a float8 cache (load_kv_scales)
        self.sinks: torch.Tensor | None = None   # gpt-oss: float32 [num_heads] sink logits (kernels.paged_decode)

    def load_kv_scales(self, reader, prefix: str) -> None:
        """A checkpoint calibrated for an FP8 KV cache: ``{prefix}.k_scale`` and ``.v_scale`` (or one
        ``.kv_scale`` for both), one value each, kept as ``kv_quant.static_scale`` rounds them; a float8 cache
        then stores this layer's rows with them (``kernels.kv_quant``). Absent: rows take their own scales."""
        names = [f"{prefix}.k_scale", f"{prefix}.v_scale"]
        if not all(reader.has(name) for name in names):
            names = [f"{prefix}.kv_scale"] * 2
            if not reader.has(names[0]):
                return
        values = []
        for name in names:
            value = reader.read(name).float().reshape(-1)
            if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
                raise ValueError(f"model: KV scale {name!r} must be one positive finite value, got "
                                 f"{value[:4].tolist()}")
            values.append(static_scale(float(value)))
        self.checkpoint_kv_scales = (values[0], values[1])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: KVLayer,
                meta: AttentionMetadata, keep: LastLayerRows | None = None) -> torch.Tensor:
        # kv_layer.k / .v [num_blocks, block_size, kv_heads_local, head_dim] (+ row scales when 8-bit)
        # keep: every k / v row is stored, only keep.rows of q attend -> [kept, heads_local, head_dim]
        static = self.checkpoint_kv_scales if kv_layer.k.dtype == torch.float8_e4m3fn else None
        if keep is not None:
            kernels.store_kv(k, v, kv_layer.k, kv_layer.v, meta.slot_mapping, validate_values=False,
                             k_scale=kv_layer.k_scale, v_scale=kv_layer.v_scale, static_scales=static)
            if keep.rows.shape[0] == 0:
                return q.new_empty((0,) + tuple(q.shape[1:]))
            return kernels.paged_attention(q.index_select(0, keep.rows), kv_layer.k, kv_layer.v, keep.cu_seqlens_q,
                                           meta.seq_lens_k.index_select(0, keep.seqs),
                                           meta.block_tables.index_select(0, keep.seqs), self.scale,
                                           max_query_len=keep.max_query_len, sliding_window=self.sliding_window,
                                           validate_values=False, logit_softcap=self.logit_softcap,
                                           k_scale=kv_layer.k_scale, v_scale=kv_layer.v_scale, sinks=self.sinks)
        return kernels.store_kv_and_attend(q, k, v, kv_layer.k, kv_layer.v, meta.slot_mapping, meta.cu_seqlens_q,
                                           meta.seq_lens_k, meta.block_tables, self.scale,
                                           max_query_len=meta.max_query_len, sliding_window=self.sliding_window,
                                           validate_values=False, logit_softcap=self.logit_softcap,
                                           k_scale=kv_layer.k_scale, v_scale=kv_layer.v_scale, static_scales=static,
                                           sinks=self.sinks)
