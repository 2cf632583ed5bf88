"""The kernel benchmark and the launch-configuration sweep run end to end (``--dry-run``: tiny shapes
through the Triton interpreter) and write JSON in which every configuration was checked against the
torch reference and timed. Their numbers mean nothing on CPU; these tests guard the plumbing that a
GPU session depends on."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[2]  # `python -m benchmarks.<name>` runs from here


def _run_dry(module: str, out, extra: list[str] = ()) -> dict:
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", module, "--dry-run", "--out", str(out), *extra], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"].startswith("cpu")
    return report


def test_bench_dry_run_writes_every_row(tmp_path):
    from benchmarks.kernels import DRY

    report = _run_dry("benchmarks.kernels", tmp_path / "bench.json")
    decode = [r for r in report["rows"] if r["kind"] == "decode"]
    prefill = [r for r in report["rows"] if r["kind"] == "prefill"]
    assert len(decode) == len(DRY["batches"]) * len(DRY["contexts"]) * len(DRY["dtypes"])
    assert len(prefill) == 2 * len(DRY["prefill_tokens"]) * len(DRY["dtypes"])
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in decode)
    assert all(r["ms"] > 0 and r["sdpa_ms"] > 0 for r in prefill)


@pytest.mark.slow   # the extended tier (README: -m slow): a benchmark's plumbing
def test_sweep_dry_run_checks_and_times_every_config(tmp_path):
    from benchmarks.kernel_sweep import DRY, decode_variants, grid_configs

    report = _run_dry("benchmarks.kernel_sweep", tmp_path / "sweep.json")
    rows = report["rows"]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    best_again = 2 * len(DRY["best_at_splits"])    # the two fastest grid configurations at forced splits
    expected = (len(DRY["decode_shapes"]) * (len(decode_variants(DRY)) + best_again)
                + len(DRY["prefill_shapes"]) * (1 + len(grid_configs(DRY["prefill_grid"]))))
    assert len(rows) == expected
    for shape in DRY["decode_shapes"]:
        decode = [r for r in rows if r["shape"] == f"b{shape[0]} ctx{shape[1]}"]
        fastest = sorted((r for r in decode if isinstance(r["config"], dict) and r["num_splits"] is None),
                         key=lambda r: r["ms"])[:2]
        again = [(r["config"], r["num_splits"]) for r in decode[-best_again:]]
        assert again == [(r["config"], n) for r in fastest for n in DRY["best_at_splits"]]
    shapes = {r["shape"] for r in rows}
    assert set(report["best"]) == shapes
    assert all(sum(r["config"] == "default" for r in rows if r["shape"] == s) == 1 for s in shapes)


@pytest.mark.slow   # the extended tier (README: -m slow): a benchmark's plumbing
def test_moe_kernel_dry_run_checks_and_times_every_row(tmp_path):
    from benchmarks.moe_kernel import DRY

    report = _run_dry("benchmarks.moe_kernel", tmp_path / "moe.json")
    rows = report["rows"]
    assert [r["tokens"] for r in rows] == list(DRY["tokens"])
    assert all(r["fused_ms"] > 0 and r["loop_ms"] > 0 and r["tflops"] > 0 and r["gbps"] > 0 for r in rows)
    assert all(1 <= r["experts_hit"] <= DRY["experts"] for r in rows)
    assert all(r["packed4_ms"] > 0 and r["packed4_vs_fused"] > 0 for r in rows)     # 4-bit experts, checked too
    assert all(r["mxfp4_ms"] > 0 and r["mxfp4_vs_fused"] > 0 for r in rows)         # MXFP4 experts, checked too


@pytest.mark.slow   # the extended tier (README: -m slow): a benchmark's plumbing
def test_kv8_kernel_dry_run_checks_and_times_every_row(tmp_path):
    from benchmarks.kv8_kernel import DRY

    report = _run_dry("benchmarks.kv8_kernel", tmp_path / "kv8.json")
    decode = [r for r in report["rows"] if r["kind"] == "decode"]
    caches = [DRY["dtype"], *(name + suffix for name in DRY["cache_dtypes"] for suffix in ("", "+f16"))]
    assert [r["cache"] for r in decode] == caches * len(DRY["batches"]) * len(DRY["contexts"])
    assert all(r["ms"] > 0 and r["gbps"] > 0 and r["speedup_vs_16bit"] > 0 for r in decode)
    assert [r["cache"] for r in report["rows"] if r["kind"] == "prefill"] == [DRY["dtype"], *DRY["cache_dtypes"]]


@pytest.mark.slow   # the extended tier (README: -m slow): a benchmark's plumbing
def test_kv8_goal_dry_run_times_every_system_in_every_round(tmp_path):
    from benchmarks.kv8_goal import BASELINE, DRY, DRY_CANDIDATES

    report = _run_dry("benchmarks.kv8_goal", tmp_path / "goal.json", ["--rounds", "3"])
    systems = [BASELINE, *(f"{cache} {name}" for cache in DRY["caches"] for name, _, _ in DRY_CANDIDATES)]
    assert report["not_timed"] == {}
    assert sorted((r["system"], r["round"]) for r in report["runs"]) == sorted(
        (s, i) for s in systems for i in range(3))
    assert all(r["error"] is None and r["values"]["ms"] > 0 for r in report["runs"])
    ratios = report["summary"]["ratios"]
    assert set(ratios) == {f"{s} / {BASELINE}" for s in systems[1:]}
    assert all(ratio["calls_per_s"]["median"] > 0 for ratio in ratios.values())


@pytest.mark.slow   # the extended tier (README: -m slow): a benchmark's plumbing
def test_kv8_goal_times_only_the_candidates_named(tmp_path):
    """``--candidates`` (the rerun after a lease changes the default) times bf16 and the named candidates alone;
    a name it does not know is a usage error naming the option, before anything runs."""
    from benchmarks.kv8_goal import BASELINE, DRY

    report = _run_dry("benchmarks.kv8_goal", tmp_path / "goal.json", ["--rounds", "3", "--candidates", "keys-major"])
    assert sorted({r["system"] for r in report["runs"]}) == sorted(
        [BASELINE, *(f"{cache} keys-major" for cache in DRY["caches"])])
    assert report["config"]["candidates"] == [["keys-major", {"KEYS_MAJOR": True, "BLOCK_G": 8}, None]]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kv8_goal", "--dry-run", "--out", str(tmp_path / "x.json"),
                           "--candidates", "default", "no such"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "--candidates: unknown ['no such']" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()


def test_quant_gemm_dry_run_checks_and_times_every_row(tmp_path):
    from benchmarks.quant_gemm import DRY

    report = _run_dry("benchmarks.quant_gemm", tmp_path / "qgemm.json")
    rows = report["rows"]
    assert len(rows) == len(DRY["rows"]) * len(DRY["outs"]) * len(DRY["variants"])
    assert all(r["ms"] > 0 and r["dense_ms"] > 0 and r["tflops"] > 0 for r in rows)
