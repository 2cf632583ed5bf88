"""benchmarks/routing.py's cache-size sweep: the --num-blocks list, the system names and a ratio pair per size."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.routing import CACHE_AWARE, DEFAULT, block_sizes, ratios, system_name


def test_num_blocks_is_one_count_or_a_list_of_distinct_positive_counts():
    assert block_sizes("96") == [96]
    assert block_sizes("64,80,96") == [64, 80, 96]
    for bad in ("", "64,x", "0", "64,64", "-8"):
        with pytest.raises(argparse.ArgumentTypeError):
            block_sizes(bad)


def test_each_cache_size_compares_its_own_two_routers():
    single = ratios([96])
    assert [(r.system, r.peers) for r in single] == [(CACHE_AWARE, (DEFAULT,)), (DEFAULT, (CACHE_AWARE,))]
    swept = ratios([64, 96])
    assert [(r.system, r.peers, r.metrics[0]) for r in swept] == [
        ("cache_aware/64", ("serve/64",), "cached_tokens"), ("serve/64", ("cache_aware/64",), "mean_ttft_s"),
        ("cache_aware/96", ("serve/96",), "cached_tokens"), ("serve/96", ("cache_aware/96",), "mean_ttft_s")]
    assert len({r.name for r in swept}) == 4 and all(r.name.endswith(" blocks") for r in swept)
    assert system_name(DEFAULT, 80, sweep=False) == DEFAULT
