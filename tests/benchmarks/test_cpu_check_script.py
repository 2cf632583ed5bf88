"""``benchmarks/cpu_check.sh``'s plumbing without its stages (each takes minutes): it names this CPU's kind
and the commit in its log, writes lscpu's output beside it, and refuses a stage it does not know."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_cpu_check_names_the_cpu_kind_and_refuses_an_unknown_stage(tmp_path):
    done = subprocess.run(["bash", "benchmarks/cpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path), "STAGES": "tune"})
    assert done.returncode == 2, done.stdout + done.stderr
    log = (tmp_path / "run.log").read_text()
    assert "unknown stage: tune (stages: dispatch serving)" in log
    head = re.search(r"^== .* \((amx|avx512bf16|avx2)\), (\d+) CPUs, load .*, commit ([0-9a-f]+), ", log, re.M)
    assert head is not None, log
    assert int(head.group(2)) >= 1
    flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    expected = "amx" if " amx_bf16" in flags else "avx512bf16" if " avx512_bf16" in flags else "avx2"
    assert head.group(1) == expected
    assert (tmp_path / "lscpu.txt").exists()
