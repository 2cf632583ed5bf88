"""The timed choice between a CPU C kernel and its torch twin (``kernels/cpu/cpu_twins.py``): the decision rules
with fake timings, the on-disk cache, the override, the dispatch that obeys it, and equal values either way."""

from __future__ import annotations

import pytest
import torch
from helpers.spies import record_calls
from pagedray.kernels import fused_ops
from pagedray.kernels.cpu import cpu_choice, cpu_decode, cpu_fused, cpu_twins
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS
from pagedray.kernels.reference.attention import ROW_CHUNK_MAX, paged_prefill_reference
from pagedray.kernels.reference.fused import apply_rotary_reference, rms_norm_reference, silu_and_mul_reference

needs_library = pytest.mark.skipif(cpu_fused._library() is None or not cpu_decode.available(),
                                   reason="no C compiler to build the CPU kernels")


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """Choose by timing, with a fake clock: ``timed.ms`` maps the timed callable's C/torch side to a time;
    the cache lives in tmp_path and the process memo starts empty."""
    monkeypatch.setenv(cpu_twins.TWINS_ENV, "auto")
    monkeypatch.setattr(cpu_choice, "default_folder", lambda: tmp_path)
    cpu_twins._op_plan.cache_clear()
    cpu_twins._c_max.cache_clear()
    yield monkeypatch
    cpu_twins._op_plan.cache_clear()
    cpu_twins._c_max.cache_clear()


def test_the_c_kernel_keeps_a_bucket_unless_torch_wins_by_more_than_noise():
    assert cpu_twins.plan_from_times([1.0, 1.0, 1.0, 2.0], [0.5, 0.95, 1.0, 1.0]) == (False, True, True, False)


def test_rows_reach_the_length_before_the_first_clear_sdpa_win():
    lengths = cpu_twins.CHUNK_LENGTHS
    assert cpu_twins.c_max_from_times([1.0] * len(lengths), [1.0] * len(lengths)) == lengths[-1]
    assert cpu_twins.c_max_from_times([1.0, 1.0, 2.0, 1.0], [2.0, 1.0, 1.0, 9.0]) == lengths[1]
    assert cpu_twins.c_max_from_times([3.0], [1.0]) == 1                 # SDPA from the shortest
    assert cpu_twins.c_max_from_times([1.0, 1.05], [1.0, 1.0]) == lengths[1]   # within noise: rows


def test_the_environment_forces_either_side(monkeypatch):
    x = torch.randn(4, 64)
    monkeypatch.setenv(cpu_twins.TWINS_ENV, "c")
    assert cpu_twins.prefer_c("rms_norm", x) and cpu_twins.prefill_c_max(torch.float32, 4, 2, 64) == ROW_CHUNK_MAX
    monkeypatch.setenv(cpu_twins.TWINS_ENV, "torch")
    assert not cpu_twins.prefer_c("silu_mul", x) and cpu_twins.prefill_c_max(torch.float32, 4, 2, 64) == 1
    monkeypatch.setenv(cpu_twins.TWINS_ENV, "fast")
    with pytest.raises(ValueError, match=cpu_twins.TWINS_ENV):
        cpu_twins.prefer_c("rms_norm", x)


def test_an_op_is_timed_once_per_row_shape_then_read_from_disk(timed):
    sides = []

    def fake_ms(run, repeats=cpu_twins.REPEATS):
        side = "c" if len(sides) % 2 == 0 else "torch"      # _op_plan times C, then torch, per bucket
        sides.append(side)
        bucket = (len(sides) - 1) // 2 % len(ROW_BUCKETS)
        return 1.0 if side == "c" else (0.5 if ROW_BUCKETS[bucket] >= 512 else 2.0)   # torch wins from 512 rows

    timed.setattr(cpu_twins, "median_ms", fake_ms)
    rows = {r: torch.randn(r, 576) for r in (1, 100, 700, 3000)}
    assert [cpu_twins.prefer_c("rms_norm", x) for x in rows.values()] == [True, True, False, False]
    assert len(sides) == 2 * len(ROW_BUCKETS)                # one timing pass for the (op, dtype, row shape)
    cpu_twins.prefer_c("rms_norm", torch.randn(3, 64))       # another row shape: timed again
    assert len(sides) == 4 * len(ROW_BUCKETS)

    cpu_twins._op_plan.cache_clear()                          # a new process: the decision comes from disk
    timed.setattr(cpu_twins, "median_ms", lambda *a, **k: pytest.fail("timed again"))
    assert [cpu_twins.prefer_c("rms_norm", x) for x in rows.values()] == [True, True, False, False]
    with pytest.raises(ValueError, match="op"):
        cpu_twins.prefer_c("softmax", rows[1])


