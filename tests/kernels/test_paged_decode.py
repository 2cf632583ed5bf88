"""Paged decode (Triton kernel and torch reference) against the float64 dense oracle.

CPU runs the Triton kernel under TRITON_INTERPRET=1 with tiny shapes; the ``gpu`` variants use larger
shapes and bf16. ``num_splits`` forces the split-KV path (None = the automatic choice through the
public wrapper); splits outnumbering a sequence's tiles leave empty splits that must not produce NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from helpers.paged_kv_cases import (
    alibi_like_slopes,
    assert_close_to_oracle,
    dense_attention,
    kernel_device,
    make_paged_case,
    nan_like,
    seed_of,
)
from pagedray.kernels import paged_decode, paged_decode_reference
from pagedray.kernels.triton.decode_triton import choose_num_splits, paged_decode_triton
from pagedray.kernels.triton.occupancy import programs_per_sm, wave_num_splits


@dataclass(frozen=True)
class DecodeSpec:
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    seq_lens: tuple
    alibi: bool = False
    window: int | None = None
    num_splits: int | None = None


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU_SPECS = [
    DecodeSpec(4, 4, 64, 16, F32, (1, 16, 33, 200)),                                 # GQA 1, auto splits
    DecodeSpec(4, 2, 96, 8, F16, (5, 64, 129), alibi=True, num_splits=3),            # GQA 2, head_dim 96
    DecodeSpec(8, 2, 128, 32, F32, (300, 7), window=50, num_splits=4),               # GQA 4, window
    DecodeSpec(16, 2, 64, 64, F16, (100, 1, 65), alibi=True, window=30, num_splits=2),  # GQA 8
    DecodeSpec(4, 1, 128, 16, F16, (250, 18)),                                       # MQA
    DecodeSpec(6, 2, 64, 16, F32, (40, 90), alibi=True, num_splits=5),               # group 3, empty splits
    DecodeSpec(2, 1, 64, 16, F32, (1, 3), window=1, num_splits=4),                   # one key per query
    DecodeSpec(2, 1, 512, 16, F32, (20, 37), num_splits=2),                          # Gemma 4's head_dim 512
]
GPU_SPECS = [
    DecodeSpec(32, 8, 128, 16, BF16, (1, 17, 512, 2049, 4000, 100, 8191, 33)),
    DecodeSpec(32, 8, 128, 16, F16, (3000, 1, 64, 777), alibi=True),
    DecodeSpec(32, 4, 96, 32, F32, (1500, 20, 4097), window=1000),
    DecodeSpec(16, 1, 64, 64, BF16, tuple(range(1, 2000, 97)), alibi=True, num_splits=7),
    DecodeSpec(8, 8, 128, 8, F16, (9000, 5), num_splits=16),
    DecodeSpec(16, 2, 512, 16, BF16, (1, 700, 3000), window=1024),                  # Gemma 4's full layers
]


def _run_decode(spec: DecodeSpec, impl: str, seed: int, config: dict | None = None) -> None:
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, list(spec.seq_lens), spec.kv_heads, spec.head_dim, spec.block_size,
                           spec.dtype, device)
    q = torch.randn((len(spec.seq_lens), spec.q_heads, spec.head_dim), generator=gen).to(spec.dtype)
    q = q.to(device)
    scale = 1.0 / math.sqrt(spec.head_dim)
    slopes = alibi_like_slopes(spec.q_heads, device) if spec.alibi else None
    out = nan_like(q.shape, spec.dtype, device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, slopes, spec.window, out)
    if impl == "reference":
        result = paged_decode_reference(*args)
    elif spec.num_splits is None and config is None:
        result = paged_decode(*args, use_triton=True, validate_values=True)
    else:
        result = paged_decode_triton(*args, num_splits=spec.num_splits, config=config)
    assert result is out
    expected = torch.cat([
        dense_attention(q[i:i + 1], case.keys[i], case.values[i], scale, slopes, spec.window)
        for i in range(len(spec.seq_lens))
    ])
    assert_close_to_oracle(out, expected, spec.dtype)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: f"g{s.q_heads // s.kv_heads}-d{s.head_dim}"
                         f"-b{s.block_size}-{str(s.dtype)[6:]}-s{s.num_splits}")
def test_decode_matches_dense_oracle(spec, impl):
    _run_decode(spec, impl, seed=seed_of(spec, impl))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_decode_matches_dense_oracle_gpu(spec, impl):
    _run_decode(spec, impl, seed=seed_of(spec, impl))


def _keys_major(spec: DecodeSpec) -> dict:
    """The keys-major kernel's config (``tile_keys_major_triton``): query heads padded to 8 columns."""
    return dict(KEYS_MAJOR=True, BLOCK_G=max(8, 1 << (spec.q_heads // spec.kv_heads - 1).bit_length()))


@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: f"g{s.q_heads // s.kv_heads}-d{s.head_dim}"
                         f"-b{s.block_size}-{str(s.dtype)[6:]}-s{s.num_splits}")
def test_keys_major_decode_matches_dense_oracle(spec):
    """Scores as K @ q^T (keys-major): every GQA group, ALiBi, windows, forced and empty splits, as the oracle."""
    _run_decode(spec, "triton", seed=seed_of(spec, "keys-major"), config=_keys_major(spec))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_keys_major_decode_matches_dense_oracle_gpu(spec):
    _run_decode(spec, "triton", seed=seed_of(spec, "keys-major"), config=_keys_major(spec))


def test_a_config_with_fewer_rows_than_the_group_is_a_value_error():
    device = kernel_device()
    case = make_paged_case(torch.Generator().manual_seed(2), [20], 1, 64, 16, F32, device)
    q = torch.randn((1, 16, 64)).to(device)                 # 16 query heads on one KV head
    out = nan_like(q.shape, F32, device)
    for rows in (8, 24):                                    # too few; not a power of two
        with pytest.raises(ValueError, match=f"config: BLOCK_G {rows} must be a power of two holding the 16 query"):
            paged_decode_triton(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1, out=out,
                                config=dict(KEYS_MAJOR=True, BLOCK_G=rows))
    assert torch.isnan(out).all()                           # nothing launched, nothing written


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_empty_sequence_outputs_zeros(impl):
    """seq_len 0 has no visible key: the row is zeros (not NaN) and the other rows are unaffected."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(11)
    case = make_paged_case(gen, [0, 40], 2, 64, 16, F32, device)
    q = torch.randn((2, 4, 64), generator=gen).to(device)
    out = nan_like(q.shape, F32, device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, None, None, out)
    if impl == "triton":
        paged_decode_triton(*args, num_splits=3)
    else:
        paged_decode_reference(*args)
    assert torch.equal(out[0].cpu(), torch.zeros(4, 64))
    assert_close_to_oracle(out[1:], dense_attention(q[1:], case.keys[1], case.values[1], 0.125), F32)


def test_choose_num_splits():
    # 1 seq x 8 KV heads on 132 SMs wants ceil(264 / 8) = 33 splits; 32k context allows 128 -> 33.
    assert choose_num_splits(1, 8, 32768, 132) == 33
    # The same batch at 512 tokens of context: at most 512 // 256 = 2 splits.
    assert choose_num_splits(1, 8, 512, 132) == 2
    # 64 seqs x 8 heads = 512 programs >= 2 waves of 132 SMs: no split.
    assert choose_num_splits(64, 8, 8192, 132) == 1
    # 8 seqs x 8 heads = 64 programs -> ceil(264 / 64) = 5 splits.
    assert choose_num_splits(8, 8, 8192, 132) == 5
    # Never more than 64 splits, never fewer than 1.
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64
    assert choose_num_splits(1, 1, 10, 132) == 1


def test_choose_num_splits_with_the_programs_an_sm_holds_fills_whole_waves():
    """The 8-bit decode on an H100 / H200 (132 SMs, 3 programs of 128-key tiles per SM: 396 at once)."""
    # batch 64 x 8 KV heads = 512 programs: 1 split runs 2 waves, the second 29% full; 3 splits 4 waves 97%
    assert choose_num_splits(64, 8, 8192, 132, programs_per_sm=3) == 3
    # 4 per SM (528 at once): 512 programs are one wave, nothing to gain by splitting
    assert choose_num_splits(64, 8, 8192, 132, programs_per_sm=4) == 1
    # 8 x 8 = 64 programs: 6 splits make 384 programs, one wave; the context allows 32
    assert choose_num_splits(8, 8, 8192, 132, programs_per_sm=3) == 6
    # a short context bounds it as before (512 // 256 = 2)
    assert choose_num_splits(8, 8, 512, 132, programs_per_sm=3) == 2


def test_wave_num_splits_takes_the_fewest_splits_within_the_slack():
    # 2,048 programs on 396 slots: 1 split 6 waves for 5.17 of work (16% lost), 2 splits 11 for 10.3,
    # 3 splits 16 for 15.5 (3% lost, within WAVE_SLACK of the best)
    assert wave_num_splits(2048, 396, 32) == 3
    assert wave_num_splits(396, 396, 32) == 1          # exactly one full wave
    assert wave_num_splits(397, 396, 1) == 1           # no room to split
    with pytest.raises(ValueError, match="programs, slots, most"):
        wave_num_splits(0, 396, 4)


@pytest.mark.parametrize("registers, shared, warps, expected", [
    (168, 72 * 1024, 4, 3),      # 8-bit decode, 128-key tiles: shared memory (3 x 73 KiB of 228) and registers
    (128, 38 * 1024, 4, 4),      # bf16 decode, 64-key tiles: registers (4 x 128 x 128 of 65,536)
    (255, 20 * 1024, 1, 8),      # one warp, 255 registers: 8,192 a warp, 8 per SM
    (40, 0, 1, 32),              # at most 32 programs
    (0, 200 * 1024, 8, 1),       # registers unknown: shared memory decides
])
def test_programs_per_sm_under_the_sm90_limits(registers, shared, warps, expected):
    assert programs_per_sm(registers, shared, warps) == expected


def test_resident_programs_reads_the_compiled_kernel_and_the_devices_limits(monkeypatch):
    """A stand-in for a Triton CompiledKernel and for the driver's device properties (what a GPU reports)."""
    import types

    import triton
    from pagedray.kernels.triton import occupancy

    loaded = []
    compiled = types.SimpleNamespace(n_regs=168, metadata=types.SimpleNamespace(shared=72 * 1024),
                                     _init_handles=lambda: loaded.append(True))
    limits = {"max_shared_mem": 227 * 1024, "max_num_regs": 65536, "multiprocessor_count": 132, "warpSize": 32}
    utils = types.SimpleNamespace(get_device_properties=lambda index: limits)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))   # behind .active
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(max_threads_per_multi_processor=2048))
    device = types.SimpleNamespace(index=0)
    assert occupancy.resident_programs(compiled, 4, device) == 3 and loaded == [True]
    limits["max_shared_mem"] = 99 * 1024      # an sm_86 card: 100 KiB per SM, 1 program of 73 KiB
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(max_threads_per_multi_processor=1536))
    assert occupancy.resident_programs(compiled, 4, device) == 1


def test_an_unknown_occupancy_falls_back_to_the_two_per_sm_rule_once_with_a_warning(monkeypatch):
    from pagedray.kernels.triton import decode_triton

    monkeypatch.setattr(decode_triton, "_PROGRAMS_PER_SM", {})
    compiles = []

    def failing_compile():
        compiles.append(True)
        raise AttributeError("CompiledKernel has no n_regs")

    q, k_cache = torch.zeros(2, 8, 64), torch.zeros(4, 16, 2, 64)
    with pytest.warns(RuntimeWarning, match="programs per SM unknown .AttributeError: CompiledKernel has no n_regs"):
        assert decode_triton._programs_per_sm(failing_compile, {"num_warps": 4}, q, k_cache, 64, 4, 16) is None
    assert decode_triton._programs_per_sm(failing_compile, {"num_warps": 4}, q, k_cache, 64, 4, 16) is None
    assert compiles == [True]                       # asked once per configuration
    monkeypatch.setattr(decode_triton, "resident_programs", lambda compiled, warps, device: 3)
    assert decode_triton._programs_per_sm(lambda: "compiled", {"num_warps": 2}, q, k_cache, 64, 4, 16) == 3
