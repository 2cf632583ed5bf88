"""The shared vector header of the CPU C kernels (``kernels/cpu/cpu_vec.h``): its 8- and 16-lane forms of
one operation give the same bits (the 16-lane ones have AVX-512 spellings), exp against torch, bfloat16
rounding against torch's, and the partial loads and stores touch only their lanes. Built twice: for this
CPU (-march=native) and, where the CPU has AVX2, for AVX2 alone (the generic 16-lane forms)."""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch
from pagedray.kernels.cpu import cpu_build

HEADER = pathlib.Path(cpu_build.__file__).with_name("cpu_vec.h")
CHECKS = r"""
#include "cpu_vec.h"

void exp_both(const float *x, float *e8, float *e16, int64_t n) {          /* n a multiple of 16 */
    for (int64_t i = 0; i < n; i += 16) {
        const v16f y = exp16(load16_f32((const char *)(x + i)));
        memcpy(e16 + i, &y, sizeof y);
        for (int h = 0; h < 2; h++) {
            const v8f z = exp8(load8((const char *)(x + i + 8 * h), DTYPE_F32));
            memcpy(e8 + i + 8 * h, &z, sizeof z);
        }
    }
}

void bf16_all(const float *x, uint16_t *b1, uint16_t *b8, uint16_t *b16, float *r16, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const v16f v = load16_f32((const char *)(x + i));
        store16((char *)(b16 + i), v, DTYPE_BF16);
        const v16f r = round16(v, DTYPE_BF16);
        memcpy(r16 + i, &r, sizeof r);
        for (int h = 0; h < 2; h++)
            store8((char *)(b8 + i + 8 * h), load8((const char *)(x + i + 8 * h), DTYPE_F32), DTYPE_BF16);
        for (int j = 0; j < 16; j++) b1[i + j] = to_bf16(x[i + j]);
    }
}

/* load16_first then store16_first of n elements; dst gets the loaded lanes doubled */
void copy_first(const char *src, char *dst, int64_t n, int dtype) {
    const v16f v = load16_first(src, n, dtype);
    store16_first(dst, n, v + v, dtype);
}

/* the lanes load16_first leaves past n, as float32 (all must be 0) */
void lanes_past(const char *src, int64_t n, int dtype, float *out) {
    const v16f v = load16_first(src, n, dtype);
    memcpy(out, &v, sizeof v);
}
"""


def _cpu_flags() -> set[str]:
    return set(cpu_build._cpu_flags().split())


def _build(tmp: pathlib.Path, march: str) -> ctypes.CDLL:
    (tmp / "cpu_vec.h").write_text(HEADER.read_text())
    (tmp / "checks.c").write_text(CHECKS)
    target = tmp / f"checks-{march}.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-fPIC", "-shared", "-std=gnu11", "-o", str(target),
                    str(tmp / "checks.c"), "-lm"], check=True, capture_output=True)
    library = ctypes.CDLL(str(target))
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    cpu_build.declare(library, {"exp_both": [p, p, p, i64], "bf16_all": [p, p, p, p, p, i64],
                                "copy_first": [p, p, i64, i], "lanes_past": [p, i64, i, p]})
    return library


BUILDS = ["native", pytest.param("x86-64-v3", id="avx2-only")]


@pytest.fixture(scope="module", params=BUILDS)
def checks(request, tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    if request.param == "x86-64-v3" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU runs no AVX2 code")
    return _build(tmp_path_factory.mktemp(request.param), request.param)


def _exp_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    spread = -torch.rand(40_000, generator=gen) * 100                      # [-100, 0]
    near = -torch.rand(8_000, generator=gen) * 2                           # [-2, 0]: r near +-ln2 / 2
    # x log2(e) near a half-integer: where trunc(x log2(e) - 1/2) decides n
    halves = (-(torch.arange(1, 120, dtype=torch.float64) - 0.5) / 1.4426950408889634).float()
    halves = torch.cat([halves, torch.nextafter(halves, torch.zeros(())), torch.nextafter(halves, -torch.ones(()))])
    special = torch.tensor([0.0, -0.0, -1e-30, -86.9, -87.0, -87.0001, -88.0, -1e4, -float("inf")])
    x = torch.cat([spread, near, halves, special])
    return torch.cat([x, torch.zeros((-x.numel()) % 16)]).contiguous()


def test_exp16_equals_exp8_bit_for_bit_and_torch_within_its_bound(checks):
    x = _exp_inputs()
    e8, e16 = torch.empty_like(x), torch.empty_like(x)
    checks.exp_both(x.data_ptr(), e8.data_ptr(), e16.data_ptr(), x.numel())
    assert torch.equal(e8.view(torch.int32), e16.view(torch.int32))
    live = x >= -87.0
    expected = torch.exp(x.double())
    torch.testing.assert_close(e16[live].double(), expected[live], rtol=4e-7, atol=0)
    assert torch.equal(e16[~live], torch.zeros(int((~live).sum())))


def _bf16_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    normal = torch.randn(30_000, generator=gen) * torch.logspace(-30, 30, 30_000).float()
    bits = torch.randint(-2**31, 2**31 - 1, (30_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    raw = bits.view(torch.float32)                                         # every class: denormals, inf, NaN
    ties = (torch.randint(0, 2**15, (2_000,), generator=gen, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    x = torch.cat([normal, raw, ties, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    return torch.cat([x, torch.ones((-x.numel()) % 16)]).contiguous()


def test_bfloat16_rounding_is_one_at_every_width_and_torchs_for_numbers(checks):
    x = _bf16_inputs()
    n = x.numel()
    b1, b8, b16 = (torch.empty(n, dtype=torch.int16) for _ in range(3))
    r16 = torch.empty(n)
    checks.bf16_all(x.data_ptr(), b1.data_ptr(), b8.data_ptr(), b16.data_ptr(), r16.data_ptr(), n)
    assert torch.equal(b1, b8) and torch.equal(b1, b16)
    assert torch.equal((b16.to(torch.int32) << 16).view(torch.float32).view(torch.int32), r16.view(torch.int32))
    numbers = ~torch.isnan(x)
    assert torch.equal(b16[numbers], x[numbers].to(torch.bfloat16).view(torch.int16))
    nan_out = b16[~numbers].view(torch.bfloat16).float()
    assert nan_out.numel() > 100 and bool(torch.isnan(nan_out).all())      # a NaN stays a NaN, quiet


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_partial_loads_and_stores_touch_only_their_lanes(checks, dtype):
    code = cpu_build.DTYPE_CODES[dtype]
    gen = torch.Generator().manual_seed(3)
    for n in range(0, 17):
        src = torch.randn(16, generator=gen).to(dtype)
        dst = torch.full((16,), 7.0, dtype=dtype)
        checks.copy_first(src.data_ptr(), dst.data_ptr(), n, code)
        assert torch.equal(dst[:n], (src[:n].float() * 2).to(dtype))
        assert torch.equal(dst[n:], torch.full((16 - n,), 7.0, dtype=dtype))
        past = torch.empty(16)
        checks.lanes_past(src.data_ptr(), n, code, past.data_ptr())
        assert torch.equal(past[n:], torch.zeros(16 - n))
