"""Column- and row-parallel linear layers.

- ``ColumnParallelLinear``: the output features are split across ranks; no communication. Its
  output is a list of *segments*, each a row range of one checkpoint tensor, so the same class
  serves a plain column split, the merged gate/up projection and the merged QKV projection
  (whose K/V segments may be replicated across ranks, see ``partition.py``).
- ``RowParallelLinear``: the input features are split across ranks; each rank computes a partial
  product and one all-reduce sums them (the bias is added once, after the reduction).

Weights follow torch's ``[out_features, in_features]`` convention, as in HF checkpoints. On CPU in
fp32/bf16 each layer may also hold packed copies of its weight and the product each row count runs
(``packed_weight``, a ``packed_gemm.PackedLinear`` set by ``packed_gemm.pack_linear_weights``). A
quantized checkpoint's weights on CUDA stay packed (``quant``: one ``PackedIntWeight`` per segment,
``workers.quantization``): the dense ``weight`` is then never allocated and the products run
``kernels.quant_gemm``, one per segment.

A layer's dense ``weight`` is a meta tensor until ``load`` (``allocate_dense``): it is allocated on the
layer's device only when the checkpoint gives it dense, so a packed model never holds, even briefly, the
16-bit copy of its linear weights that it exists to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..tp_group import TPGroup
from ..weights.quantization import PackedIntWeight
from ..weights.weight_loader import CheckpointReader, copy_into
from .activation import silu_and_mul
from .packed_gemm import PackedLinear, linear, linear_silu_mul
from .partition import HeadPartition, check_even_split


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def allocate_dense(layer: nn.Module) -> None:
    """Replace the layer's meta ``weight`` with real storage on ``layer.device`` (once)."""
    if layer.weight.is_meta:
        layer.weight = empty_param(tuple(layer.weight.shape), layer.weight.dtype, layer.device)


