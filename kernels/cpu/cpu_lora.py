"""The LoRA product of a step on CPU in C (``cpu_lora.c``): ``y[t] += scale[s] * (x[t] @ A[s]^T) @ E[s]`` for
each token t with a slot s, every adapter of the step in one call (workers/lora/slots.py holds A and E).

``available(dtype)``: float32 / bfloat16 once the library is built (``cpu_build``: the machine's C compiler,
cached; ``PAGEDRAY_CPU_KERNELS=0`` or no compiler: the caller's torch products run). ``lora_add`` checks
every argument before the C call: a wrong one is a ValueError naming it.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_lora.c")
MAX_NR = 2048                                 # segments x rank (cpu_lora.c)
DTYPE_CODES = cpu_build.DTYPE_CODES
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"lora_add": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR,
                            _I64, _INT, _INT]}


def _declare(library: ctypes.CDLL) -> None:
    cpu_build.declare(library, _SIGNATURES, restype=_INT)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU LoRA product", "LoRA rows use torch products")


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPE_CODES and _library() is not None


def check_layout(a: torch.Tensor, e: torch.Tensor, seg_off: torch.Tensor) -> None:
    """A layer's slot tensors (once, when they are made): a [S, nr, in] and e [S, nr, out] contiguous, of one
    dtype; seg_off [segments + 1] int64 offsets rising from 0 to out, the segments dividing nr."""
    if a.dtype not in DTYPE_CODES or e.dtype != a.dtype:
        raise ValueError(f"a / e: float32 or bfloat16, one dtype, got {a.dtype} / {e.dtype}")
    if a.device.type != "cpu" or e.device.type != "cpu" or seg_off.device.type != "cpu":
        raise ValueError("a / e / seg_off: must be on the CPU")
    if a.dim() != 3 or e.dim() != 3 or not a.is_contiguous() or not e.is_contiguous() or e.shape[:2] != a.shape[:2]:
        raise ValueError(f"a / e: contiguous [slots, nr, in] and [slots, nr, out], got {tuple(a.shape)} / "
                         f"{tuple(e.shape)}")
    nr, out = a.shape[1], e.shape[2]
    if nr > MAX_NR:
        raise ValueError(f"a: segments x rank {nr} is over {MAX_NR}")
    if seg_off.dtype != torch.int64 or seg_off.dim() != 1 or seg_off.numel() < 2 or not seg_off.is_contiguous():
        raise ValueError("seg_off: a contiguous int64 vector of segment offsets (segments + 1)")
    offsets = seg_off.tolist()
    nseg = len(offsets) - 1
    if nr % nseg or offsets[0] != 0 or offsets[-1] != out or any(q < p for p, q in zip(offsets, offsets[1:])):
        raise ValueError(f"seg_off: {offsets} must rise from 0 to {out} in {nseg} segments dividing nr={nr}")


def check_slots(slots: torch.Tensor, scales: torch.Tensor) -> None:
    """A step's token slots (once per step): int32 [tokens], each -1 or a slot of ``scales`` [S] float32."""
    if slots.dtype != torch.int32 or slots.dim() != 1 or not slots.is_contiguous() or slots.device.type != "cpu":
        raise ValueError(f"slots: a contiguous int32 vector on the CPU, got {slots.dtype} {tuple(slots.shape)}")
    if scales.dtype != torch.float32 or scales.dim() != 1 or not scales.is_contiguous():
        raise ValueError("scales: a contiguous float32 vector, one scale per slot")
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= scales.numel()):
        raise ValueError(f"slots: each must be -1 or in [0, {scales.numel()})")


def token_order(slots: torch.Tensor) -> torch.Tensor:
    """[n] int32: the tokens whose slot is not -1, sorted by slot (stable), as ``lora_add_checked`` takes them."""
    keyed = torch.where(slots < 0, torch.iinfo(torch.int32).max, slots)
    order = torch.sort(keyed, stable=True).indices
    return order[: int((slots >= 0).sum())].to(torch.int32).contiguous()


def lora_add_checked(x: torch.Tensor, a: torch.Tensor, e: torch.Tensor, seg_off: torch.Tensor, slots: torch.Tensor,
                     scales: torch.Tensor, y: torch.Tensor, order: torch.Tensor) -> None:
    """``lora_add`` for a layer whose slot tensors passed ``check_layout`` and a step whose slots passed
    ``check_slots``, with their ``token_order``: only the per-call shapes are checked here (no tensor is read)."""
    if x.dtype != a.dtype or y.dtype != a.dtype or x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 \
            or y.stride(1) != 1:
        raise ValueError(f"x / y: [tokens, in] / [tokens, out] of the slots' dtype {a.dtype} with contiguous rows, "
                         f"got {x.dtype} {tuple(x.shape)} / {y.dtype} {tuple(y.shape)}")
    if x.shape[0] != y.shape[0] or x.shape[0] != slots.numel() or x.shape[1] != a.shape[2] \
            or y.shape[1] != e.shape[2] or scales.numel() != a.shape[0]:
        raise ValueError(f"x / y / slots: {tuple(x.shape)} / {tuple(y.shape)} / {slots.numel()} slots do not fit "
                         f"a {tuple(a.shape)}, e {tuple(e.shape)}")
    if order.dtype != torch.int32 or order.dim() != 1 or order.numel() > slots.numel() or not order.is_contiguous():
        raise ValueError(f"order: at most {slots.numel()} int32 token indices (token_order), got {order.dtype} "
                         f"{tuple(order.shape)}")
    status = _library().lora_add(x.data_ptr(), x.stride(0), x.shape[1], a.data_ptr(), e.data_ptr(), a.shape[1],
                                 y.shape[1], seg_off.data_ptr(), seg_off.numel() - 1, order.data_ptr(), order.numel(),
                                 slots.data_ptr(), scales.data_ptr(), y.data_ptr(), y.stride(0), DTYPE_CODES[x.dtype],
                                 torch.get_num_threads())
    if status != 0:
        raise MemoryError("lora_add: out of memory for the work list")


def lora_add(x: torch.Tensor, a: torch.Tensor, e: torch.Tensor, seg_off: torch.Tensor, slots: torch.Tensor,
             scales: torch.Tensor, y: torch.Tensor) -> None:
    """y [tokens, out] += per token t with slots[t] >= 0: scales[s] * (x[t] @ a[s]^T) @ e[s], in place.
    x [tokens, in]; a [S, nr, in]; e [S, nr, out] (segment j's rows non-zero only in columns
    seg_off[j]..seg_off[j + 1]); slots [tokens] int32; scales [S] float32. Every argument checked."""
    if x.dtype not in DTYPE_CODES or x.device.type != "cpu" or y.device.type != "cpu":
        raise ValueError(f"x / y: float32 or bfloat16 CPU tensors, got {x.dtype} on {x.device} / {y.device}")
    check_layout(a, e, seg_off)
    check_slots(slots, scales)
    lora_add_checked(x, a, e, seg_off, slots, scales, y, token_order(slots))
