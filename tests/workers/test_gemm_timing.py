"""The linear products chosen by timing (``layers/gemm_timing.py``) and the one-call decode path settled by
timing (``models/cpu_decode_layers.settle``): with fake timings the faster product wins per row bucket, the
decisions are cached and re-timed when the key changes, a forced product needs no timing; every product
equals a float64 product at every row bucket; greedy tokens equal transformers' whatever the choice."""

from __future__ import annotations

import functools
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.hf_oracle import hf_greedy_each
from helpers.worker_setup import local_driver
from pagedray.cluster import LLM, SamplingParams
from pagedray.kernels.cpu import cpu_choice, cpu_gemm, cpu_layers
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS, ChoiceCache
from pagedray.workers.layers import gemm_timing, packed_gemm
from pagedray.workers.models import cpu_decode_layers, model_loading
from torch import nn

needs_onednn = pytest.mark.skipif(not packed_gemm.packed_gemm_available(torch.float32),
                                  reason="torch has no oneDNN packed GEMM")
needs_layers = pytest.mark.skipif(not cpu_layers.available(torch.float32),
                                  reason="the CPU C kernels are not built here (no compiler, no AVX-512 or AVX2)")


@pytest.fixture(autouse=True)
def timed_choice(monkeypatch, tmp_path):
    """These tests choose by timing: no forced product, and a cache of their own."""
    monkeypatch.delenv(cpu_choice.PRODUCT_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class _Slot(nn.Module):
    def __init__(self, out_features: int, in_features: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features, generator=gen) * 0.05, requires_grad=False)
        self.packed_weight = None


class _Model(nn.Module):
    """Two layers of two shapes, and an LM head of a third."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.layers = nn.ModuleList([nn.ModuleList([_Slot(48, 32, gen), _Slot(32, 64, gen)]) for _ in range(2)])
        self.lm_head = _Slot(96, 32, gen)


@pytest.fixture
def any_cpu(monkeypatch):
    """The plan's logic on every CPU: the C GEMM, oneDNN and MKL all "run" every weight (the fake clock times
    them), whatever this CPU has; an operand is a stand-in that knows its weight's shape."""
    monkeypatch.setattr(gemm_timing, "candidates", lambda weight: ("c", "onednn", "mkl"))
    monkeypatch.setattr(gemm_timing, "_operand", lambda product, weight: SimpleNamespace(
        out_features=weight.shape[0], in_features=weight.shape[1]))


class _FakeClock:
    """``run_product`` advances the clock by ``cost(product, rows, shape)`` ms; ``timer`` reads it in seconds."""

    def __init__(self, cost) -> None:
        self.now, self.cost, self.calls = 0.0, cost, []

    def run(self, product, x, operand, silu=False):
        shape = (operand.out_features, operand.in_features) if product == "c" else None
        self.calls.append(product)
        self.now += self.cost(product, x.shape[0], shape) / 1e3

    def timer(self) -> float:
        return self.now


def _c_fast_below_128(product, rows, shape):
    return {"c": 1.0 if rows < 128 else 3.0, "onednn": 2.0, "mkl": 2.5}[product]


