"""``python -m benchmarks.gpu_engine --dry-run`` (tiny model on CPU) runs every engine section and writes
one JSON with each figure the GPU run prints; its numbers mean nothing on CPU, this guards the plumbing
a GPU session depends on."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_engine_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_engine", "--dry-run", "--skip-hf", "--num-seqs", "5",
                           "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["throughput"]["systems"]["pagedray"]["output_tok_s"]["median"] > 0
    assert report["throughput"]["systems"]["pagedray_async"]["output_tok_s"]["median"] > 0
    assert "async / synchronous" in report["throughput"]["ratios"]
    batch1 = report["batch1"]["systems"]
    assert batch1["graphs"]["ms_per_step"]["median"] > 0 and batch1["eager"]["ms_per_step"]["median"] > 0
    assert [row["graphs"] for row in report["busy"]] == [True, False]
    assert all(row["steps"] > 0 and row["wall_ms_per_step"] > 0 for row in report["busy"])
    assert report["startup"]["kv_blocks"] > 0
    assert json.loads((tmp_path / "gpu_throughput.json").read_text())["config"]["num_seqs"] == 5   # --num-seqs
    assert "summary ==" in proc.stdout and "batch-1 decode:" in proc.stdout