@needs_library
def test_prefill_rows_stop_timing_at_the_first_sdpa_win(timed):
    lengths = []

    def fake_ms(run, repeats=cpu_twins.REPEATS):
        lengths.append(len(lengths))
        step = (len(lengths) - 1) // 2                       # rows, then SDPA, per chunk length
        rows_side = len(lengths) % 2 == 1
        return 1.0 if rows_side else (2.0 if step < 2 else 0.5)   # SDPA wins from the third length

    timed.setattr(cpu_twins, "median_ms", fake_ms)
    assert cpu_twins.prefill_c_max(torch.float32, 4, 2, 16) == cpu_twins.CHUNK_LENGTHS[1]
    assert len(lengths) == 6                                  # the three lengths up to the first SDPA win
    cpu_twins._c_max.cache_clear()
    timed.setattr(cpu_twins, "median_ms", lambda *a, **k: pytest.fail("timed again"))
    assert cpu_twins.prefill_c_max(torch.float32, 4, 2, 16) == cpu_twins.CHUNK_LENGTHS[1]


@needs_library
def test_fused_ops_run_the_side_the_choice_names(monkeypatch):
    calls = record_calls(monkeypatch, cpu_fused, ("rms_norm_cpu", "apply_rotary_cpu", "silu_and_mul_cpu"))
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(6, 128, generator=gen).bfloat16(), torch.randn(128, generator=gen).bfloat16()
    qk = torch.randn(6, 3, 64, generator=gen).bfloat16()
    cos, sin = (torch.randn(6, 1, 64, generator=gen).bfloat16() for _ in range(2))
    results = {}
    for side in ("c", "torch"):
        monkeypatch.setenv(cpu_twins.TWINS_ENV, side)
        calls.clear()
        results[side] = (fused_ops.rms_norm(x, weight, 1e-6, x.flip(0)), fused_ops.apply_rotary(qk, cos, sin),
                         fused_ops.silu_and_mul(x))
        assert calls == ([] if side == "torch" else ["rms_norm_cpu", "apply_rotary_cpu", "silu_and_mul_cpu"])
    (c_norm, c_res), c_rot, c_silu = results["c"]
    (t_norm, t_res), t_rot, t_silu = results["torch"]
    assert torch.equal(c_norm, t_norm) and torch.equal(c_res, t_res) and torch.equal(c_rot, t_rot)  # bf16: exact
    torch.testing.assert_close(c_silu.float(), t_silu.float(), rtol=2 ** -7, atol=0)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_prefill_values_do_not_depend_on_the_rows_length(dtype):
    """Whatever length the timing picks, a step's attention has the same values (up to summation order)."""
    gen = torch.Generator().manual_seed(11)
    chunks = [(0, 40), (24, 9), (0, 130), (7, 1)]                    # (history, new tokens) per sequence
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 64
    lens = [h + n for h, n in chunks]
    per_seq = max(-(-n // block_size) for n in lens)
    k_cache, v_cache = (torch.randn(len(chunks) * per_seq + 1, block_size, kv_heads, head_dim, generator=gen)
                        .to(dtype) for _ in range(2))
    table = torch.arange(1, len(chunks) * per_seq + 1, dtype=torch.int32).view(len(chunks), per_seq)
    q = torch.randn(sum(n for _, n in chunks), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    outs = [paged_prefill_reference(q, k_cache, v_cache, cu, seq_lens, table, 0.125,
                                    decode_rows=cpu_decode.paged_decode_cpu, row_chunk_max=m).float()
            for m in (1, 16, 64, ROW_CHUNK_MAX)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=tol, atol=tol)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", ROW_BUCKETS)
def test_both_twins_agree_at_every_timed_row_count(dtype, rows):
    """What the timing may pick at each bucket gives the same values: fp32 within the last bits (the C sum of
    squares and exp differ in order / polynomial from torch's, whose reduction order follows the CPU's vector
    width); bf16 within one bf16 ulp, the rounding of those float32 values (an element whose float32 value lies
    at a rounding boundary can round either way: 1 of 16,384 at 256 rows on an AVX2 AMD EPYC)."""
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 64, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(64, generator=gen).to(dtype)
    heads = torch.randn(rows, 3, 64, generator=gen).to(dtype)
    cos, sin = (torch.randn(rows, 1, 64, generator=gen).to(dtype) for _ in range(2))
    gate_up = (torch.randn(rows, 128, generator=gen) * 4).to(dtype)
    pairs = [(cpu_fused.rms_norm_cpu(x, weight, 1e-6, residual)[0], rms_norm_reference(x, weight, 1e-6, residual)[0]),
             (cpu_fused.apply_rotary_cpu(heads, cos, sin), apply_rotary_reference(heads, cos, sin))]
    for got, expected in pairs:
        if dtype == torch.bfloat16:   # one ulp of a bf16 value v is at most 2^-7 |v|
            torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)
            assert (got != expected).float().mean() < 1e-3      # and that only where the rounding is a tie-break
        else:
            torch.testing.assert_close(got, expected, rtol=2 ** -20, atol=0)
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    torch.testing.assert_close(cpu_fused.silu_and_mul_cpu(gate_up).float(), silu_and_mul_reference(gate_up).float(),
                               rtol=rtol, atol=1e-30)