def test_the_faster_product_is_chosen_per_row_bucket_and_cached(any_cpu, monkeypatch, tmp_path):
    clock = _FakeClock(_c_fast_below_128)
    monkeypatch.setattr(gemm_timing, "run_product", clock.run)
    model, cache = _Model(), ChoiceCache(tmp_path, key="k1")
    table = gemm_timing.plan_table(model, "auto", max_num_seqs=16, cache=cache, timer=clock.timer)
    assert table.source.startswith("timed")
    want = tuple("c" if rows < 128 else "onednn" for rows in ROW_BUCKETS)
    assert table.shapes[(48, 32)].plan == want and table.shapes[(32, 64)].plan == want
    # the LM head is timed only up to max_num_seqs (16 rows); the buckets above take the 16-row decision
    head = table.shapes[(96, 32)]
    assert head.plan == ("c",) * len(ROW_BUCKETS)
    assert all(t == float("inf") for t in head.times["c"][3:]) and head.times["c"][2] == pytest.approx(1.0)
    assert table.shapes[(48, 32)].times["onednn"][0] == pytest.approx(2.0)
    assert "48x32" in table.format() and "onednn" in table.format()
    # a second load on the same CPU / torch / kernels times nothing
    clock.calls.clear()
    again = gemm_timing.plan_table(_Model(), "auto", max_num_seqs=16, cache=cache, timer=clock.timer)
    assert again.source == "cached" and clock.calls == [] and again.shapes == table.shapes
    # another key (CPU model, flags, torch version or kernel source changed): timed again
    again = gemm_timing.plan_table(_Model(), "auto", max_num_seqs=16, cache=ChoiceCache(tmp_path, key="k2"),
                                   timer=clock.timer)
    assert again.source.startswith("timed") and clock.calls
    # another max_num_seqs is another LM head entry: timed again
    clock.calls.clear()
    gemm_timing.plan_table(_Model(), "auto", max_num_seqs=200, cache=cache, timer=clock.timer)
    assert clock.calls


def test_prefill_buckets_take_the_median_of_more_rounds_so_a_noisy_stretch_does_not_decide(any_cpu, monkeypatch):
    """The C GEMM is faster (1 ms against oneDNN's 2), but its first three timed prefill rounds of each shape
    hit a noisy stretch (9 ms): with REPEATS rounds that would be the median; with 2 * REPEATS + 1 it is not."""
    seen: dict[tuple, int] = {}

    def cost(product, rows, shape):
        if product != "c" or rows <= gemm_timing.COLD_ROWS:
            return {"c": 1.0, "onednn": 2.0, "mkl": 3.0}[product]
        calls = seen[(rows, shape)] = seen.get((rows, shape), 0) + 1
        return 9.0 if 1 < calls <= 1 + gemm_timing.REPEATS else 1.0   # one module per shape; call 1: the warm-up

    clock = _FakeClock(cost)
    monkeypatch.setattr(gemm_timing, "run_product", clock.run)
    model = _Model()
    times = gemm_timing.time_products([model.layers[0][0], model.layers[1][0]], {(48, 32): 2048},
                                      timer=clock.timer)[(48, 32)]
    prefill = [b for b, rows in enumerate(ROW_BUCKETS) if rows > gemm_timing.COLD_ROWS]
    refined = [b for b in prefill if ROW_BUCKETS[b] in gemm_timing.REFINED_ROWS]
    assert all(times["c"][b] == pytest.approx(1.0) for b in prefill if b not in refined)
    assert all(times["c"][b] == math.inf for b in refined)     # between buckets that agree: not timed
    assert gemm_timing._plan(times) == ("c",) * len(ROW_BUCKETS)
    # rounds per bucket: decode buckets a warm-up + REPEATS, prefill buckets a warm-up + 2 * REPEATS + 1
    assert all(seen[(ROW_BUCKETS[b], (48, 32))] == 2 * gemm_timing.REPEATS + 2 for b in prefill if b not in refined)


