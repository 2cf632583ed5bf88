"""benchmarks.kv_transfer, one short pass: both systems measure, a pull moves the prefix's blocks through the
object store and its parts add up, and each length's ratio pairs prefill with pull."""

from __future__ import annotations

import pytest

from benchmarks import kv_transfer

# slow: the extended tier (README: -m slow); CI keeps none of it (a benchmark's plumbing)
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process


def test_both_systems_measure_and_the_ratios_pair_them(ray_session):
    assert kv_transfer._systems([32, 64]) == ["pull 32", "prefill 32", "pull 64", "prefill 64"]
    assert [(r.system, r.peers) for r in kv_transfer._ratios([32])] == [("prefill 32", ("pull 32",))]
    bench = kv_transfer.Bench("float32", vocab_top=40000)
    try:
        pull = bench.measure("pull 32")
        prefill = bench.measure("prefill 32")
    finally:
        bench.shutdown()
    assert pull["blocks"] == 2 and pull["bytes"] > 0 and pull["transfer_gb_s"] > 0
    assert pull["ttft_s"] >= pull["export_s"] + pull["object_store_s"] + pull["import_s"]
    assert prefill["ttft_s"] > 0
