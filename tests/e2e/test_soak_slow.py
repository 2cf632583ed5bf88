"""A short soak (benchmarks.soak) in the slow tier: a few hundred mixed requests against one ``pagedray serve``
lose none and leave no KV block in use."""

import pytest

from benchmarks import soak

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_a_short_soak_loses_nothing_and_leaks_no_kv_block(tmp_path):
    summary = soak.main(["--requests", "300", "--concurrency", "8", "--sample-s", "2",
                         "--out", str(tmp_path / "soak.json")])
    assert summary["lost"] == 0 and summary["aborted"] > 0
    assert summary["kv_blocks_in_use_after"] == 0 and summary["kv_blocks"] > 0
    assert (tmp_path / "soak.png").is_file()


def test_a_short_soak_with_adapters_swapped_under_load_loses_nothing(tmp_path):
    """Three adapters in two slots, adapters loaded and unloaded by new names while the rest run, a cache small
    enough to preempt and a second KV tier: no request lost, no KV block left in use (#63: load, unload and
    eviction under load lose no request)."""
    summary = soak.main(["--requests", "200", "--concurrency", "8", "--sample-s", "2", "--lora",
                         "--serve-args", "--num-blocks 96 --kv-offload-gib 0.05", "--out", str(tmp_path / "soak.json")])
    assert summary["lost"] == 0 and summary["aborted"] > 0
    assert summary["kv_blocks_in_use_after"] == 0 and summary["kv_blocks"] == 96