def test_a_close_prefill_call_is_timed_again_at_the_end_and_decided_on_the_longer_record(any_cpu, monkeypatch):
    """Shape 48x32: in its bucket rounds the C GEMM looks within the margin of oneDNN (2.05 against 2.0 ms),
    which would keep it; in the later rounds it takes 2.6 ms (its cost in a step), and over both records
    oneDNN is faster by more than the margin. Shape 32x64 (C 1 ms, oneDNN 2: not close) and the decode
    buckets get no more rounds."""
    seen: dict[tuple, int] = {}

    def cost(product, rows, shape):
        if product == "c":
            calls = seen[(rows, shape)] = seen.get((rows, shape), 0) + 1
            if shape == (32, 64) or rows <= gemm_timing.COLD_ROWS:
                return 1.0
            return 2.05 if calls <= 2 * gemm_timing.REPEATS + 2 else 2.6   # the bucket's warm-up + rounds, then later
        return {"onednn": 2.0, "mkl": 3.0}[product]

    clock = _FakeClock(cost)
    monkeypatch.setattr(gemm_timing, "run_product", clock.run)
    model = _Model()
    modules = [model.layers[0][0], model.layers[0][1]]
    times = gemm_timing.time_products(modules, {(48, 32): 2048, (32, 64): 2048}, timer=clock.timer)
    prefill = [b for b, rows in enumerate(ROW_BUCKETS) if rows > gemm_timing.COLD_ROWS]
    rounds = 2 * gemm_timing.REPEATS + 1
    for b in prefill:
        rows = ROW_BUCKETS[b]
        if rows in (256, 1024):     # refined buckets between two oneDNN buckets (48x32), two C ones (32x64)
            assert (rows, (48, 32)) not in seen and (rows, (32, 64)) not in seen
            continue
        # 64 rows: a refined bucket between the C GEMM's 32 and oneDNN's 128, so timed, and close again
        assert seen[(rows, (48, 32))] == 1 + rounds + gemm_timing.CLOSE_ROUNDS
        assert seen.get((rows, (32, 64)), 0) == (0 if rows == 64 else 1 + rounds)
        assert times[(48, 32)]["c"][b] > gemm_timing.C_MARGIN * times[(48, 32)]["onednn"][b]
    assert all(seen[(rows, (48, 32))] == 1 + gemm_timing.REPEATS for rows in ROW_BUCKETS if rows <= 32)
    plan = gemm_timing._plan(times[(48, 32)])
    assert plan == tuple("onednn" if b in prefill else "c" for b in range(len(ROW_BUCKETS)))
    assert gemm_timing._plan(times[(32, 64)]) == ("c",) * len(ROW_BUCKETS)


def test_a_bucket_between_two_that_chose_differently_is_timed_and_one_between_two_that_agree_is_not(any_cpu,
                                                                                                    monkeypatch):
    """48x32: the C GEMM is faster up to 200 rows, oneDNN from there, so 128 rows take the C GEMM and 512 oneDNN:
    the 256-row bucket between them is timed (oneDNN wins it, as a call of 256 rows would run), while 64 and
    1,024 rows, between buckets that agree, are not (they take their neighbours' product). 32x64: the C GEMM
    everywhere, no bucket of REFINED_ROWS timed."""
    seen: dict[tuple, int] = {}

    def cost(product, rows, shape):
        if product == "c":
            seen[(rows, shape)] = seen.get((rows, shape), 0) + 1
            return 1.0 if shape == (32, 64) or rows < 200 else 3.0
        return {"onednn": 2.0, "mkl": 9.0}[product]

    clock = _FakeClock(cost)
    monkeypatch.setattr(gemm_timing, "run_product", clock.run)
    model = _Model()
    times = gemm_timing.time_products([model.layers[0][0], model.layers[0][1]], {(48, 32): 2048, (32, 64): 2048},
                                      timer=clock.timer)
    assert set(gemm_timing.REFINED_ROWS) == {64, 256, 1024} and set(gemm_timing.REFINED_ROWS) < set(ROW_BUCKETS)
    # time_products compares a refined bucket's two neighbours: both must be timed buckets (never refined, never
    # past the ends)
    refined = [b for b, rows in enumerate(ROW_BUCKETS) if rows in gemm_timing.REFINED_ROWS]
    assert all(0 < b < len(ROW_BUCKETS) - 1 and {b - 1, b + 1}.isdisjoint(refined) for b in refined)
    assert seen[(256, (48, 32))] == 2 * gemm_timing.REPEATS + 2              # a warm-up and a prefill bucket's rounds
    assert not {key for key in seen if key[0] in (64, 1024) or (key[0] == 256 and key[1] == (32, 64))}
    at = {rows: b for b, rows in enumerate(ROW_BUCKETS)}
    assert times[(48, 32)]["onednn"][at[256]] == pytest.approx(2.0)
    assert times[(48, 32)]["c"][at[256]] == pytest.approx(3.0)
    assert times[(48, 32)]["c"][at[1024]] == math.inf and times[(32, 64)]["c"][at[256]] == math.inf
    plan = dict(zip(ROW_BUCKETS, gemm_timing._plan(times[(48, 32)])))
    assert plan == {rows: "c" if rows < 200 else "onednn" for rows in ROW_BUCKETS}
    assert gemm_timing._plan(times[(32, 64)]) == ("c",) * len(ROW_BUCKETS)


