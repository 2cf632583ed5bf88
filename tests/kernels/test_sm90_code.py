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

pytestmark = [pytest.mark.integration, pytest.mark.slow]   # a process; slow (-m slow): ~70 s of sm_90 compiles for
# code properties (spills, tensor cores, wide loads), not values: the extended tier

REPO = pathlib.Path(__file__).resolve().parents[2]  # `python -m benchmarks.<name>` runs from here


def _sm90_report(folder: pathlib.Path, *flags: str) -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    path = folder / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sm90_report", "--json", str(path), *flags],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _sm90_report(tmp_path_factory.mktemp("sm90"))


@pytest.fixture(scope="module")
def rows(report) -> dict[str, dict]:
    return {row["name"]: row for row in report["rows"]}


def test_the_8bit_decode_launcher_splits_to_fill_whole_waves(report):
    """The launcher's own probe (it compiles the split kernel and counts the programs an SM holds) through a
    stand-in sm_90 driver: the default keys-major 64-key fp8 tiles fit 6 to an SM, so batch 64 x 8 KV heads
    (512 programs on 132 x 6 = 792 slots) takes 3 splits (2 waves, 97% full) instead of 1 (one wave 65%
    full)."""
    probe = report["launcher_split_probe"]
    assert probe["programs_per_sm"] == 6 and probe["num_splits"] == 3, probe


# Known spills (bytes of stack + local memory, at most), each with its cause; every other variant has none.
KNOWN_SPILLS = {
    "decode fp32 split+alibi+window": 4096,   # Triton's fp32 products at head_dim 128: 200-3,400 B at any tile / cap
    "rotary bf16": 64,                        # libdevice sin / cos: a local array for large angles' reduction
    "fused moe packed mxfp4 bf16, 256 tok": 64,   # the wide form at 255 registers: the e2m1 decode adds 8 B (3.9)
    # untuned first version (docs/design/kernels.md): 352 B at 255 registers with TF32 tensor cores (bf16 models);
    # for fp32 models IEEE products without tensor cores over [32, 128] q / k tiles and the [128, 32] state: 6,888 B
    "gated delta chunked bf16": 512,
    "gated delta chunked fp32": 8192,
}


def test_every_variant_compiles_without_spills(rows):
    """Spilled registers live in the stack frame (what ``maxnreg`` caps spill to) or local memory: the report
    counts both (``spill_bytes``), and the local-memory loads and stores in the code (``spill_ops``)."""
    from benchmarks.sm90_report import variants

    assert sorted(rows) == sorted(variants())
    for name, row in rows.items():
        limit = KNOWN_SPILLS.get(name, 0)
        assert row["spill_bytes"] <= limit, f"{name} spills {row['spill_bytes']} bytes (known: {limit})"
        assert (row["spill_ops"] == 0) == (row["spill_bytes"] == 0), row
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


def test_decode_loops_over_full_tiles_without_per_key_predicates(rows):
    """The decode loop runs over full tiles only (a sequence's last, partial tile once after it), so its loads
    and scores carry no per-key predicate: about 25 warp instructions per key for bf16, 35.6 with them. The
    second copy of the tile costs registers; ``decode_config``'s ``maxnreg`` keeps 4 programs per SM."""
    assert rows["decode bf16"]["instructions_per_key"] < 30, rows["decode bf16"]
    for name in ("decode bf16", "decode fp16", "decode bf16 split+alibi+window"):
        assert rows[name]["programs_per_sm"] == 4, rows[name]


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_f16_math_issues_fewer_instructions_per_key(rows, cache):
    """``F16_MATH`` exists because float16 conversions take fewer instructions than bf16's: its loop issues
    fewer warp instructions per key than the default 8-bit decode (docs/gpu.md). On an H100 it nevertheless
    ran slower (keys-major, 64-key tiles: int8 1.52x bf16 against the default's 1.66x), so it is not the
    default: instructions per key do not rank these kernels."""
    default, f16 = rows[f"decode bf16 over {cache} KV"], rows[f"decode bf16 over {cache} KV, f16 math"]
    assert 0 < f16["instructions_per_key"] < default["instructions_per_key"], (f16, default)


