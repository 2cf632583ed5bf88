"""``quant_gemm``: x @ W^T with W held as packed integer codes (GPTQ's layout), validated and dispatched:
Triton on CUDA (``quant_gemm_triton``), the torch reference elsewhere (dequantize, then a float32 matmul).

Layout (``quant_gemm_triton``'s docstring has it in full): ``qweight`` int32 ``[K / (32 / bits), N]``, K rows
packed lowest bits first; ``zeros`` int32 and ``scales`` ``[groups, N]``; ``g_idx`` int32 ``[K]`` (row -> group);
``perm`` int32 ``[K]`` or None (row k multiplies x's column ``perm[k]``).
weight row k = (code[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], times x[:, perm[k]].
``float8`` (8 bits only): a code is a float8 e4m3fn bit pattern, weight row k = e4m3(code[k, n]) *
scales[g_idx[k], n], and the zero points are not read (FP8 checkpoints and ``quantization`` fp8). Packed
experts may also hold ``float4`` codes (4 bits: float4 e2m1 bit patterns, MXFP4's, times a power-of-two scale
per group of 32; gpt-oss's experts on CUDA), read the same way.
``group_rows`` is the load-time step that makes the fast path apply: it sorts an activation-order weight's rows
by group (recording ``perm``) and reports ``group_size`` when ``g_idx[k] == k // group_size``. The unpacking and
packing helpers are shared with the checkpoint loader (``workers.quantization``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import validation as v


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C], each word holding 32 / bits values of consecutive rows (lowest bits first) ->
    int32 [R * 32 / bits, C]."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)    # [per_word]
    values = (packed[:, None, :] >> shifts[None, :, None]) & mask                  # [R, per_word, C]
    return values.reshape(packed.shape[0] * per_word, packed.shape[1])


def unpack_along_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * 32 / bits]: value k of word c is column ``c * per_word + order[k]``."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed[:, :, None] >> shifts[None, None, :]) & mask                  # [R, C, per_word] by nibble
    if order is not None:
        values = values[:, :, torch.argsort(torch.tensor(order))]                   # by column within the word
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes [K, N] in [0, 2^bits) -> int32 words [K / per_word, N], consecutive rows per word."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (codes.to(torch.int64).view(-1, per_word, codes.shape[1]) << shifts[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def uniform_group_size(g_idx: torch.Tensor) -> int:
    """G > 0 when ``g_idx[k] == k // G`` for every row (the last group may be short), else 0."""
    k = g_idx.numel()
    if k == 0 or int(g_idx[0]) != 0:
        return 0
    size = int((g_idx == 0).sum())
    rows = torch.arange(k, device=g_idx.device)
    return size if bool((g_idx.long() == rows // size).all()) else 0


def group_rows(qweight, zeros, scales, g_idx, bits: int):
    """Load-time layout for the fast kernel path -> (qweight, zeros, scales, g_idx, perm, group_size).

    Rows are sorted by group (stable; ``perm`` int32 [K] maps each new row to its x column, None when the order
    is already sorted), and groups no row uses at the front are dropped (a tensor-parallel slice of a weight
    starts at its first row's group), so that ``group_size`` is G > 0 when ``g_idx[k] == k // G``. An
    activation-order weight's slice whose groups are uneven keeps ``group_size`` 0 (every row reads its group)."""
    groups = g_idx.long()
    perm = None
    if groups.numel() > 1 and not bool((groups[1:] >= groups[:-1]).all()):
        order = torch.argsort(groups, stable=True)
        qweight = pack_rows(unpack_along_rows(qweight, bits)[order], bits)
        groups, perm = groups[order], order.to(torch.int32)
    first = int(groups[0]) if groups.numel() else 0
    zeros, scales, g_idx = zeros[first:].contiguous(), scales[first:].contiguous(), (groups - first).to(torch.int32)
    return qweight, zeros, scales, g_idx, perm, uniform_group_size(g_idx)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # by code


def dequantize_packed(qweight, zeros, scales, g_idx, bits: int, float8: bool = False, float4: bool = False
                      ) -> torch.Tensor:
    """The packed weight as float32 W^T [K, N] (the checkpoint loader's dense path and the reference's)."""
    groups = g_idx.long()
    codes = unpack_along_rows(qweight, bits)
    if float8:
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * scales[groups].float()
    if float4:
        return torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()] * scales[groups].float()
    return (codes - zeros[groups]).float() * scales[groups].float()


def quant_gemm_reference(x, qweight, zeros, scales, g_idx, bits: int, perm=None, float8: bool = False) -> torch.Tensor:
    """The dequantized weight, cast to x's dtype as the kernel's tiles are, times x (columns ``perm``) in
    float32 -> x.dtype."""
    weight_t = dequantize_packed(qweight, zeros, scales, g_idx, bits, float8)                    # [K, N]
    x = x if perm is None else x[:, perm.long()]
    return (x.float() @ weight_t.to(x.dtype).float()).to(x.dtype)


def quant_gemm(x, qweight, zeros, scales, g_idx, bits: int, *, perm=None, group_size: int = 0, float8: bool = False,
               use_triton=None) -> torch.Tensor:
    """x [M, K] float32 / float16 / bfloat16 -> [M, N] in x's dtype (shapes: the module docstring).
    ``group_size`` > 0 promises ``g_idx[k] == k // group_size`` (``group_rows`` finds it)."""
    v.check_tensor("x", x, 2)
    if x.dtype not in v.SUPPORTED_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x: expected a float32 / float16 / bfloat16 tensor with contiguous rows, got {x.dtype}")
    if bits not in (4, 8):
        raise ValueError(f"bits: 4 or 8, got {bits!r}")
    if float8 and bits != 8:
        raise ValueError(f"float8: float8 codes are 8 bits, got bits={bits}")
    k, per_word = x.shape[1], 32 // bits
    for name, t, dtype in (("qweight", qweight, torch.int32), ("zeros", zeros, torch.int32),
                           ("g_idx", g_idx, torch.int32)):
        v.check_tensor(name, t, 1 if name == "g_idx" else 2, x.device)
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {dtype} tensor, got {t.dtype}")
    v.check_tensor("scales", scales, 2, x.device)
    n = qweight.shape[1]
    if qweight.shape[0] * per_word != k or g_idx.shape[0] != k:
        raise ValueError(f"qweight / g_idx: {tuple(qweight.shape)} / {tuple(g_idx.shape)} do not cover x's {k} "
                         f"columns at {per_word} codes per word")
    if zeros.shape != scales.shape or zeros.shape[1] != n or not scales.is_contiguous():
        raise ValueError(f"zeros / scales: expected [groups, {n}] each (contiguous), got {tuple(zeros.shape)} / "
                         f"{tuple(scales.shape)}")
    if perm is not None:
        v.check_tensor("perm", perm, 1, x.device)
        if perm.dtype != torch.int32 or perm.shape[0] != k:
            raise ValueError(f"perm: expected int32 [{k}], got {perm.dtype} {tuple(perm.shape)}")
    if not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size: expected an int >= 0, got {group_size!r}")
    if v.values_checked(None, x.device) and k:
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
            raise ValueError(f"g_idx: groups must lie in [0, {zeros.shape[0]})")
        if group_size and uniform_group_size(g_idx) != group_size and not (group_size >= k and not g_idx.any()):
            raise ValueError(f"group_size: g_idx is not row // {group_size}")
        if perm is not None and not torch.equal(torch.sort(perm.long()).values, torch.arange(k)):
            raise ValueError(f"perm: expected a permutation of 0..{k - 1}")
    if use_triton is None:
        use_triton = x.device.type == "cuda"
    if use_triton:
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("use_triton: Triton on CPU tensors needs TRITON_INTERPRET=1")
        from .triton.quant_gemm_triton import quant_gemm_triton

        return quant_gemm_triton(x, qweight, zeros, scales, g_idx, bits, perm, group_size, float8=float8)
    return quant_gemm_reference(x, qweight, zeros, scales, g_idx, bits, perm, float8)


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's weight ``[E, N, K]`` (out, in) packed as ``quant_gemm`` takes one: qweight int32
    ``[E, K / per_word, N]``, zeros int32 and scales ``[E, groups, N]``, and one ``g_idx`` int32 ``[K]`` for all
    experts, ``g_idx[k] == k // group_size`` (uniform groups: activation-order experts are not packed). ``float8``:
    8-bit e4m3 codes; ``float4``: 4-bit e2m1 codes (MXFP4: groups of 32, power-of-two scales); the zero points of
    float codes are not read."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    float8: bool = False
    float4: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, words, n = self.qweight.shape
        return experts, n, words * (32 // self.bits)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.zeros, self.scales, self.g_idx))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The experts' weights ``[E, N, K]`` in ``dtype`` (the values the packed kernel computes with)."""
        return torch.stack([dequantize_packed(q, z, s, self.g_idx, self.bits, self.float8, self.float4).t()
                            for q, z, s in zip(self.qweight, self.zeros, self.scales)]).to(dtype)


def check_packed_experts(name: str, p: PackedExperts, device: torch.device) -> None:
    """ValueError naming ``name`` unless ``p`` is a consistent ``PackedExperts`` on ``device``."""
    if not isinstance(p, PackedExperts):
        raise ValueError(f"{name}: expected a PackedExperts, got {type(p).__name__}")
    experts, n, k = p.shape
    for field, t, dims, dtype in (("qweight", p.qweight, 3, torch.int32), ("zeros", p.zeros, 3, torch.int32),
                                  ("scales", p.scales, 3, None), ("g_idx", p.g_idx, 1, torch.int32)):
        v.check_tensor(f"{name}.{field}", t, dims, device)
        if (dtype is not None and t.dtype != dtype) or not t.is_contiguous():
            raise ValueError(f"{name}.{field}: expected a contiguous {dtype or 'float'} tensor, got {t.dtype}")
    groups = p.zeros.shape[1]
    if (p.bits not in (4, 8) or (p.float8 and p.bits != 8) or (p.float4 and (p.bits != 4 or p.float8))
            or p.g_idx.shape[0] != k or p.group_size < 1
            or tuple(p.zeros.shape) != (experts, groups, n) or p.scales.shape != p.zeros.shape
            or groups != -(-k // p.group_size)):
        raise ValueError(f"{name}: inconsistent packed experts (bits {p.bits}, float8 {p.float8}, float4 {p.float4}, "
                         f"qweight {tuple(p.qweight.shape)}, "
                         f"zeros / scales {tuple(p.zeros.shape)} / {tuple(p.scales.shape)}, group_size {p.group_size})")