@needs_onednn
@pytest.mark.skipif(not cpu_gemm.available(torch.float32), reason="neither AVX-512 nor AVX2 for kernels.cpu_gemm")
def test_a_gate_up_projection_is_timed_with_its_activation_under_a_plan_of_its_own(monkeypatch, tmp_path):
    """A 64x32 weight that SiLU * up follows and a plain one of the same shape: the first is timed with the
    activation (the C GEMM fused) and gets its own plan, "+silu" in the table; the plain one keeps its own."""
    silu_calls, real = [], gemm_timing.run_product

    def run(product, x, operand, silu=False):
        silu_calls.append(silu)
        y = real(product, x, operand, silu)
        costs = {"c": 1.0, "onednn": 2.0, "mkl": 3.0} if silu else {"c": 3.0, "onednn": 2.0, "mkl": 2.5}
        clock.now += costs[product] / 1e3
        return y

    clock = _FakeClock(None)
    monkeypatch.setattr(gemm_timing, "run_product", run)
    gen = torch.Generator().manual_seed(5)
    gate_up, plain = _Slot(64, 32, gen), _Slot(64, 32, gen)
    gate_up.silu_after = True
    model = nn.ModuleList([gate_up, plain])
    table = gemm_timing.plan_table(model, "auto", max_num_seqs=16, cache=ChoiceCache(tmp_path, key="k"),
                                   timer=clock.timer)
    assert set(table.shapes) == {(64, 32, gemm_timing.SILU), (64, 32)}
    assert table.plan(gate_up) == ("c",) * len(ROW_BUCKETS) and table.plan(plain) == ("onednn",) * len(ROW_BUCKETS)
    assert True in silu_calls and False in silu_calls
    assert "64x32+silu" in table.format()
    # with LoRA slots the layer never fuses (the delta goes before the activation): it is timed as a plain weight
    gate_up.lora = object()
    assert gemm_timing.plan_key(gate_up) == (64, 32) and table.plan(plain) == ("onednn",) * len(ROW_BUCKETS)
    # the timed call really is the fused pass: SiLU * up of the product's halves
    x = torch.randn(5, 32)
    fused = real("c", x, cpu_gemm.pack(gate_up.weight), True)
    assert torch.equal(fused, cpu_gemm.silu_mul_linear(x, cpu_gemm.pack(gate_up.weight))) and fused.shape == (5, 32)


@pytest.mark.parametrize("c_ms, want", [(2.0, "c"), (2.1, "c"), (2.2, "onednn"), (1.5, "c")])
def test_another_product_takes_a_bucket_from_the_c_gemm_only_when_faster_by_more_than_the_margin(c_ms, want):
    # onednn 2.0 ms in every bucket; mkl slower everywhere; the C GEMM at c_ms (C_MARGIN = 1.05: 2.1 is within it)
    times = {"c": (c_ms,) * len(ROW_BUCKETS), "onednn": (2.0,) * len(ROW_BUCKETS), "mkl": (9.0,) * len(ROW_BUCKETS)}
    assert gemm_timing._plan(times) == (want,) * len(ROW_BUCKETS)
    # without the C GEMM among the candidates, the fastest wins
    n = len(ROW_BUCKETS)
    assert gemm_timing._plan({"onednn": (2.0,) * n, "mkl": (1.9,) * n}) == ("mkl",) * n
    # a bucket the C GEMM was not timed at (inf) is another product's, then filled as before
    partial = {"c": (1.0,) * (n - 2) + (math.inf,) * 2, "onednn": (2.0,) * (n - 2) + (math.inf,) * 2}
    assert gemm_timing._plan(partial) == ("c",) * n


