"""8-bit KV cache (``kernels.kv_quant``): the quantizer's own properties, then every path that writes or
reads an 8-bit cache against an independent float64 oracle (``dense_attention``) over the dequantized
rows: the torch references, the C decode kernel, and the Triton store / decode / prefill kernels (under
``TRITON_INTERPRET=1`` on CPU; exact codes on a GPU). Random rows over a wide range of magnitudes,
shuffled blocks with junk in every other slot, odd lengths, GQA, a sliding window. Plus the argument
checks and how far an 8-bit cache moves attention from the full-precision result."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers.paged_kv_cases import dense_attention, kernel_device, make_paged_case, seed_of
from pagedray import kernels
from pagedray.kernels.cpu import cpu_decode
from pagedray.kernels.kv_quant import QMAX, SCALE_MIN, dequantize_rows, quantize_rows, static_scale
from pagedray.kernels.reference.attention import paged_decode_reference, paged_prefill_reference
from pagedray.kernels.triton import decode_triton
from pagedray.kernels.triton.decode_triton import paged_decode_triton
from pagedray.workers.kv_cache import KVCache, copy_blocks

INT8, FP8 = torch.int8, torch.float8_e4m3fn
CACHE_DTYPES = [INT8, FP8]
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}   # vs the oracle on dequantized rows
RELATIVE_TOL = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}             # 16 / 4 units of 2^-12 / 2^-8 (p rounded)


def _rows(gen, n: int, d: int) -> torch.Tensor:
    """n rows with magnitudes from 1e-3 to 1e3, one all-zero row."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    x[n // 2] = 0.0
    return x


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["int8", "fp8"])
def test_quantize_rows_scales_and_error_bounds(dtype):
    x = _rows(torch.Generator().manual_seed(1), 40, 64)
    codes, scales = quantize_rows(x, dtype)
    assert codes.dtype == dtype and scales.dtype == torch.float16 and scales.shape == (40,)
    amax = x.abs().amax(-1)
    want = (amax / QMAX[dtype]).to(torch.float16).clamp(min=SCALE_MIN)
    assert torch.equal(scales, want)
    c = codes.float()
    assert c.abs().max() <= QMAX[dtype]
    assert (c.abs().amax(-1)[amax > 0] >= QMAX[dtype] - 1).all()          # each row uses its whole range
    back = dequantize_rows(codes, scales)
    s = scales.float()[:, None]
    if dtype == INT8:
        assert ((back - x).abs() <= s * 0.5 * (1 + 1e-6)).all()
    else:                                                                  # 3 mantissa bits; subnormal steps 2^-9
        assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + s * 2.0 ** -9).all()
    assert torch.equal(back[20], torch.zeros(64)) and scales[20].item() == SCALE_MIN


def _quantized_case(seq_lens, kv_heads, head_dim, block_size, cache_dtype, seed, magnitude=1.0):
    """A paged case whose cache holds every row (junk included) 8-bit, plus the logical rows dequantized;
    ``magnitude`` multiplies the rows before they are quantized."""
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, seq_lens, kv_heads, head_dim, block_size, torch.float32, torch.device("cpu"))
    case.k_cache.mul_(magnitude)
    case.v_cache.mul_(magnitude)
    k8, ks = quantize_rows(case.k_cache, cache_dtype)
    v8, vs = quantize_rows(case.v_cache, cache_dtype)
    keys = [dequantize_rows(*quantize_rows(k * magnitude, cache_dtype)) for k in case.keys]
    values = [dequantize_rows(*quantize_rows(v * magnitude, cache_dtype)) for v in case.values]
    return case, (k8, v8, ks, vs), keys, values


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


