"""The Triton LoRA product (``kernels/triton/lora_triton.py``) against a float64 reference on random inputs,
under the Triton interpreter on CPU (on a GPU, the ``gpu`` test runs it on CUDA): several adapters and base
rows in one launch pair, segment widths that are not powers of two, float32 and bfloat16; only the rows with
a slot change; bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels.triton.lora_triton import lora_add_triton


def _case(dtype, device="cpu", tokens=7, fan_in=40, rows=(24, 8, 8), rank=4, slots_n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nseg, out = len(rows), sum(rows)
    a = torch.randn(slots_n, nseg * rank, fan_in, generator=gen)
    e = torch.zeros(slots_n, nseg * rank, out)
    start = 0
    for j, width in enumerate(rows):
        e[:, j * rank:(j + 1) * rank, start:start + width] = torch.randn(slots_n, rank, width, generator=gen)
        start += width
    x, y = torch.randn(tokens, fan_in, generator=gen), torch.randn(tokens, out, generator=gen)
    slots = torch.tensor([(t % (slots_n + 1)) - 1 for t in range(tokens)], dtype=torch.int32)
    scales = torch.rand(slots_n, generator=gen) + 0.5
    return [t.to(device) for t in (x.to(dtype), a.to(dtype), e.to(dtype), slots, scales, y.to(dtype))]


def _reference(x, a, e, slots, scales, y):
    out = y.double().cpu().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s].double().cpu() * ((x[t].double().cpu() @ a[s].double().cpu().T) @ e[s].double().cpu())
    return out


def _run_and_check(dtype, device):
    x, a, e, slots, scales, y = _case(dtype, device)
    expected, before = _reference(x, a, e, slots, scales, y), y.clone()
    lora_add_triton(x, a, e, slots, scales, y)
    base = (slots == -1).cpu()
    assert torch.equal(y.cpu()[base], before.cpu()[base])
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0.05)
    torch.testing.assert_close(y.double().cpu(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_slot_in_one_launch_pair_equals_the_reference(dtype):
    _run_and_check(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_on_cuda_every_slot_equals_the_reference(dtype):
    _run_and_check(dtype, "cuda")


def test_bad_arguments_are_named():
    x, a, e, slots, scales, y = _case(torch.float32)
    args = dict(x=x, a=a, e=e, slots=slots, scales=scales, y=y)
    for change, message in [(dict(a=a.double()), "a / e / y: must be x's dtype"),
                            (dict(e=e[:, :, :-1].contiguous()), "a / e: contiguous"),
                            (dict(slots=slots.long()), "slots"), (dict(scales=scales[:1].contiguous()), "scales"),
                            (dict(y=y[:-1]), "x / y")]:
        with pytest.raises(ValueError, match=message):
            lora_add_triton(**{**args, **change})
