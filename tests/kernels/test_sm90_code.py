"""The kernels compile for an H100/H200 (sm_90) on a machine without a GPU, and the code the GPU would
run has the properties the design relies on (see ``benchmarks.sm90_report``): tensor-core products
(wgmma in prefill, mma.sync in the 16-row decode tiles), K/V moved by 128-bit pipelined loads, no
register spills, and several decode programs resident per SM. The report runs in a subprocess because
this test session imports Triton under the interpreter."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[2]  # `python -m benchmarks.<name>` runs from here


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    path = tmp_path_factory.mktemp("sm90") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sm90_report", "--json", str(path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {row["name"]: row for row in json.loads(path.read_text())["rows"]}


def test_every_variant_compiles_without_spills(rows):
    from benchmarks.sm90_report import variants

    assert sorted(rows) == sorted(variants())
    for name, row in rows.items():
        assert row["local_bytes"] == 0, f"{name} spills {row['local_bytes']} bytes to local memory"
        assert row["programs_per_sm"] >= 1, f"{name} does not fit on an SM: {row}"


@pytest.mark.parametrize("name", ["decode bf16", "decode fp16", "decode bf16 split+alibi+window"])
def test_decode_uses_tensor_cores_and_wide_loads(rows, name):
    row = rows[name]
    assert row["hmma"] + row["hgmma"] > 0, row
    assert row["wide_loads"] >= 16, row          # one 64 x 128 tile of K and of V: 8 x 16 B per thread each
    assert row["programs_per_sm"] >= 2, row      # latency hiding across resident programs


@pytest.mark.parametrize("name", ["decode bf16 over int8 KV", "decode bf16 over fp8 KV",
                                  "decode bf16 over int8 KV, f16 math"])
def test_8bit_decode_converts_codes_without_byte_loads(rows, name):
    """8-bit K/V tiles: codes converted by the integer-op asm (``tile_triton.codes_to``), V converted before
    its shared-memory copy so ``ldmatrix`` transposes it: no byte-wise shared loads (Triton's own cast read V
    32 bytes a tile that way)."""
    row = rows[name]
    assert row["hmma"] + row["hgmma"] > 0, row
    assert row["byte_shared_loads"] == 0, row
    assert row["wide_loads"] >= 16, row
    assert row["programs_per_sm"] >= 2, row


@pytest.mark.parametrize("name", ["prefill bf16 group 4", "prefill fp16 group 4", "prefill bf16 group 1 alibi+window"])
def test_prefill_uses_wgmma_and_wide_loads(rows, name):
    row = rows[name]
    assert row["hgmma"] > 0, row                 # Hopper warpgroup MMA, not the older mma.sync path
    assert row["wide_loads"] >= 16 and row["wide_stores"] > 0, row


def test_store_kv_moves_16_byte_vectors(rows):
    row = rows["store_kv bf16"]
    assert row["wide_loads"] >= 2 and row["wide_stores"] >= 2, row


@pytest.mark.parametrize("name", ["fused moe gate_up bf16", "fused moe down bf16",
                                  *(f"fused moe packed 4-bit bf16, {t} tok" for t in (1, 256, 4096))])
def test_fused_moe_uses_tensor_cores(rows, name):
    assert rows[name]["hgmma"] + rows[name]["hmma"] > 0, rows[name]
