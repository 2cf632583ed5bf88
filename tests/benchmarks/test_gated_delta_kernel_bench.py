"""``benchmarks.gated_delta_kernel``'s plumbing on CPU (the Triton interpreter, tiny shapes): every step's row is
checked (chunked kernel against the recurrent one) and written; the numbers mean nothing here."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow   # a benchmark's plumbing, ~35 s: the extended tier (README: -m slow)
def test_dry_run_checks_and_writes_every_step(tmp_path):
    from benchmarks.gated_delta_kernel import DRY, run

    out = tmp_path / "delta.json"
    report = run(DRY, torch.device("cpu"), out, dry_run=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seqs"], r["tokens"]) for r in rows] == [tuple(step) for step in DRY["steps"]]
    assert report["dry_run"] is True
    for row in rows:
        assert row["chunked_ms"] > 0 and row["recurrent_ms"] > 0 and row["torch_ms"] > 0
        assert row["max_out_diff"] < 1e-4 and row["max_state_diff"] < 1e-4   # the two kernels agree