@needs_onednn
def test_a_forced_product_times_nothing_and_a_product_that_cannot_run_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_timing, "run_product", lambda *a: pytest.fail("timed a forced product"))
    cache = ChoiceCache(tmp_path, key="k")
    table = gemm_timing.plan_table(_Model(), "onednn", 16, cache=cache)
    assert table.source == "forced by cpu_gemm=onednn"
    assert all(s.plan == ("onednn",) * len(ROW_BUCKETS) for s in table.shapes.values())
    monkeypatch.setenv(cpu_choice.PRODUCT_ENV, "mkl")
    assert gemm_timing.plan_table(_Model(), "auto", 16, cache=cache).source == "forced by PAGEDRAY_CPU_GEMM=mkl"
    with pytest.raises(ValueError, match="^PAGEDRAY_CPU_GEMM: 'mkl' cannot run a torch.bfloat16"):
        gemm_timing.plan_table(_Model().bfloat16(), "auto", 16, cache=cache)
    assert cache.entries() == {}


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_product_equals_a_float64_product_at_every_row_bucket(dtype, torch_threads):
    if not packed_gemm.packed_gemm_available(dtype):
        pytest.skip(f"oneDNN has no {dtype} GEMM on this CPU")
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(80, 96, generator=gen) * 0.05).to(dtype)             # [out, in]
    bias = torch.randn(80, generator=gen).to(dtype)                            # [out]
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for product in packed_gemm.candidates(weight):
        packed = packed_gemm.pack_weight(weight, product)
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, 96, generator=gen).to(dtype)                 # [rows, in]
            want = (x.double() @ weight.double().T + bias.double()).to(dtype)
            got = packed_gemm.linear(x, weight, bias, packed)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, **tolerance, msg=f"{product} at {rows} rows")


PROMPTS = [[(5 * i + j) % 240 + 3 for j in range(4 + 3 * i)] for i in range(6)]


@needs_onednn
@pytest.mark.parametrize("product", ["auto", "c", "onednn", "mkl"])
def test_greedy_tokens_equal_transformers_whatever_the_product(product, tiny_model_path, monkeypatch):
    if product == "c" and not cpu_gemm.available(torch.float32):
        pytest.skip("neither AVX-512 nor AVX2 for kernels.cpu_gemm")
    path = tiny_model_path("llama")
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=128, threads_per_worker=1, max_num_seqs=8,
              max_num_batched_tokens=16, cpu_gemm=product)
    try:
        table = llm.engine.executor.worker.pack_report.table
        assert table.source.startswith("timed" if product == "auto" else "forced")
        results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in results] == hf_greedy_each(path, PROMPTS, 12)


def _onednn_wins(product, rows, shape):
    return {"c": 2.0, "onednn": 1.0, "mkl": 3.0}[product]


def _step_clock(model, loop_ms: float, one_call_ms: float):
    """A timer for ``settle``: each reading advances by the cost of the way the model is set up to run."""
    now = itertools.count()

    def timer():
        cost = loop_ms if model.cpu_decode is None else one_call_ms
        return next(now) * cost / 1e3
    return timer


