"""benchmarks.kv_memory: the 8-bit system holds the same bytes in more blocks, and runs more sequences."""

from benchmarks.kv_memory import eight_bit_blocks, main


def test_eight_bit_blocks_fit_the_same_bytes():
    # head_dim 128: 130 bytes a row (codes + float16 scale) against 256 in bf16
    assert eight_bit_blocks(1300, 16, 128) == 1300 * 256 // 130
    assert eight_bit_blocks(66, 16, 64) == 128                     # 66 bytes a row against 128


def test_small_run_reports_the_8bit_ratio(tmp_path):
    report = main(["--rounds", "3", "--num-requests", "64", "--num-blocks", "256", "--max-model-len", "1024",
                   "--out", str(tmp_path / "kv.json")])
    assert report["blocks_8bit"] == 256 * 256 // 130
    assert "paged 8-bit KV" in (tmp_path / "kv.json").read_text()
