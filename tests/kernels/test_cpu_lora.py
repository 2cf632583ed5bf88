"""The C LoRA product (``kernels/cpu/cpu_lora.c``) against a float64 torch reference on random inputs:
several adapters and base rows in one call, segments whose widths are not multiples of 16, float32 and
bfloat16, one and two threads; only the token rows with a slot change; every bad argument is refused by
name before the C call."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels.cpu import cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(torch.float32), reason="no C compiler for cpu_lora.c")


def _case(dtype, tokens=11, fan_in=72, rows=(40, 24, 21), rank=5, slots_n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nseg, out = len(rows), sum(rows)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    a = torch.randn(slots_n, nseg * rank, fan_in, generator=gen)
    e = torch.zeros(slots_n, nseg * rank, out)
    for j in range(nseg):          # each segment's block of E; the rest stays zero, as the slots keep it
        e[:, j * rank:(j + 1) * rank, offsets[j]:offsets[j + 1]] = torch.randn(slots_n, rank, rows[j], generator=gen)
    x = torch.randn(tokens, fan_in, generator=gen)
    y = torch.randn(tokens, out, generator=gen)
    slots = torch.tensor([(t % (slots_n + 1)) - 1 for t in range(tokens)], dtype=torch.int32)   # -1, 0, 1, 2, ...
    scales = torch.rand(slots_n, generator=gen) + 0.5
    return (x.to(dtype), a.to(dtype), e.to(dtype), torch.tensor(offsets, dtype=torch.int64), slots, scales,
            y.to(dtype))


def _reference(x, a, e, slots, scales, y):
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s].double() * ((x[t].double() @ a[s].double().T) @ e[s].double())
    return out


@pytest.mark.parametrize("tokens", [11, 45], ids=["blocks-of-2-3", "blocks-of-8-and-tails"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_slot_of_a_step_in_one_call_equals_the_reference(dtype, threads, tokens):
    x, a, e, seg_off, slots, scales, y = _case(dtype, tokens=tokens)
    expected = _reference(x, a, e, slots, scales, y)
    before = y.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_lora.lora_add(x, a, e, seg_off, slots, scales, y)
    finally:
        torch.set_num_threads(previous)
    base = slots == -1
    assert torch.equal(y[base], before[base])               # base rows untouched
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
    else:                                                     # inputs are bf16 already; one rounding at the end
        torch.testing.assert_close(y.double(), expected, rtol=2 ** -7, atol=0.05)
    assert not torch.equal(y[~base], before[~base])


def test_a_strided_x_row_view_is_read_as_its_rows():
    x, a, e, seg_off, slots, scales, y = _case(torch.float32, tokens=4)
    wide = torch.zeros(4, x.shape[1] + 8)
    wide[:, :x.shape[1]] = x
    expected = _reference(x, a, e, slots, scales, y)
    cpu_lora.lora_add(wide[:, :x.shape[1]], a, e, seg_off, slots, scales, y)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_named_before_the_call():
    x, a, e, seg_off, slots, scales, y = _case(torch.float32)
    cases = [
        (dict(x=x.double()), "x / y: float32 or bfloat16"),
        (dict(a=a.bfloat16()), "a / e: float32 or bfloat16, one dtype"),
        (dict(x=x.bfloat16(), a=a.bfloat16(), e=e.bfloat16()), "x / y: .* of the slots' dtype"),
        (dict(e=e[:, :, :-1].contiguous()), "seg_off"),
        (dict(a=a[:, :, :-1].contiguous()), "do not fit"),
        (dict(seg_off=seg_off.int()), "seg_off"),
        (dict(seg_off=torch.tensor([0, 50, 40, 85], dtype=torch.int64)), "seg_off"),
        (dict(slots=slots.long()), "slots: a contiguous int32"),
        (dict(slots=torch.full_like(slots, 3)), r"slots: each must be -1 or in \[0, 3\)"),
        (dict(scales=scales[:2].contiguous()), r"slots: each must be -1 or in \[0, 2\)"),
        (dict(y=y[:-1]), "do not fit"),
    ]
    args = dict(x=x, a=a, e=e, seg_off=seg_off, slots=slots, scales=scales, y=y)
    before = y.clone()
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_lora.lora_add(**{**args, **change})
    assert torch.equal(y, before)