class LinearDelta(Protocol):
    """Adds a per-token low-rank product to a layer's output (``workers/lora/slots.LoraLinearSlots``)."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, start + rows)`` of a checkpoint tensor with ``full_rows`` output rows."""

    full_rows: int
    start: int
    rows: int


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, segments: list[Segment], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_size = input_size
        self.segments = list(segments)
        out_local = sum(s.rows for s in self.segments)
        self.device = device
        self.weight = empty_param((out_local, input_size), dtype, torch.device("meta"))   # [out_local, in]
        self.bias = empty_param((out_local,), dtype, device) if bias else None       # [out_local]
        self.packed_weight: PackedLinear | None = None
        self.quant: list[PackedIntWeight] | None = None
        self.lora: LinearDelta | None = None      # LoRA slots (workers/lora), added to the output when set
        # a merged [gate; up] projection that SiLU * up follows (DecoderMLP sets it): ``forward_silu_and_mul`` may
        # fuse the two, and the CPU plan times this layer's products with the activation (``gemm_timing``)
        self.silu_after = False

    @classmethod
    def split(cls, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype, device,
              name: str = "output_size") -> ColumnParallelLinear:
        rows = check_even_split(output_size, tp.world_size, name)
        return cls(input_size, [Segment(output_size, tp.rank * rows, rows)], bias, dtype, device)

    @classmethod
    def replicated(cls, input_size: int, output_size: int, bias: bool, dtype, device) -> ColumnParallelLinear:
        """Every rank holds the whole weight (small projections not worth a collective)."""
        return cls(input_size, [Segment(output_size, 0, output_size)], bias, dtype, device)

    @classmethod
    def merged(cls, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup, dtype, device,
               name: str = "intermediate_size") -> ColumnParallelLinear:
        segments = []
        for size in output_sizes:
            rows = check_even_split(size, tp.world_size, name)
            segments.append(Segment(size, tp.rank * rows, rows))
        return cls(input_size, segments, bias, dtype, device)

    @classmethod
    def qkv(cls, hidden_size: int, head_dim: int, heads: HeadPartition, bias: bool,
            dtype, device) -> ColumnParallelLinear:
        q = Segment(heads.num_heads * head_dim, heads.first_head * head_dim, heads.num_local_heads * head_dim)
        kv_rows = heads.num_local_kv_heads * head_dim
        kv = Segment(heads.num_kv_heads * head_dim, heads.first_kv_head * head_dim, kv_rows)
        return cls(hidden_size, [q, kv, kv], bias, dtype, device)

    @property
    def output_sizes(self) -> list[int]:
        return [s.rows for s in self.segments]

    def load(self, reader: CheckpointReader, prefixes: list[str]) -> None:
        """prefixes[i] names the checkpoint module of segment i (``{prefix}.weight`` / ``.bias``)."""
        if len(prefixes) != len(self.segments):
            raise ValueError(f"prefixes: expected {len(self.segments)} names, got {len(prefixes)}")
        parts = [reader.read_packed(f"{prefix}.weight", 0, seg.start, seg.start + seg.rows,
                                    [seg.full_rows, self.input_size]) for seg, prefix in zip(self.segments, prefixes)]
        self._keep_packed(parts)
        offset = 0
        for seg, prefix in zip(self.segments, prefixes):
            rows = slice(offset, offset + seg.rows)
            name = f"{prefix}.weight"
            if self.quant is None:
                value = reader.read(name, 0, seg.start, seg.start + seg.rows,
                                    expect_shape=[seg.full_rows, self.input_size])
                copy_into(self.weight[rows], value, name)
            if self.bias is not None:
                name = f"{prefix}.bias"
                value = reader.read(name, 0, seg.start, seg.start + seg.rows, expect_shape=[seg.full_rows])
                copy_into(self.bias[rows], value, name)
            offset += seg.rows

    def load_fused(self, reader: CheckpointReader, prefix: str) -> None:
        """The segments from one checkpoint tensor that holds them one after another along its rows (Phi-3's
        ``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]): segment i's rows start after the full
        rows of segments 0..i-1."""
        full = sum(seg.full_rows for seg in self.segments)
        bases = [sum(s.full_rows for s in self.segments[:i]) for i in range(len(self.segments))]
        self._keep_packed([reader.read_packed(f"{prefix}.weight", 0, base + seg.start, base + seg.start + seg.rows,
                                              [full, self.input_size]) for seg, base in zip(self.segments, bases)])
        offset, base = 0, 0
        for seg in self.segments:
            rows = slice(offset, offset + seg.rows)
            start, end = base + seg.start, base + seg.start + seg.rows
            name = f"{prefix}.weight"
            if self.quant is None:
                copy_into(self.weight[rows], reader.read(name, 0, start, end, expect_shape=[full, self.input_size]),
                          name)
            if self.bias is not None:
                name = f"{prefix}.bias"
                copy_into(self.bias[rows], reader.read(name, 0, start, end, expect_shape=[full]), name)
            offset += seg.rows
            base += seg.full_rows

    def _keep_packed(self, parts: list[PackedIntWeight | None]) -> None:
        """Hold the segments packed (the dense weight never allocated) when the reader gave every one packed;
        else allocate the dense weight the load then fills."""
        if parts and all(part is not None for part in parts):
            self.quant = [part.grouped().to(self.device) for part in parts]
            self.weight = None
        else:
            allocate_dense(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [tokens, in] -> [tokens, out_local]
        if self.quant is None:
            y = linear(x, self.weight, self.bias, self.packed_weight)
        else:
            y = torch.cat([part.matmul(x) for part in self.quant], -1)
            y = y if self.bias is None else y + self.bias
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this merged gate/up projection: x [tokens, in] -> [tokens, out_local / 2]. One C pass
        where the CPU plan runs the C GEMM at this row count (``packed_gemm.linear_silu_mul``: the same bits), else
        the product then ``silu_and_mul``."""
        fused = None if self.quant is not None or self.lora is not None else linear_silu_mul(
            x, self.bias, self.packed_weight)
        return silu_and_mul(self(x)) if fused is None else fused


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype, device,
                 name: str = "input_size") -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.cols = check_even_split(input_size, tp.world_size, name)
        self.device = device
        self.weight = empty_param((output_size, self.cols), dtype, torch.device("meta"))   # [out, in_local]
        self.bias = empty_param((output_size,), dtype, device) if bias else None    # [out]
        self.packed_weight: PackedLinear | None = None
        self.quant: PackedIntWeight | None = None
        self.lora: LinearDelta | None = None      # LoRA slots: their partial product joins the all-reduce

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        start = self.tp.rank * self.cols
        name = f"{prefix}.weight"
        packed = reader.read_packed(name, 1, start, start + self.cols, [self.output_size, self.input_size])
        if packed is not None:
            self.quant, self.weight = packed.grouped().to(self.device), None
        else:
            allocate_dense(self)
            value = reader.read(name, 1, start, start + self.cols, expect_shape=[self.output_size, self.input_size])
            copy_into(self.weight, value, name)
        if self.bias is not None:
            name = f"{prefix}.bias"
            copy_into(self.bias, reader.read(name, expect_shape=[self.output_size]), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [tokens, in_local] -> partial [tokens, out] -> all-reduce over ranks -> [tokens, out]
        if self.quant is None:
            y = linear(x, self.weight, None, self.packed_weight)
        else:
            y = self.quant.matmul(x)
        if self.lora is not None:
            self.lora.add_delta(x, y)
        self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