def test_kv8_goal_candidates_compile_without_spills_and_have_what_they_are_for(tmp_path):
    """What a short GPU lease times (``benchmarks.kv8_goal``) compiles for sm_90 without spills, and each
    candidate has what it is there for: the default (keys-major, 64-key tiles, 2 warps) 6 programs per SM where
    the 16-row form's 128-key tiles hold 3 (12 warps either way), the one-warp 32-key tiles 8; the keys-major
    kernel fewer warp instructions per key than the same settings with 16-row query tiles (over 10% fewer in
    its two-warp, 64-key ``F16_MATH`` tiles; Triton 3.9 turns its 4-warp, 128-key products into wgmma, which
    gains less there), and its int8 codes converted biased (``tile_keys_major_triton``)."""
    from benchmarks.kv8_goal import CANDIDATES

    rows = {row["name"]: row for row in _sm90_report(tmp_path, "--kv8-candidates")["rows"]}
    assert sorted(rows) == sorted(f"{code}: {name}" for code in ("int8", "fp8") for name, _, _ in CANDIDATES)
    for name, row in rows.items():
        assert row["spill_bytes"] == 0 and row["hmma"] + row["hgmma"] > 0, (name, row)
        assert row["byte_shared_loads"] == 0, (name, row)
    for code in ("int8", "fp8"):
        assert rows[f"{code}: default"]["programs_per_sm"] == 6, rows[f"{code}: default"]
        assert rows[f"{code}: 16 rows"]["programs_per_sm"] == 3, rows[f"{code}: 16 rows"]
        one_warp = rows[f"{code}: 16 rows f16 kcvt2 32/1w"]
        assert one_warp["programs_per_sm"] == 8, one_warp
        keys_major, queries_major = rows[f"{code}: keys-major f16 kcvt2"], rows[f"{code}: 16 rows f16 kcvt2"]
        assert keys_major["instructions_per_key"] < queries_major["instructions_per_key"], (keys_major, queries_major)
        two_warps = rows[f"{code}: keys-major f16 64/2w"]     # mma.sync under Triton 3.6 and 3.9 alike
        assert two_warps["instructions_per_key"] < 0.9 * queries_major["instructions_per_key"], two_warps
    # int8 codes go into the keys-major float16 products biased (no subtraction): 3 instructions per 4 codes
    # against fp8's 2, about 4 more per key (6 with the subtraction)
    int8, fp8 = rows["int8: keys-major f16 64/2w"], rows["fp8: keys-major f16 64/2w"]
    assert int8["instructions_per_key"] - fp8["instructions_per_key"] < 5, (int8, fp8)


def test_loop_instructions_counts_the_longest_loop():
    from benchmarks.sm90_report import loop_instructions

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;",            # outer loop: 0010-0060 (6)
        "        /*0020*/                   FADD R3, R3, R2 ;",                  # inner loop: 0020-0030 (2)
        "        /*0030*/              @P0 BRA 0x20 ;",
        "        /*0040*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        "        /*0050*/                   ISETP.NE.AND P1, PT, R2, 0x8, PT ;",
        "        /*0060*/              @!P1 BRA 0x10 ;",
        "        /*0070*/                   EXIT ;",
        "        /*0080*/                   BRA 0x80;",                         # the trap after EXIT: not a loop
    ])
    assert loop_instructions(sass) == 6
    assert loop_instructions(sass.replace("@!P1 BRA 0x10", "@!P1 BRA 0x70")) == 2   # forward: only the inner one
    assert loop_instructions("        /*0000*/                   EXIT ;") == 0


@pytest.mark.parametrize("name", ["prefill bf16 group 4", "prefill fp16 group 4", "prefill bf16 group 1 alibi+window"])
def test_prefill_uses_wgmma_and_wide_loads(rows, name):
    row = rows[name]
    assert row["hgmma"] > 0, row                 # Hopper warpgroup MMA, not the older mma.sync path
    assert row["wide_loads"] >= 16 and row["wide_stores"] > 0, row


def test_prefill_over_8bit_rows_loads_each_scale_once_per_row(rows):
    """bf16 queries over an 8-bit cache: the rows are dequantized before the products (``SCALE_ROWS``), so a
    thread loads the scales of its few K / V rows, not of each column of scores it holds (that took 96 narrow
    loads against the bf16 prefill's 20, and 1,231 loop instructions a trip against 656)."""
    quantized, bf16 = rows["prefill bf16 group 4 over int8 KV"], rows["prefill bf16 group 4"]
    assert quantized["hgmma"] > 0 and quantized["narrow_loads"] <= bf16["narrow_loads"] + 8, (quantized, bf16)
    assert quantized["loop_instructions"] < 1.5 * bf16["loop_instructions"], (quantized, bf16)


def test_store_kv_moves_16_byte_vectors(rows):
    row = rows["store_kv bf16"]
    assert row["wide_loads"] >= 2 and row["wide_stores"] >= 2, row


@pytest.mark.parametrize("name", ["fused moe gate_up bf16", "fused moe down bf16",
                                  *(f"fused moe packed 4-bit bf16, {t} tok" for t in (1, 256, 4096))])
def test_fused_moe_uses_tensor_cores(rows, name):
    assert rows[name]["hgmma"] + rows[name]["hmma"] > 0, rows[name]


def test_the_chunked_delta_rule_uses_tensor_cores_for_16bit_models(rows):
    """TF32 products for bf16 / fp16 models; fp32 models keep IEEE products (no tensor cores) for their tolerance."""
    assert rows["gated delta chunked bf16"]["hgmma"] + rows["gated delta chunked bf16"]["hmma"] > 0
    assert rows["gated delta chunked fp32"]["hgmma"] + rows["gated delta chunked fp32"]["hmma"] == 0
