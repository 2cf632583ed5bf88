"""Gated DeltaNet: the linear-attention layer of Qwen3.5 / 3.6 (three of every four layers).

Per token: ``in_proj_qkv`` -> a depthwise causal convolution over the last ``K`` tokens (``conv1d``, kernel
``K``, no bias) and SiLU -> q, k [Hk, Dk] and v [Hv, Dv]; ``in_proj_z`` (the output gate), ``in_proj_b``
(``beta = sigmoid(b)``) and ``in_proj_a`` (``g = -exp(A_log) * softplus(a + dt_bias)``, a log decay) per value
head; q and k repeated to the Hv value heads; the gated delta rule (``kernels.gated_delta``) from the
sequence's recurrent state; a per-head RMSNorm of the result times ``silu(z)`` (``RMSNormGated``: plain weight,
normalised in float32); ``out_proj``.

State, per sequence (``LinearStates``: one slot of the pool the block manager hands out, ``StateStep``
says which): the convolution's last ``K - 1`` inputs [C, K - 1] (the layer's dtype) and the recurrent
state [Hv, Dk, Dv] (float32). A sequence whose step starts at position 0 starts from zeros (a fresh or a
recomputed sequence: whatever its slot held before is ignored), so nothing has to clear a slot when it is
handed out; every other step continues from what the slot holds, which the sequence's own previous step wrote
(chunked prefill), its parent's state copied in at a fork, or a prefix-cache snapshot copied in at a hit
(``copy``). A step may also copy the state a sequence reaches partway through its tokens to a snapshot slot
(``StateStep`` cuts: the prefix cache's snapshots, block_manager/state_pool.py).

Steps: a decode-only step (one token per sequence) runs every sequence at once: the states by slot (in
place when the slots are a range, else a gather and a scatter back), one convolution window and one recurrence
step (no host syncs on CUDA). Otherwise each sequence's tokens run alone (its chunk through the chunked rule),
in batch order. On CUDA the delta rule of any step is one Triton launch over every sequence
(``kernels.gated_delta_varlen``, ``use_triton``), its states updated in the pool in place: the chunked kernel
when the step has prompt tokens (``spans`` set), the recurrent one for a decode-only step.

Tensor parallelism: rank r holds key heads ``[r Hk/tp, (r+1) Hk/tp)`` and value heads ``[r Hv/tp, ...)`` (the
value heads of its key heads: Hv is a multiple of Hk), their rows of ``in_proj_qkv`` (q, k and v segments),
of ``conv1d``, of ``in_proj_z/b/a``, ``A_log`` and ``dt_bias``, and their columns of ``out_proj`` (one
all-reduce). Its state slots hold only its heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import fused_triton_path
from ...kernels.gated_delta import gated_delta_decode, gated_delta_prefill, gated_delta_spans, gated_delta_varlen
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import ColumnParallelLinear, RowParallelLinear, Segment, empty_param
from .partition import check_even_split


@dataclass(frozen=True)
class LinearDims:
    key_heads: int
    value_heads: int
    key_dim: int          # per head
    value_dim: int        # per head
    conv_kernel: int
    eps: float

    @classmethod
    def from_hf(cls, cfg) -> LinearDims:
        dims = cls(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        if dims.value_heads % dims.key_heads:
            raise ValueError(f"model: linear_num_value_heads={dims.value_heads} is not a multiple of "
                             f"linear_num_key_heads={dims.key_heads}")
        if dims.conv_kernel < 1:
            raise ValueError(f"model: linear_conv_kernel_dim must be >= 1, got {dims.conv_kernel}")
        return dims

    def check_split(self, tp_size: int) -> None:
        check_even_split(self.key_heads, tp_size, "linear_num_key_heads")


@dataclass(frozen=True)
class StateStep:
    """Which state slot each sequence of a step uses. ``slots`` [seqs] int64 (the scratch slot for padding
    rows); ``fresh`` [seqs] bool: the sequence's first token this step is position 0; ``spans``: per sequence
    (first token, end token, slot, fresh, cuts) on the host, or None for a decode-only step (then token i is
    sequence i's); ``cuts``: ((offset, snapshot slot), ...), ascending: the state after the sequence's first
    ``offset`` tokens of the step is copied to that slot (a prefix-cache snapshot: StepPlan.state_snapshots).
    A decode-only step may also know on the host that ``slot_range`` ``(first, end)`` are its slots in order
    (the states are then read and written in place, no gather) and whether ``any_fresh`` (None: not known, as on
    CUDA, where reading it would sync)."""

    slots: torch.Tensor
    fresh: torch.Tensor
    spans: list[tuple[int, int, int, bool, tuple[tuple[int, int], ...]]] | None
    slot_range: tuple[int, int] | None = None
    any_fresh: bool | None = None
    cu_seqlens: torch.Tensor | None = None    # [seqs + 1] int32: each sequence's tokens (the Triton path's)
    after: tuple[tuple[int, int], ...] = ()   # a decode step's (seat, snapshot slot) copies after the forward

    @property
    def has_cuts(self) -> bool:
        return self.spans is not None and any(span[4] for span in self.spans)

    def states(self, pool: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A decode step's rows of ``pool`` [slots + 1, ...] -> (their states, a view of ``pool`` or a gathered
        copy to write back), fresh rows zeroed."""
        if self.slot_range is not None:
            rows, view = pool[self.slot_range[0]:self.slot_range[1]], True
        else:
            rows, view = pool.index_select(0, self.slots), False
        if self.any_fresh is None:
            rows.mul_(~self.fresh.reshape(-1, *([1] * (rows.dim() - 1))))
        elif self.any_fresh:
            rows[self.fresh] = 0
        return rows, view

    def write_back(self, pool: torch.Tensor, rows: torch.Tensor, view: bool) -> None:
        if not view:
            pool.index_copy_(0, self.slots, rows)


class LinearStates:
    """One layer's state pool: ``conv`` [slots + 1, C_local, K - 1] and ``recurrent`` [slots + 1, Hv_local, Dk, Dv]
    float32; the last slot is scratch (padding rows write there)."""

    def __init__(self, num_slots: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
                 dtype, device) -> None:
        self.conv = torch.zeros((num_slots + 1, channels, kernel - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_slots + 1, heads, key_dim, value_dim), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) slots, in order: dst takes src's state (a fork: the child continues from its parent)."""
        for src, dst in pairs:
            self.conv[dst] = self.conv[src]
            self.recurrent[dst] = self.recurrent[src]


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, dims: LinearDims, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.dims, self.tp = dims, tp
        kh = check_even_split(dims.key_heads, tp.world_size, "linear_num_key_heads")
        vh = dims.value_heads // tp.world_size
        self.key_heads, self.value_heads = kh, vh
        key_total, value_total = dims.key_heads * dims.key_dim, dims.value_heads * dims.value_dim
        k_seg = Segment(key_total, tp.rank * kh * dims.key_dim, kh * dims.key_dim)
        v_seg = Segment(value_total, tp.rank * vh * dims.value_dim, vh * dims.value_dim)
        self.segments = (k_seg, k_seg, v_seg)                          # q, k, v rows of in_proj_qkv and conv1d
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, list(self.segments), False, dtype, device)
        heads = Segment(dims.value_heads, tp.rank * vh, vh)
        self.in_proj_zba = ColumnParallelLinear(hidden_size, [v_seg, heads, heads], False, dtype, device)
        self.channels = 2 * kh * dims.key_dim + vh * dims.value_dim
        self.conv_weight = empty_param((self.channels, dims.conv_kernel), dtype, device)     # [C_local, K]
        self.a_log = empty_param((vh,), dtype, device)
        self.dt_bias = empty_param((vh,), dtype, device)
        self.norm_weight = empty_param((dims.value_dim,), dtype, device)
        self.out_proj = RowParallelLinear(value_total, hidden_size, False, tp, dtype, device,
                                          name="linear_num_value_heads * linear_value_head_dim")
        self.states: LinearStates | None = None      # allocate_states
        # the delta rule in one Triton launch per step (kernels.gated_delta_varlen) on CUDA; the torch paths on CPU
        self.use_triton = fused_triton_path(device)

    def allocate_states(self, num_slots: int) -> LinearStates:
        d = self.dims
        self.states = LinearStates(num_slots, self.channels, d.conv_kernel, self.value_heads, d.key_dim, d.value_dim,
                                   self.conv_weight.dtype, self.conv_weight.device)
        return self.states

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.in_proj_qkv.load_fused(reader, f"{prefix}.in_proj_qkv")
        self.in_proj_zba.load(reader, [f"{prefix}.in_proj_z", f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"])
        name, full = f"{prefix}.conv1d.weight", sum(s.full_rows for s in self.segments)
        rows, base = [], 0
        for seg in self.segments:
            rows.append(reader.read(name, 0, base + seg.start, base + seg.start + seg.rows,
                                    expect_shape=[full, 1, self.dims.conv_kernel])[:, 0])
            base += seg.full_rows
        copy_into(self.conv_weight, torch.cat(rows), name)
        start = self.tp.rank * self.value_heads
        for param, leaf in ((self.a_log, "A_log"), (self.dt_bias, "dt_bias")):
            name = f"{prefix}.{leaf}"
            copy_into(param, reader.read(name, 0, start, start + self.value_heads,
                                         expect_shape=[self.dims.value_heads]), name)
        copy_into(self.norm_weight, reader.read(f"{prefix}.norm.weight", expect_shape=[self.dims.value_dim]),
                  f"{prefix}.norm.weight")
        self.out_proj.load(reader, f"{prefix}.out_proj")

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        tokens, d = x.shape[0], self.dims
        mixed = self._convolve(self.in_proj_qkv(x), step)                                 # [T, C_local]
        kd, vd = self.key_heads * d.key_dim, self.value_heads * d.value_dim
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        repeat = self.value_heads // self.key_heads
        q = q.reshape(tokens, self.key_heads, d.key_dim).repeat_interleave(repeat, dim=1)     # [T, Hv, Dk]
        k = k.reshape(tokens, self.key_heads, d.key_dim).repeat_interleave(repeat, dim=1)
        v = v.reshape(tokens, self.value_heads, d.value_dim)                                  # [T, Hv, Dv]
        z, b, a = self.in_proj_zba(x).split([vd, self.value_heads, self.value_heads], dim=-1)
        beta = b.sigmoid().float()                                                            # [T, Hv]
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self._delta_rule(q, k, v, g, beta, step).to(x.dtype)                         # [T, Hv, Dv]
        return self.out_proj(self._gated_norm(core, z.reshape(tokens, self.value_heads, d.value_dim))
                             .reshape(tokens, vd))

    def _convolve(self, qkv: torch.Tensor, step: StateStep) -> torch.Tensor:
        # qkv [T, C] -> silu(causal depthwise conv) [T, C]; each sequence's last K - 1 inputs kept in its slot
        conv, weight = self.states.conv, self.conv_weight[:, None, :]                      # [C, 1, K]
        if step.spans is None:
            past, view = step.states(conv)                                                  # [B, C, K - 1]
            window = torch.cat([past, qkv[:, :, None]], -1)                                 # [B, C, K]
            past.copy_(window[:, :, 1:])
            step.write_back(conv, past, view)
            return F.silu((window * self.conv_weight).sum(-1))   # one window: a product and a sum, not conv1d
        out = torch.empty_like(qkv)
        window = conv.shape[2]
        for start, end, slot, fresh, cuts in step.spans:
            past = torch.zeros_like(conv[slot]) if fresh else conv[slot]                    # [C, K - 1]
            seq = torch.cat([past, qkv[start:end].t()], -1)                                 # [C, K - 1 + n]
            for offset, target in cuts:                      # the last K - 1 inputs after ``offset`` tokens
                conv[target] = seq[:, offset:offset + window]
            conv[slot] = seq[:, seq.shape[1] - window:]
            out[start:end] = F.silu(F.conv1d(seq[None], weight, groups=self.channels)[0].t())
        return out

    def _delta_rule(self, q, k, v, g, beta, step: StateStep) -> torch.Tensor:
        recurrent = self.states.recurrent
        if step.has_cuts:           # prefix-cache snapshots inside a sequence's tokens: in phases between them
            return gated_delta_spans(q, k, v, g, beta, recurrent, step.spans, use_triton=self.use_triton)
        if self.use_triton:
            return gated_delta_varlen(q, k, v, g, beta, recurrent, step.slots, step.cu_seqlens, step.fresh,
                                      use_triton=True, chunked=step.spans is not None)
        if step.spans is None:
            states, view = step.states(recurrent)                                           # [B, Hv, Dk, Dv]
            out = gated_delta_decode(q, k, v, g, beta, states)
            step.write_back(recurrent, states, view)
            return out
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for start, end, slot, fresh, _ in step.spans:
            state = recurrent[slot]                                                         # a view: updated in place
            if fresh:
                state.zero_()
            out[start:end] = gated_delta_prefill(q[start:end], k[start:end], v[start:end], g[start:end],
                                                 beta[start:end], state)
        return out

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # core, z [T, Hv, Dv] -> weight * rmsnorm(core) * silu(z), normalised in float32
        h = core.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.dims.eps)
        return ((self.norm_weight * h.to(core.dtype)) * F.silu(z.float())).to(core.dtype)
