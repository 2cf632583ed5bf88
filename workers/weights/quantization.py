"""Quantized weights: GPTQ / AWQ 4- and 8-bit checkpoints, FP8 checkpoints, and int8 / fp8 computed at load.

Every path ends in the same place: ``CheckpointReader.read`` returns a linear layer's weight slice
already **dequantized** (float32), so the parallel layers load it like any full-precision weight and TP
slices it along the same dimensions (a column-parallel layer reads output rows, a row-parallel one
input columns; the packed tensors are sliced or read whole as their packing allows). That is the
"exact reference" of each format: the model computes with exactly the dequantized weights, and the
tests compare it with transformers running on those weights. What it does not give yet: the memory of
the quantized form (weights sit in the compute dtype after loading) and a dequantize-in-the-GEMM kernel.

Formats (``quantization_config.quant_method`` in config.json, or the ``quantization`` option):

* ``gptq`` (AutoGPTQ / GPTQModel, bits 4 or 8): ``qweight`` int32 ``[in / (32 / bits), out]`` (packed
  along the input: value k of a word is input row ``word * per_word + k``, lowest bits first),
  ``qzeros`` int32 ``[groups, out / per_word]`` (packed along the output; the ``gptq`` checkpoint format
  stores zero - 1, ``gptq_v2`` the zero), ``scales`` ``[groups, out]``, ``g_idx`` int32 ``[in]`` (input row
  -> group; absent: ``row // group_size``; with ``desc_act`` a permutation's groups). weight[o, i] =
  scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i].
* ``awq`` (AutoAWQ GEMM, 4 bits): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``
  packed along the output in AWQ's interleaved order (nibble k holds column ``8 word + AWQ_ORDER[k]``),
  ``scales`` ``[groups, out]``; weight[o, i] = scales[i // g, o] * (q[i, o] - zero[i // g, o]).
* ``fp8`` (FP8 checkpoints, and ``compressed-tensors`` ones whose weights are float 8-bit, as llm-compressor
  writes them): ``weight`` float8_e4m3fn ``[out, in]`` with ``weight_scale`` (one value or one per output
  row) or ``weight_scale_inv`` per ``weight_block_size`` block; weight = fp8 value x scale.
* ``mxfp4`` (gpt-oss): only the experts are quantized, ``{name}_blocks`` uint8 ``[E, rows, cols / 32, 16]``
  (two FP4 e2m1 codes a byte, the low nibble first) and ``{name}_scales`` uint8 ``[E, rows, cols / 32]`` (an
  E8M0 exponent biased by 127 per 32 values): value = FP4 code's value x 2^(scale - 127). Dequantized at load
  on CPU (``dequantize_mxfp4``, to the layout transformers' dequantizer gives: ``[E, cols, rows]``); on CUDA kept
  in 4 bits, the codes and scales repacked for the packed MoE kernel (``mxfp4_to_packed_rows``).
* ``int8`` / ``fp8`` as the ``quantization`` option on a full-precision checkpoint: every linear weight of
  the decoder layers (not the embeddings, the LM head, the norms or a MoE router) rounded to 8 bits with
  one scale per output row (max |row| / 127 or / 448, symmetric), computed from the whole row so that
  every TP split gives the same numbers.

On CUDA every format stays packed instead (``keeps_packed``): ``CheckpointReader.read_packed`` hands each
linear layer its slice as a ``PackedIntWeight`` in GPTQ's layout (AWQ repacked, int8 codes offset by 128
with zero point 128, FP8 values as their e4m3 bytes with ``float8`` set: per-row scales as one group,
block scales as groups of the block's input columns), and the layer multiplies with ``kernels.quant_gemm``
(the Triton GEMM that dequantizes tile by tile). The values are the dequantized path's; the memory is 4 or
8 bits a weight. FP8 is weight-only: activations stay in the compute dtype (no FP8 tensor-core GEMM, which
would round them to 8 bits too). On CPU every format is dequantized at load (a dequantizing GEMM there
would be slower than the dense one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from pagedray.kernels.quant_gemm import E2M1_VALUES, group_rows, pack_rows, unpack_along_cols

from ... import kernels

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)                     # nibble k of an AWQ word holds column 8 w + AWQ_ORDER[k]
_LAYER_LINEAR = re.compile(r"\.layers\.\d+\..*\.weight$")


@dataclass(frozen=True)
class WeightQuantization:
    method: str = "none"
    bits: int = 16
    group_size: int = -1                 # -1: one group over all input rows
    zeros_minus_one: bool = False        # GPTQ's original checkpoint format stores zero - 1
    block: tuple[int, int] | None = None  # fp8 checkpoints with block-wise scales: (rows, cols)
    online: bool = False                 # int8 / fp8 rounded at load from a full-precision checkpoint

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def resolve(hf_config, option: str) -> WeightQuantization:
    """The quantization of a model from its config.json and the ``quantization`` option (``auto``: what the
    checkpoint says, else none). ValueError naming ``quantization`` for a format not supported or a
    conflict."""
    raw = getattr(hf_config, "quantization_config", None)
    raw = raw if isinstance(raw, dict) or raw is None else raw.to_dict()
    if raw is None:
        if option in ("auto", "none"):
            return WeightQuantization()
        return WeightQuantization(option, bits=8, online=True)
    method = str(raw.get("quant_method", "")).lower()
    if option not in ("auto", method):
        raise ValueError(f"quantization: the checkpoint is already quantized ({method!r}); got {option!r} "
                         "(leave it 'auto')")
    if method == "gptq":
        bits = int(raw.get("bits", 4))
        _check(bits in (4, 8), f"GPTQ with {bits} bits (4 and 8 are)")
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        _check(fmt in ("gptq", "gptq_v2"), f"GPTQ checkpoint_format {fmt!r} (gptq and gptq_v2 are)")
        return WeightQuantization("gptq", bits, int(raw.get("group_size", -1)), zeros_minus_one=fmt == "gptq")
    if method == "awq":
        bits, version = int(raw.get("bits", raw.get("w_bit", 4))), str(raw.get("version", "gemm")).lower()
        _check(bits == 4 and version == "gemm", f"AWQ {bits}-bit version {version!r} (4-bit gemm is)")
        _check(raw.get("zero_point", True), "AWQ without zero points")
        return WeightQuantization("awq", 4, int(raw.get("group_size", raw.get("q_group_size", 128))))
    if method == "fp8":
        block = raw.get("weight_block_size")
        return WeightQuantization("fp8", 8, block=tuple(block) if block else None)
    if method == "compressed-tensors":
        weights = [group.get("weights") or {} for group in (raw.get("config_groups") or {}).values()]
        fp8 = weights and all(w.get("type") == "float" and int(w.get("num_bits", 0)) == 8 for w in weights)
        _check(fp8, f"compressed-tensors format {raw.get('format')!r} other than float 8-bit weights")
        return WeightQuantization("fp8", 8)
    if method == "mxfp4":       # gpt-oss: only the experts are 4-bit (layers/clamped_moe.py reads them)
        return WeightQuantization("mxfp4", 4, 32)
    raise ValueError(f"quantization: the checkpoint's quant_method {method!r} is not supported (gptq, awq, fp8, "
                     "mxfp4 (gpt-oss) and float 8-bit compressed-tensors checkpoints are; or a full-precision "
                     "checkpoint with quantization int8 / fp8)")


def _check(ok, what: str) -> None:
    if not ok:
        raise ValueError(f"quantization: {what} not supported")


@dataclass(frozen=True)
class PackedIntWeight:
    """One linear weight ``[N, K]`` (out, in) as ``kernels.quant_gemm`` takes it: qweight int32 ``[K / per_word,
    N]``, zeros int32 and scales ``[groups, N]``, g_idx int32 ``[K]``; after ``grouped`` also ``perm`` (int32
    ``[K]`` or None: row k multiplies input column ``perm[k]``) and ``group_size`` (> 0: ``g_idx[k] == k //
    group_size``, the kernel's fast path)."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    perm: torch.Tensor | None = None
    group_size: int = 0
    float8: bool = False                 # 8-bit codes that are e4m3 bit patterns (zeros unused)

    def grouped(self) -> PackedIntWeight:
        """The same weight with its rows sorted by group (``kernels.quant_gemm.group_rows``), as layers hold it."""
        qweight, zeros, scales, g_idx, perm, group_size = group_rows(self.qweight, self.zeros, self.scales,
                                                                     self.g_idx, self.bits)
        return replace(self, qweight=qweight, zeros=zeros, scales=scales, g_idx=g_idx, perm=perm,
                       group_size=group_size)

    def to(self, device) -> PackedIntWeight:
        return replace(self, qweight=self.qweight.to(device), zeros=self.zeros.to(device),
                       scales=self.scales.to(device), g_idx=self.g_idx.to(device),
                       perm=None if self.perm is None else self.perm.to(device))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, K] -> x @ W^T [tokens, N] (``kernels.quant_gemm``)."""
        return kernels.quant_gemm(x, self.qweight, self.zeros, self.scales, self.g_idx, self.bits, perm=self.perm,
                                  group_size=self.group_size, float8=self.float8)

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.zeros, self.scales, self.g_idx) + (() if self.perm is None else (self.perm,))
        return sum(t.numel() * t.element_size() for t in tensors)


def keeps_packed(q: WeightQuantization, device: torch.device) -> bool:
    """True when linear weights stay packed on ``device`` (every format on CUDA)."""
    return device.type == "cuda" and q.method in ("gptq", "awq", "int8", "fp8")


def _round_rows(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantization`` int8 / fp8 of a full weight [N, K]: one symmetric scale per output row (max |row| / 127
    or / 448) -> (values [N, K]: integers in [-127, 127] as float32, or float8_e4m3fn; scales float32 [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / (127.0 if method == "int8" else 448.0)).clamp_(min=torch.finfo(torch.float32).tiny)
    if method == "int8":
        return torch.round(w / scale[:, None]).clamp_(-127, 127), scale
    return (w / scale[:, None]).clamp_(-448, 448).to(torch.float8_e4m3fn), scale


def rows_packed(weight: torch.Tensor, method: str) -> PackedIntWeight:
    """``quantization`` int8 / fp8's rounding of a full weight [N, K] kept as codes, one group (the same values
    as ``round_to_8bit``): int8 code = q + 128 with zero point 128; fp8 the e4m3 bytes."""
    values, scale = _round_rows(weight, method)
    n, k = values.shape
    if method == "fp8":
        return fp8_rows(values, scale[None, :], torch.zeros(k, dtype=torch.int32))
    codes = values.to(torch.int64) + 128                                                       # [N, K]
    return PackedIntWeight(pack_rows(codes.t(), 8), torch.full((1, n), 128, dtype=torch.int32), scale[None, :],
                           torch.zeros(k, dtype=torch.int32), 8)


def fp8_rows(weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> PackedIntWeight:
    """float8_e4m3fn weight [N, K] with float scales [groups, N] and g_idx [K] -> its packed form (``float8``)."""
    codes = weight.contiguous().view(torch.uint8).t().to(torch.int32)                         # [K, N]
    scales = scales.float().contiguous()
    return PackedIntWeight(pack_rows(codes, 8), torch.zeros(scales.shape, dtype=torch.int32), scales,
                           g_idx.to(torch.int32).contiguous(), 8, float8=True)


def fp8_checkpoint_packed(q: WeightQuantization, weight: torch.Tensor, scale: torch.Tensor, rows: range,
                          cols: range) -> PackedIntWeight:
    """An FP8 checkpoint weight's slice ``weight`` (output rows ``rows`` x input columns ``cols``, float8) with
    the checkpoint's whole scale tensor (as ``dequantize_fp8`` takes it) -> packed: per-row or per-tensor scales
    as one group; ``q.block`` (br, bc) scales as groups of bc input columns (scales[g, n] = scale[n // br, g])."""
    scale = scale.float()
    if q.block is not None:
        br, bc = q.block
        scales = scale[torch.arange(rows.start, rows.stop) // br].t()                      # [K groups, N]
        return fp8_rows(weight, scales, torch.arange(cols.start, cols.stop) // bc)
    per_row = scale.reshape(-1)
    per_row = per_row[rows.start:rows.stop] if per_row.numel() > 1 else per_row.expand(len(rows))
    return fp8_rows(weight, per_row[None, :], torch.zeros(len(cols), dtype=torch.int32))


def gptq_zeros(q: WeightQuantization, qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [groups, out / per_word] -> zero points int32 [groups, out]."""
    return unpack_along_cols(qzeros, q.bits) + (1 if q.zeros_minus_one else 0)


def awq_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [groups, out / 8] -> zero points int32 [groups, out]."""
    return unpack_along_cols(qzeros, 4, AWQ_ORDER)


def group_of(q: WeightQuantization) -> int:
    """Input rows per group (all of them when the checkpoint has one group)."""
    return q.group_size if q.group_size > 0 else 1 << 62


def dequantize_fp8(q: WeightQuantization, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight float8 [out, in]; scale: one value, [out] / [out, 1], or with ``q.block`` [out / br, in / bc]
    (``weight_scale_inv``) -> float32 [out, in]."""
    w = weight.float()
    scale = scale.float()
    if q.block is not None:
        br, bc = q.block
        return w * scale.repeat_interleave(br, 0)[: w.shape[0]].repeat_interleave(bc, 1)[:, : w.shape[1]]
    return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def round_to_8bit(weight: torch.Tensor, method: str) -> torch.Tensor:
    """Online quantization of a full weight [out, in]: one symmetric scale per output row -> the dequantized
    weight, float32."""
    values, scale = _round_rows(weight, method)
    return values.float() * scale[:, None]


def quantized_online(name: str) -> bool:
    """True for the weights that ``quantization`` int8 / fp8 rounds: linear weights inside the decoder layers,
    not a MoE router (``...mlp.gate.weight``)."""
    return bool(_LAYER_LINEAR.search(name)) and not name.endswith(".mlp.gate.weight") and "norm" not in name


FP4_E2M1_VALUES = E2M1_VALUES   # MXFP4's value of each 4-bit code


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 [..., rows, groups, 16] and ``scales`` uint8 [..., rows, groups] -> [..., groups * 32,
    rows] in ``dtype`` (the transpose of the stored rows: the ``x @ W`` layout of gpt-oss's experts). Exact in
    float32 and bfloat16 for every exponent a checkpoint uses (a power of two times an e2m1 value)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape) \
            or blocks.shape[-1] != 16:
        raise ValueError(f"quantization: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales "
                         f"{tuple(scales.shape)} {scales.dtype} (expected uint8 [..., groups, 16] and [..., groups])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()                   # [..., rows, groups, 16, 2]
    values = lut[codes].flatten(-3)                                                    # [..., rows, groups * 32]
    exponents = (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1)            # [..., rows, groups * 32]
    return torch.ldexp(values, exponents.float()).to(dtype).transpose(-1, -2)


MXFP4_GROUP = 32


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[E, in, out]`` (transformers' layout) rounded to MXFP4 as a checkpoint stores them -> (blocks uint8
    ``[E, out, in / 32, 16]``, scales uint8 ``[E, out, in / 32]``): per 32 inputs of an output row the smallest power
    of two that fits max |x| in 6, each value rounded to the nearest e2m1 value (``dequantize_mxfp4`` inverts it;
    benchmarks and tests make MXFP4 checkpoints with it)."""
    lut = torch.tensor(FP4_E2M1_VALUES)
    blocks, scales = [], []
    for expert in weight:                                     # one expert at a time: the argmin holds 16x its values
        groups = expert.T.float().reshape(expert.shape[1], -1, MXFP4_GROUP)                # [out, G, 32]
        amax = groups.abs().amax(-1).clamp_min(2.0 ** -100)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)                   # [out, G]
        codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
        blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))                         # two codes a byte, low first
        scales.append((exponent + 127).to(torch.uint8))
    return torch.stack(blocks), torch.stack(scales)


def mxfp4_to_packed_rows(blocks: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | slice,
                         inputs: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's MXFP4 weight (``blocks`` uint8 [out, in / 32, 16], ``scales`` uint8 [out, in / 32]), its output
    ``rows`` (an index tensor or a slice) and its ``inputs`` (a slice on whole groups of 32) -> the 4-bit packed
    layout of ``kernels.quant_gemm`` for ``W^T`` [K = inputs, N = rows]: (qweight int32 [K / 8, N] of the e2m1
    codes, unchanged; scales float32 [K / 32, N], each 2^(e - 127), exact). The codes are not rounded again: the
    packed experts compute with the checkpoint's values."""
    if (inputs.start or 0) % MXFP4_GROUP or (inputs.stop - (inputs.start or 0)) % MXFP4_GROUP:
        raise ValueError(f"quantization: an MXFP4 input slice must lie on groups of {MXFP4_GROUP}, got {inputs}")
    groups = slice((inputs.start or 0) // MXFP4_GROUP, inputs.stop // MXFP4_GROUP)
    picked = blocks[rows][:, groups]                                                   # [N, G, 16]
    codes = torch.stack([picked & 0x0F, picked >> 4], dim=-1).flatten(1)                # [N, K] (even index low)
    exponents = scales[rows][:, groups].to(torch.float32) - 127                        # [N, G]
    return pack_rows(codes.T.contiguous(), 4), torch.exp2(exponents).T.contiguous()