DECODE_SPECS = [   # (q heads, kv heads, head_dim, block, lens, window)
    (8, 2, 64, 16, (1, 17, 70, 130), None),
    (6, 3, 32, 8, (5, 63, 41), 20),
    (4, 4, 128, 16, (33, 200), None),
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("spec", DECODE_SPECS, ids=lambda s: f"g{s[0] // s[1]}-d{s[2]}-w{s[5]}")
@pytest.mark.parametrize("path", ["reference", "c", "triton", "triton-keys-major"])
def test_decode_over_an_8bit_cache_matches_the_oracle(path, spec, cache_dtype):
    hq, hkv, d, bs, lens, window = spec
    if path == "c" and not cpu_decode.available():
        pytest.skip("no C compiler: the CPU decode kernel is not built")
    q_dtype = torch.float16 if path.startswith("triton") else torch.bfloat16 if d == 32 else torch.float32
    device = kernel_device() if path.startswith("triton") else torch.device("cpu")
    case, (k8, v8, ks, vs), keys, values = _quantized_case(list(lens), hkv, d, bs, cache_dtype,
                                                           seed_of("kv8-decode", spec, str(cache_dtype)))
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    scale = 1.0 / math.sqrt(d)
    k8, v8, ks, vs, tables, seq_lens, qd = _to(device, k8, v8, ks, vs, case.block_tables, case.seq_lens, q)
    if path == "reference":
        out = paged_decode_reference(qd, k8, v8, tables, seq_lens, scale, sliding_window=window,
                                     k_scale=ks, v_scale=vs)
    elif path == "c":
        assert cpu_decode.supports(qd, k8)
        out = cpu_decode.paged_decode_cpu(qd, k8, v8, tables, seq_lens, scale, sliding_window=window,
                                          k_scale=ks, v_scale=vs)
    elif path == "triton":
        out = kernels.paged_decode(qd, k8, v8, tables, seq_lens, scale, sliding_window=window, use_triton=True,
                                   k_scale=ks, v_scale=vs)
    else:                 # tile_keys_major_triton: query heads padded to 8 columns
        out = paged_decode_triton(qd, k8, v8, tables, seq_lens, scale, sliding_window=window, k_scale=ks,
                                  v_scale=vs, config=dict(KEYS_MAJOR=True, BLOCK_G=8))
    assert out.dtype == q_dtype
    for i, n in enumerate(lens):
        want = dense_attention(q[i:i + 1], keys[i], values[i], scale, sliding_window=window)[0]
        err = (out[i].double().cpu() - want).abs().max().item()
        assert err < TOL[q_dtype], f"sequence {i} (len {n}): error {err:.2e}"


# The launcher's CUDA settings for bf16 queries over an 8-bit cache, without its asm code conversions (the
# interpreter runs no inline asm: Triton's cast there)
CUDA_DEFAULT_TILES = {name: value for name, value in
                      decode_triton.decode_config(64, 4, quantized=True, fast_codes=True).items()
                      if name not in ("K_CVT", "V_CVT")}


@pytest.mark.parametrize("q_dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("magnitude", [1e-4, 30.0])
@pytest.mark.parametrize("config", [None, dict(F16_MATH=True), dict(KEYS_MAJOR=True, BLOCK_G=8),
                                    dict(KEYS_MAJOR=True, BLOCK_G=8, F16_MATH=True),
                                    CUDA_DEFAULT_TILES],
                         ids=["", "f16-math", "keys-major", "keys-major-f16-math", "cuda-default-tiles"])
def test_triton_decode_over_8bit_rows_of_any_magnitude(config, magnitude, cache_dtype, q_dtype):
    """16-bit queries over an 8-bit cache: rows of tiny and of large values, query rows from 1e-3 to 1e3 in one
    call, stay within the query dtype's relative error of the oracle (with float16 queries the probabilities
    times the value scales are taken relative to the tile's largest scale: without it, tiny rows fail).
    ``config``: the decode kernel's ``F16_MATH`` (each query row scaled by a power of two into float16, its
    score scale divided by it: ``tile_triton.queries_in_f16``), the keys-major kernel
    (``tile_keys_major_triton``), both, and the settings the launcher takes on CUDA with bf16 queries
    (keys-major, 64-key tiles; ``None`` is that default, asm conversions included, on a GPU)."""
    lens, hq, hkv, d = (9, 40, 77), 8, 2, 64
    case, (k8, v8, ks, vs), keys, values = _quantized_case(list(lens), hkv, d, 16, cache_dtype,
                                                           seed_of("kv8-f16", magnitude, str(cache_dtype)), magnitude)
    gen = torch.Generator().manual_seed(8)
    q = (torch.randn(len(lens), hq, d, generator=gen) * torch.logspace(-3, 3, hq)[None, :, None]).to(q_dtype)
    device = kernel_device()
    k8, v8, ks, vs, tables, seq_lens, qd = _to(device, k8, v8, ks, vs, case.block_tables, case.seq_lens, q)
    if config:
        out = paged_decode_triton(qd, k8, v8, tables, seq_lens, 0.125, k_scale=ks, v_scale=vs, config=config)
    else:
        out = kernels.paged_decode(qd, k8, v8, tables, seq_lens, 0.125, use_triton=True, k_scale=ks, v_scale=vs)
    for i in range(len(lens)):
        want = dense_attention(q[i:i + 1], keys[i], values[i], 0.125)[0]
        err = (out[i].double().cpu() - want).abs().amax(-1) / want.abs().amax(-1)      # [heads] relative
        assert err.max().item() < RELATIVE_TOL[q_dtype], f"sequence {i}: relative errors {err.tolist()}"


@pytest.mark.parametrize("window", [25, None])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("path", ["reference", "triton", "triton-fp32"])
def test_prefill_over_an_8bit_cache_matches_the_oracle(path, cache_dtype, window):
    """``triton``: float16 queries, the scales applied to scores and probabilities; ``triton-fp32``: the rows
    dequantized before the products (``SCALE_ROWS``, as bf16 queries on a GPU). Without a window the kernel
    also runs its loop over the tiles below the diagonal (``FULL``)."""
    lens, chunks = [45, 30, 19], [12, 30, 1]       # with history, without, and a decode row
    case, (k8, v8, ks, vs), keys, values = _quantized_case(lens, 2, 32, 8, cache_dtype, seed_of("kv8-prefill"))
    q_dtype = torch.float16 if path == "triton" else torch.float32
    q = torch.randn(sum(chunks), 6, 32, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    cu = torch.tensor([0, 12, 42, 43], dtype=torch.int32)
    device = kernel_device() if path.startswith("triton") else torch.device("cpu")
    args = _to(device, q, k8, v8, cu, case.seq_lens, case.block_tables)
    if path == "reference":
        out = paged_prefill_reference(*args, 0.2, k_scale=ks, v_scale=vs, sliding_window=window)
    else:
        out = kernels.paged_prefill(*args, 0.2, k_scale=ks.to(device), v_scale=vs.to(device), sliding_window=window,
                                    use_triton=True)
    for i, n in enumerate(chunks):
        start = int(cu[i])
        want = dense_attention(q[start:start + n], keys[i], values[i], 0.2, sliding_window=window)
        assert (out[start:start + n].double().cpu() - want).abs().max().item() < TOL[q_dtype]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
def test_store_kv_writes_codes_and_scales_only_at_its_slots(cache_dtype):
    gen = torch.Generator().manual_seed(5)
    k8 = torch.randn(6, 8, 2, 32, generator=gen).to(cache_dtype)
    v8, ks, vs = k8.clone(), torch.rand(6, 8, 2, generator=gen).half(), torch.rand(6, 8, 2, generator=gen).half()
    before = [t.clone() for t in (k8, v8, ks, vs)]
    key, value = _rows(gen, 3, 64).view(3, 2, 32), torch.randn(3, 2, 32, generator=gen)
    slots = torch.tensor([17, -1, 40], dtype=torch.int32)
    kernels.store_kv(key, value, k8, v8, slots, k_scale=ks, v_scale=vs)
    for row, slot in ((0, 17), (2, 40)):
        b, o = divmod(slot, 8)
        codes, scales = quantize_rows(key[row], cache_dtype)
        assert torch.equal(k8[b, o].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(ks[b, o], scales)
        codes, scales = quantize_rows(value[row], cache_dtype)
        assert torch.equal(v8[b, o].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(vs[b, o], scales)
    untouched = torch.ones(6, 8, dtype=torch.bool)
    untouched[2, 1] = untouched[5, 0] = False
    for now, then in zip((k8, v8, ks, vs), before):
        assert torch.equal(now[untouched].view(torch.uint8), then[untouched].view(torch.uint8))


@pytest.mark.parametrize("path", ["reference", "triton", pytest.param("triton-gpu", marks=pytest.mark.gpu)])
def test_checkpoint_scales_quantize_every_fp8_row_with_them(path):
    """``static_scales``: each row's codes are e4m3(x / s) with s the checkpoint's scale (rounded to float16),
    saturating at 448 s, and every stored row's scale is s; slots < 0 and other slots are untouched."""
    gen = torch.Generator().manual_seed(9)
    key, value = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen) * 40
    key[1, 0, 3] = 1e4                                                  # beyond 448 x s: saturates
    s_k, s_v = static_scale(0.0123), static_scale(0.37)
    assert s_k != 0.0123 and s_k == float(torch.tensor(0.0123).half())
    slots = torch.tensor([3, 17, -1, 40, 8], dtype=torch.int32)
    device = kernel_device() if path.startswith("triton") else torch.device("cpu")
    k8, v8 = torch.zeros(6, 8, 2, 32, dtype=FP8), torch.zeros(6, 8, 2, 32, dtype=FP8)
    ks, vs = torch.zeros(6, 8, 2, dtype=torch.float16), torch.zeros(6, 8, 2, dtype=torch.float16)
    k8, v8, ks, vs, kd, vd, sd = _to(device, k8, v8, ks, vs, key, value, slots)
    kernels.store_kv(kd, vd, k8, v8, sd, k_scale=ks, v_scale=vs, static_scales=(s_k, s_v),
                     use_triton=path.startswith("triton"))
    k8, v8, ks, vs = (t.cpu() for t in (k8, v8, ks, vs))
    written = torch.zeros(6 * 8, dtype=torch.bool)
    written[[3, 17, 40, 8]] = True
    for row, slot in ((0, 3), (1, 17), (3, 40), (4, 8)):
        b, o = divmod(slot, 8)
        assert (ks[b, o] == s_k).all() and (vs[b, o] == s_v).all()
        for got, x, s in ((k8[b, o], key[row], s_k), (v8[b, o], value[row], s_v)):
            want = (x / s).clamp(-448, 448).to(FP8).float()
            exact = got.float() == want
            if device.type == "cpu" and path == "triton":    # the interpreter's float8 encoding (test below)
                exact |= (want != 0) & (torch.frexp(want).mantissa.abs() == 0.5) & (got.float() == want / 2)
            assert exact.all()
    assert k8[2, 1, 0, 3].float() == 448.0
    assert not ks.view(-1, 2)[~written].any() and not k8.view(-1, 2, 32)[~written].float().any()


def test_checkpoint_scales_are_checked():
    k8, ks = torch.zeros(2, 8, 1, 16, dtype=FP8), torch.zeros(2, 8, 1, dtype=torch.float16)
    rows, slots = torch.randn(1, 1, 16), torch.tensor([0], dtype=torch.int32)
    for bad in ((0.0, 1.0), (1.0,), (float("inf"), 1.0), [1.0, 1.0], (1, 1.0)):
        with pytest.raises(ValueError, match="static_scales: expected"):
            kernels.store_kv(rows, rows, k8, k8.clone(), slots, k_scale=ks, v_scale=ks.clone(), static_scales=bad)
    i8, is8 = torch.zeros(2, 8, 1, 16, dtype=INT8), torch.zeros(2, 8, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="static_scales: only a float8_e4m3fn cache"):
        kernels.store_kv(rows, rows, i8, i8.clone(), slots, k_scale=is8, v_scale=is8.clone(), static_scales=(1.0, 1.0))
    assert not k8.float().any() and not ks.any()                     # nothing written by a refused call


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
def test_triton_store_quantizes_as_the_reference(cache_dtype):
    """int8: the same codes and scales bit for bit. fp8: the same scales; the CPU interpreter (Triton 3.x)
    encodes some float8 values that round up to a power of two as half of it (-128 -> -64, 2 -> 1: the
    mantissa's carry is lost), so under it those may be halved; on a GPU (and in the GPU test below)
    every code must agree."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(6)
    key, value = _rows(gen, 24, 64).view(12, 4, 32), torch.randn(12, 4, 32, generator=gen) * 3
    slots = torch.randperm(5 * 16, generator=gen)[:12].to(torch.int32)
    out = {}
    for triton_path in (False, True):
        caches = [torch.zeros(5, 16, 4, 32, dtype=cache_dtype), torch.zeros(5, 16, 4, 32, dtype=cache_dtype),
                  torch.zeros(5, 16, 4, dtype=torch.float16), torch.zeros(5, 16, 4, dtype=torch.float16)]
        k8, v8, ks, vs = _to(device if triton_path else torch.device("cpu"), *caches)
        args = _to(k8.device, key, value)
        kernels.store_kv(*args, k8, v8, slots.to(k8.device), k_scale=ks, v_scale=vs, use_triton=triton_path)
        out[triton_path] = [t.cpu() for t in (k8, v8, ks, vs)]
    (k_ref, v_ref, ks_ref, vs_ref), (k_tri, v_tri, ks_tri, vs_tri) = out[False], out[True]
    assert torch.equal(ks_ref, ks_tri) and torch.equal(vs_ref, vs_tri)
    if cache_dtype == INT8 or device.type == "cuda":
        assert torch.equal(k_ref.view(torch.uint8), k_tri.view(torch.uint8))
        assert torch.equal(v_ref.view(torch.uint8), v_tri.view(torch.uint8))
    else:
        for a, b in ((k_ref.float(), k_tri.float()), (v_ref.float(), v_tri.float())):
            power_of_two = (a != 0) & (torch.frexp(a).mantissa.abs() == 0.5)
            assert ((b == a) | (power_of_two & (b == a / 2))).all()           # the interpreter's encoding


def test_an_8bit_cache_stays_close_to_full_precision_attention():
    """How far 8-bit rows move decode attention from the full-precision oracle on the original rows
    (rows ~N(0, 1), 4 sequences up to 300 tokens): the largest absolute error over the outputs measured
    0.009-0.012 (int8) and 0.045-0.095 (fp8) over four seeds."""
    gen_seed = seed_of("kv8-accuracy")
    bounds = {INT8: 0.02, FP8: 0.15}
    for cache_dtype, bound in bounds.items():
        case, (k8, v8, ks, vs), _, _ = _quantized_case([300, 77, 150, 9], 2, 64, 16, cache_dtype, gen_seed)
        q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(8))
        out = paged_decode_reference(q, k8, v8, case.block_tables, case.seq_lens, 0.125, k_scale=ks, v_scale=vs)
        worst = max((out[i].double() - dense_attention(q[i:i + 1], case.keys[i], case.values[i], 0.125)[0])
                    .abs().max().item() for i in range(4))
        assert 0 < worst < bound, f"{cache_dtype}: {worst:.4f}"


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
def test_the_c_kernel_decodes_every_8bit_code_as_torch_does(cache_dtype):
    """Every byte value (float8 subnormals and both zeros included; the NaN codes, which the quantizer
    never writes, left out) as K and V codes of one sequence: the C kernel's conversion (SIMD widening,
    float8 bits placed in a float32) against torch's, in float32."""
    if not cpu_decode.available():
        pytest.skip("no C compiler: the CPU decode kernel is not built")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0
    gen = torch.Generator().manual_seed(14)
    k8 = codes[torch.randperm(256, generator=gen)].view(1, 16, 1, 16).view(cache_dtype)
    v8 = codes[torch.randperm(256, generator=gen)].view(1, 16, 1, 16).view(cache_dtype)
    ks, vs = (torch.rand(1, 16, 1, generator=gen) + 0.5).half(), (torch.rand(1, 16, 1, generator=gen) + 0.5).half()
    q = torch.randn(1, 2, 16, generator=gen) * 0.01
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([16], dtype=torch.int32)
    got = cpu_decode.paged_decode_cpu(q, k8, v8, tables, lens, 1.0, k_scale=ks, v_scale=vs)
    want = paged_decode_reference(q, k8, v8, tables, lens, 1.0, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 1.0


def test_store_and_attend_in_one_call_equals_the_two_calls_with_8bit():
    case, (k8, v8, ks, vs), _, _ = _quantized_case([20, 33], 2, 64, 16, INT8, seed_of("kv8-one-call"))
    gen = torch.Generator().manual_seed(9)
    q, key, value = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 2, 64, generator=gen), torch.randn(2, 2, 64)
    lens = case.seq_lens + 1
    slots = torch.stack([case.block_tables[i, int(n) // 16] * 16 + int(n) % 16
                         for i, n in enumerate(case.seq_lens)]).to(torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    results = []
    for one_call in (True, False):
        k, v, kscale, vscale = k8.clone(), v8.clone(), ks.clone(), vs.clone()
        if one_call:
            out = kernels.store_kv_and_attend(q, key, value, k, v, slots, cu, lens, case.block_tables, 0.125,
                                              max_query_len=1, k_scale=kscale, v_scale=vscale)
        else:
            kernels.store_kv(key, value, k, v, slots, k_scale=kscale, v_scale=vscale)
            out = kernels.paged_attention(q, k, v, cu, lens, case.block_tables, 0.125, max_query_len=1,
                                          k_scale=kscale, v_scale=vscale)
        results.append((out, k, kscale))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


@pytest.mark.parametrize("cache_dtype, static", [(INT8, None), (FP8, None), (FP8, (0.037, 0.2))],
                         ids=["int8", "fp8", "fp8-checkpoint-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_c_kernel_quantizes_new_8bit_rows_as_torch_does(dtype, cache_dtype, static):
    """A CPU decode step into an 8-bit cache quantizes each sequence's new rows inside the C call: the same
    codes and scales, bit for bit, as ``store_kv``'s torch quantizer, over rows from 1e-3 to 1e3 in magnitude,
    an all-zero row and one whose scale overflows float16 (float8: every e4m3 rounding case, subnormals and
    ties to even included, and with a checkpoint's scales the saturated rows)."""
    if not cpu_decode.available() or not cpu_decode.stores_rows_into(torch.zeros(1, dtype=cache_dtype)):
        pytest.skip("the C kernel cannot quantize 8-bit rows on this machine")
    gen = torch.Generator().manual_seed(15)
    n, bs = 40, 8
    key = _rows(gen, n * 2, 64).view(n, 2, 64)
    key[3, 1] = 1e8                                                     # max / QMAX beyond float16: scale 65504
    key[5, 0] = torch.tensor([(m / 8) * 2.0 ** e for e in range(-9, -5) for m in range(16)], dtype=torch.float32)
    key, value = key.to(dtype), (torch.randn(n, 2, 64, generator=gen) * 5).to(dtype)
    q = torch.randn(n, 4, 64, generator=gen).to(dtype)
    tables = torch.arange(n, dtype=torch.int32).view(n, 1)
    lens = torch.full((n,), 3, dtype=torch.int32)
    slots = (tables[:, 0] * bs + 2).to(torch.int32)
    cu = torch.arange(n + 1, dtype=torch.int32)
    static = None if static is None else tuple(static_scale(s) for s in static)
    results = []
    for one_call in (True, False):
        k8, v8 = torch.zeros(n, bs, 2, 64, dtype=cache_dtype), torch.zeros(n, bs, 2, 64, dtype=cache_dtype)
        ks, vs = torch.zeros(n, bs, 2, dtype=torch.float16), torch.zeros(n, bs, 2, dtype=torch.float16)
        if one_call:
            kernels.store_kv_and_attend(q, key, value, k8, v8, slots, cu, lens, tables, 0.125, max_query_len=1,
                                        k_scale=ks, v_scale=vs, static_scales=static)
        else:
            kernels.store_kv(key, value, k8, v8, slots, k_scale=ks, v_scale=vs, static_scales=static)
        results.append((k8.view(torch.uint8), v8.view(torch.uint8), ks, vs))
    for c, t in zip(*results):
        assert torch.equal(c, t)
    if static is None:
        assert results[0][2][3, 2, 1].item() == 65504.0 and results[0][2].min() >= 0
    else:
        assert (results[0][2][:, 2] == static[0]).all() and (results[0][3][:, 2] == static[1]).all()


def test_copy_on_write_copies_the_scales_with_the_codes():
    data = torch.randint(-127, 128, (2, 2, 5, 4, 3, 16), dtype=torch.int8)
    scales = torch.rand(2, 2, 5, 4, 3).half()
    before = data.clone(), scales.clone()
    copy_blocks(KVCache(data, scales), [(1, 3), (3, 0)])           # 0 receives the OLD content of 3
    assert torch.equal(data[:, :, 3], before[0][:, :, 1]) and torch.equal(scales[:, :, 3], before[1][:, :, 1])
    assert torch.equal(data[:, :, 0], before[0][:, :, 3]) and torch.equal(scales[:, :, 0], before[1][:, :, 3])


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "k_scale": None}, "k_scale: required with a torch.int8 cache"),
    (lambda a: {**a, "v_scale": a["v_scale"].float()}, "v_scale: expected a contiguous torch.float16"),
    (lambda a: {**a, "k_scale": a["k_scale"][:, :4]}, "k_scale: expected a contiguous"),
    (lambda a: {**a, "k_scale": a["k_scale"].transpose(0, 1).contiguous().transpose(0, 1)}, "k_scale: expected a"),
    (lambda a: {**a, "q": a["q"].to(torch.int8)}, "q: unsupported dtype torch.int8"),
    (lambda a: {**a, "k_cache": a["k_cache"].float(), "v_cache": a["v_cache"].float()},
     "k_scale: only an int8 / fp8 cache has scales"),
])
def test_bad_8bit_arguments_are_value_errors_naming_them(change, message):
    case, (k8, v8, ks, vs), _, _ = _quantized_case([20], 2, 32, 8, INT8, 11)
    args = dict(q=torch.randn(1, 4, 32), k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)
    bad = change(args)
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode(bad["q"], bad["k_cache"], bad["v_cache"], case.block_tables, case.seq_lens, 0.1,
                             k_scale=bad["k_scale"], v_scale=bad["v_scale"])


def test_store_kv_refuses_an_8bit_cache_without_scales_and_writes_nothing():
    k8, v8 = torch.zeros(2, 8, 2, 32, dtype=INT8), torch.zeros(2, 8, 2, 32, dtype=INT8)
    vs = torch.zeros(2, 8, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_scale: required with a torch.int8 cache"):
        kernels.store_kv(torch.randn(1, 2, 32), torch.randn(1, 2, 32), k8, v8, torch.tensor([3], dtype=torch.int32),
                         v_scale=vs)
    assert not k8.any() and not v8.any() and not vs.any()


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["int8", "fp8"])
def test_kv8_kernels_on_cuda_gpu(cache_dtype):
    """The Triton store writes the torch quantizer's codes and scales bit for bit (fp8 included: both
    round to nearest even); bf16 decode and prefill over the 8-bit cache match the oracle."""
    cuda = torch.device("cuda")
    case, _, _, _ = _quantized_case([300, 1000, 57], 8, 128, 16, cache_dtype, seed_of("kv8-gpu"))
    rows = case.k_cache.shape[0] * 16
    flat = case.k_cache.reshape(rows, 8, 128), case.v_cache.reshape(rows, 8, 128)
    k8 = torch.zeros(case.k_cache.shape, dtype=cache_dtype, device=cuda)
    v8, ks = torch.zeros_like(k8), torch.zeros(case.k_cache.shape[:3], dtype=torch.float16, device=cuda)
    vs = torch.zeros_like(ks)
    slots = torch.arange(rows, dtype=torch.int32, device=cuda)
    kernels.store_kv(flat[0].to(cuda), flat[1].to(cuda), k8, v8, slots, k_scale=ks, v_scale=vs)
    want_k, want_ks = quantize_rows(case.k_cache, cache_dtype)
    assert torch.equal(ks.cpu(), want_ks)
    got, want = k8.cpu().float(), want_k.float()
    differ = got != want
    assert not differ.any(), (f"{int(differ.sum())} of {got.numel()} codes differ, e.g. {got[differ][:8].tolist()} "
                              f"for {want[differ][:8].tolist()} (x / scale = "
                              f"{(case.k_cache / want_ks.float()[..., None])[differ][:8].tolist()})")
    keys = [dequantize_rows(*quantize_rows(k, cache_dtype)) for k in case.keys]
    values = [dequantize_rows(*quantize_rows(v, cache_dtype)) for v in case.values]
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(12)).bfloat16()
    tables, lens = case.block_tables.to(cuda), case.seq_lens.to(cuda)
    with warnings.catch_warnings(record=True) as caught:   # the 8-bit decode's split count from its occupancy
        warnings.simplefilter("always")
        out = kernels.paged_decode(q.to(cuda), k8, v8, tables, lens, 0.088, k_scale=ks, v_scale=vs).cpu()
    assert not [w for w in caught if "programs per SM unknown" in str(w.message)], [str(w.message) for w in caught]
    assert [n for n in decode_triton._PROGRAMS_PER_SM.values() if not (isinstance(n, int) and n >= 1)] == []
    for i in range(3):
        want = dense_attention(q[i:i + 1], keys[i], values[i], 0.088)[0]
        assert (out[i].double() - want).abs().max().item() < TOL[torch.bfloat16]
    chunk = torch.randn(200, 32, 128, generator=torch.Generator().manual_seed(13)).bfloat16()
    cu = torch.tensor([0, 200], dtype=torch.int32, device=cuda)
    out = kernels.paged_prefill(chunk.to(cuda), k8, v8, cu, lens[1:2], tables[1:2], 0.088, k_scale=ks,
                                v_scale=vs).cpu()
    want = dense_attention(chunk, keys[1], values[1], 0.088)
    assert (out.double() - want).abs().max().item() < TOL[torch.bfloat16]