@needs_layers
@needs_onednn
@pytest.mark.parametrize("one_call_wins", [True, False])
def test_a_contested_decode_bucket_is_settled_by_timing_the_whole_step(one_call_wins, tiny_model_path, monkeypatch,
                                                                       tmp_path):
    """oneDNN measured faster at every size: the one-call path (C GEMM) keeps its tile copies until a whole
    decode step has been timed both ways; the winner runs those steps; tokens equal the layer loop's."""
    clock = _FakeClock(_onednn_wins)
    monkeypatch.setattr(gemm_timing, "run_product", clock.run)
    cache = ChoiceCache(tmp_path, key="k")
    monkeypatch.setattr(model_loading, "plan_table", functools.partial(gemm_timing.plan_table, cache=cache,
                                                                       timer=clock.timer))
    timed, settle = [], cpu_decode_layers.settle

    def fake_settle(model, kv_cache, block_size):
        timer = _step_clock(model, loop_ms=5.0, one_call_ms=3.0 if one_call_wins else 8.0)
        timed.append(settle(model, kv_cache, block_size, cache=cache, timer=timer))
    monkeypatch.setattr(cpu_decode_layers, "settle", fake_settle)
    path = tiny_model_path("llama")
    worker, driver = local_driver(path, dtype="float32")     # decode steps of up to 128 rows
    decode_buckets = {b for b, rows in enumerate(ROW_BUCKETS) if rows <= 128}
    decode_linears = cpu_decode_layers.decoder_linears(worker.model)
    assert all(set(lin.packed_weight.plan) == {"onednn"} for lin in decode_linears)
    [results] = timed
    assert set(results) == decode_buckets
    assert all(r["layer_loop_ms"] == pytest.approx(5.0) for r in results.values())
    if one_call_wins:
        assert worker.model.cpu_decode.buckets == decode_buckets and not worker.model.cpu_decode.contested
        assert all(lin.packed_weight.tile is not None for lin in decode_linears)
    else:
        assert worker.model.cpu_decode is None
        assert all(lin.packed_weight.tile is None for lin in decode_linears)   # no plan runs the C GEMM here
    tokens = driver.generate(PROMPTS, 10)
    eager, eager_driver = local_driver(path, dtype="float32", enforce_eager=True)
    assert tokens == eager_driver.generate(PROMPTS, 10)
    assert tokens == hf_greedy_each(path, PROMPTS, 10)
    puts = []
    monkeypatch.setattr(cache, "put", lambda values: puts.append(values) or True)
    local_driver(path, dtype="float32")        # a second start on this CPU: every choice comes from the cache
    assert timed[-1] == results and puts == []


def test_the_fastest_tile_product_keeps_a_bucket_unless_another_is_faster_by_more_than_the_margin():
    """The C GEMM and the AMX product both run on the tile-packed copy (and in the one-call path): the faster
    of the two is the tile product of a bucket, and oneDNN must beat it by more than C_MARGIN to take it."""
    n = len(ROW_BUCKETS)
    by_rows = {"c": (1.0, 1.0, 3.0, 6.0, 9.0, 9.0, 9.0), "amx": (1.2, 1.1, 2.0, 2.0, 2.0, 2.05, 2.0),
               "onednn": (2.0,) * 5 + (1.6, 1.98)}    # at 1, 4, 16, 32, 128, 512, 2,048 rows; the others not timed
    timed = [b for b, rows in enumerate(ROW_BUCKETS) if rows not in gemm_timing.REFINED_ROWS]
    times = {p: tuple(t[timed.index(b)] if b in timed else math.inf for b in range(n)) for p, t in by_rows.items()}
    want = dict(zip((1, 4, 16, 32, 128, 512, 2048), ("c", "c", "amx", "amx", "amx", "onednn", "amx")))
    want.update({64: "amx", 256: "amx", 1024: "onednn"})    # an untimed bucket takes the one below's decision
    assert gemm_timing._plan(times) == tuple(want[rows] for rows in ROW_BUCKETS)
    assert gemm_timing._plan({"amx": (1.0,) * n, "onednn": (0.5,) * n}) == ("onednn",) * n
    # a close call is one between the best tile product and the best other product, whichever tile product
    assert gemm_timing._is_close({"c": 9.0, "amx": 2.0, "onednn": 1.9})
    assert not gemm_timing._is_close({"c": 9.0, "amx": 4.0, "onednn": 1.9})
    assert not gemm_timing._is_close({"amx": 2.0, "c": 2.1})          # no product on another copy
