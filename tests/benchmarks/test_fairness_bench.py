"""``benchmarks.fairness --dry-run``: the three systems run end to end on the default model (tiny workload), the
report holds every metric and ratio, and only the flooded systems report flood tokens. No timing is asserted."""

from __future__ import annotations

import pytest

from benchmarks import fairness


@pytest.mark.slow   # a benchmark's plumbing, ~35 s: the extended tier (README: -m slow)
def test_a_dry_run_reports_solo_fifo_and_fair(default_model_path, monkeypatch, tmp_path):
    report = fairness.main(["--dry-run", "--model", str(default_model_path), "--out", str(tmp_path / "f.json")])
    systems = report["summary"]["systems"]
    assert set(systems) == {"solo", "fifo", "fair"}
    assert systems["solo"]["flood_tok_s"]["median"] == 0 and systems["fair"]["flood_tok_s"]["median"] > 0
    assert all(systems[s]["light_ttft_p99_ms"]["median"] > 0 for s in systems)
    assert set(report["summary"]["ratios"]) == {"fifo / solo", "fair / solo", "fair / fifo"}
    assert (tmp_path / "f.json").exists()
