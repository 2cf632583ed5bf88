"""Measured choices between CPU kernels (``kernels/cpu/cpu_choice.py``): row buckets, the pick from timings, the
on-disk cache and its key, and the forced product."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from pagedray.kernels.cpu import cpu_choice
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS, ChoiceCache, bucket_index, cache_key, pick


def test_a_row_count_takes_the_nearest_bucket_on_a_log_scale():
    assert [ROW_BUCKETS[bucket_index(r)] for r in (1, 2, 3, 7, 8, 16, 22, 23, 45, 46, 90, 91, 181, 182, 362, 363,
                                                    724, 725, 1448, 1449, 9000)] == \
        [1, 4, 4, 4, 16, 16, 16, 32, 32, 64, 64, 128, 128, 256, 256, 512, 512, 1024, 1024, 2048, 2048]
    assert all(ROW_BUCKETS[bucket_index(b)] == b for b in ROW_BUCKETS)


def test_pick_keeps_the_fastest_candidate_of_each_bucket():
    times = {"c": (1.0, 2.0, 5.0, math.inf), "onednn": (1.5, 1.0, 5.0, 3.0), "mkl": (9.0, 9.0, 4.0, math.inf)}
    assert pick(times) == ("c", "onednn", "mkl", "onednn")
    assert pick({"onednn": (2.0,), "c": (2.0,)}) == ("onednn",)           # a tie goes to the first named
    with pytest.raises(ValueError, match="times"):
        pick({})
    with pytest.raises(ValueError, match="times"):
        pick({"c": (1.0, 2.0), "onednn": (1.0,)})


def test_the_cache_key_changes_with_each_of_its_parts(tmp_path):
    source = tmp_path / "k.c"
    source.write_text("int f(void) { return 1; }")
    base = dict(model="Xeon", flags="flags: avx512f amx_bf16", torch_version="2.13.0", sources=[source])
    key = cache_key(**base)
    assert key == cache_key(**base)
    for part, other in (("model", "EPYC"), ("flags", "flags: avx512f"), ("torch_version", "2.14.1")):
        assert cache_key(**{**base, part: other}) != key, part
    source.write_text("int f(void) { return 2; }")
    assert cache_key(**base) != key                                       # a kernel source changed


def test_the_cache_keeps_entries_per_key_and_merges_writes(tmp_path):
    cache = ChoiceCache(tmp_path, key="a")
    assert cache.entries() == {} and cache.get("x") is None
    cache.put({"x": {"plan": ["c"]}})
    cache.put({"y": 2})
    assert ChoiceCache(tmp_path, key="a").entries() == {"x": {"plan": ["c"]}, "y": 2}
    assert ChoiceCache(tmp_path, key="b").entries() == {}                # another CPU / torch / source
    (tmp_path / "a.json").write_text("{not json")
    assert cache.entries() == {}                                          # unreadable: timed again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]       # no private file left behind


def test_forced_product_option_then_environment(monkeypatch):
    monkeypatch.delenv(cpu_choice.PRODUCT_ENV, raising=False)
    assert cpu_choice.forced_product("auto") is None
    assert cpu_choice.forced_product("onednn") == "onednn"
    monkeypatch.setenv(cpu_choice.PRODUCT_ENV, "c")
    assert cpu_choice.forced_product("auto") == "c"
    assert cpu_choice.forced_product("mkl") == "mkl"                      # the configured product wins
    monkeypatch.setenv(cpu_choice.PRODUCT_ENV, "auto")
    assert cpu_choice.forced_product("auto") is None
    monkeypatch.setenv(cpu_choice.PRODUCT_ENV, "tiles")
    with pytest.raises(ValueError, match=f"^{cpu_choice.PRODUCT_ENV}"):
        cpu_choice.forced_product("auto")
    with pytest.raises(ValueError, match="^cpu_gemm"):
        cpu_choice.forced_product("fast")


def test_a_contended_timing_is_used_but_not_kept_whatever_the_load_average(tmp_path, monkeypatch, caplog):
    """Where the kernel reports run-queue delays: above BUSY_WAIT_PER_S seconds waited for a CPU by this process's
    threads per second between the opening and the put, nothing is written; below it the decisions are kept even
    under a host-wide load average far above BUSY_LOAD_PER_CPU (a container on a busy shared host)."""
    monkeypatch.setattr(cpu_choice, "BUSY_WAIT_PER_S", 0.2)
    monkeypatch.setattr(cpu_choice, "BUSY_LOAD_PER_CPU", 1.0)
    cpus = os.cpu_count() or 1
    state = {"wait": 10.0, "now": 100.0}

    def opened() -> ChoiceCache:
        return ChoiceCache(tmp_path, key="k", loadavg=lambda: (50.0 * cpus, 0.0, 0.0),
                           run_queue_wait=lambda: state["wait"], clock=lambda: state["now"])

    cache = opened()
    state["now"] += 4.0
    state["wait"] += 0.1                                      # 0.025 s per second: this timing ran undisturbed
    assert cache.put({"undisturbed": 1}) is True
    cache = opened()
    state["now"] += 4.0
    state["wait"] += 2.0                                      # 0.5 s per second: other work held the cores
    assert cache.put({"contended": 2}) is False
    assert "waited 0.50 s for a CPU per second of the timing" in caplog.text
    assert ChoiceCache(tmp_path, key="k").entries() == {"undisturbed": 1}


def test_run_queue_wait_reads_this_process_threads():
    """On a Linux that reports it, the sum of the threads' run-queue delays: a number of seconds that never falls
    while the threads live."""
    if not list(Path("/proc/self/task").glob("*/schedstat")):
        pytest.skip("this kernel reports no run-queue delays")
    first = cpu_choice.run_queue_wait_s()
    sum(range(200_000))
    second = cpu_choice.run_queue_wait_s()
    assert isinstance(first, float) and 0.0 <= first <= second


def test_a_busy_machines_timings_are_used_but_not_kept(tmp_path, monkeypatch, caplog):
    """Where the kernel reports no run-queue delays: above BUSY_LOAD_PER_CPU when the cache is opened (before the
    timing) or when the decisions are put, nothing is written: the next start times again. A quiet machine's
    decisions are kept."""
    monkeypatch.setattr(cpu_choice, "BUSY_LOAD_PER_CPU", 1.0)
    cpus = os.cpu_count() or 1
    loads = {"now": 0.5 * cpus}
    cache = ChoiceCache(tmp_path, key="k", loadavg=lambda: (loads["now"], 0.0, 0.0), run_queue_wait=lambda: None)
    assert cache.put({"quiet": 1}) is True
    loads["now"] = 3.0 * cpus                                              # busy by the time of the put
    assert cache.put({"busy at put": 2}) is False
    assert "busy at put timed on a busy machine" in caplog.text
    opened_busy = ChoiceCache(tmp_path, key="k", loadavg=lambda: (loads["now"], 0.0, 0.0),
                              run_queue_wait=lambda: None)
    loads["now"] = 0.2 * cpus                                              # quiet again after the timing
    assert opened_busy.put({"busy at open": 3}) is False
    assert ChoiceCache(tmp_path, key="k").entries() == {"quiet": 1}
