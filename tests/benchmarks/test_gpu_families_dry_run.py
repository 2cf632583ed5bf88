"""``python -m benchmarks.gpu_families --dry-run`` (tiny models of every 2026 family on CPU) builds each model folder
(the MXFP4 one included), serves each, times every system in every round and writes the ratios against the dense
model; its numbers mean nothing on CPU, this guards the plumbing a GPU session depends on."""

from __future__ import annotations

import json


def test_dry_run_times_every_family_against_dense(tmp_path):
    from benchmarks.gpu_families import SYSTEMS, main

    out = tmp_path / "families.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    systems = report["summary"]["systems"]
    assert set(systems) == set(SYSTEMS)
    assert all(systems[s]["output_tok_s"]["median"] > 0 and systems[s]["long_prefill_s"]["median"] > 0
               for s in SYSTEMS)
    assert {f"{s} / dense" for s in SYSTEMS if s != "dense"} <= set(report["summary"]["ratios"])
    facts = report["systems"]
    assert all(facts[s]["parameters"] > 0 and facts[s]["kv_blocks"] > 0 for s in SYSTEMS)
    assert not any(facts[s]["decode_graphs"] for s in SYSTEMS)          # CPU: no CUDA graphs
