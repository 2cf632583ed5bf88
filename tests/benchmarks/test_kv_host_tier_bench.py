"""``benchmarks.kv_host_tier``'s plumbing on CPU (synchronous copies, tiny shapes): every batch is checked (saved
blocks load back exactly) and written; the numbers mean nothing here."""

from __future__ import annotations

import json

import torch


def test_dry_run_checks_and_writes_every_batch(tmp_path):
    from benchmarks.kv_host_tier import DRY, run

    out = tmp_path / "tier.json"
    report = run(DRY, torch.device("cpu"), out, dry_run=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["blocks"] for r in rows] == list(DRY["batches"])
    assert report["dry_run"] is True and report["block_bytes"] > 0
    for row in rows:
        assert row["save_ms"] > 0 and row["load_ms"] > 0 and row["pinned_ms"] > 0 and row["forward_ms"] > 0
        assert row["mb"] == row["blocks"] * report["block_bytes"] / 1e6
