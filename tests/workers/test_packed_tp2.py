"""Packed quantized weights at TP=2 (what CUDA keeps, forced on CPU): each rank holds its own slice of every
packed linear layer and of every MoE layer's packed experts, and the two ranks together are still the model
transformers runs on the dequantized weights (greedy tokens equal, logprobs within 1e-4, fp32).

The ranks run as threads of this process (``helpers.thread_tp``), because ``keeps_packed`` must be patched in
every rank; ``test_worker_tp.py`` runs the dequantized formats through Ray actors and gloo. Qwen3-MoE here:
experts of 32 intermediate rows, so a rank holds 16 (one group of 32 or 16, or one of 16 at either rank) and
keeps them packed. With experts of 48 rows and groups of 16, rank 1's 24 rows start in the middle of group 1
(its slice's groups are 8 and 16 rows, not uniform): rank 1 loads its experts dequantized
(``SparseMoE._read_packed``), rank 0 keeps its packed, and the sum of the two is still the same model.
"""

from __future__ import annotations

import pytest
from helpers.hf_oracle import assert_top_logprobs_match, hf_greedy_each
from helpers.quantized_checkpoints import quantize_folder, round_rows_8bit
from helpers.thread_tp import thread_tp_driver, thread_tp_workers
from pagedray.workers.contract.sampling_params import SamplingParams

NEW_TOKENS = 24
PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4]]


@pytest.fixture
def packed_everywhere(monkeypatch):
    import pagedray.workers.models.model_loading as loading_module

    monkeypatch.setattr(loading_module, "keeps_packed", lambda q, device: q.method != "none")


def _run_tp2(monkeypatch, path: str, **options):
    workers = thread_tp_workers(monkeypatch, path, 2, **options)
    driver = thread_tp_driver(workers, token_budget=24, max_chunk=16)
    seqs = driver.run([driver.add(p, NEW_TOKENS, SamplingParams(temperature=0.0, logprobs=5)) for p in PROMPTS])
    assert [w.num_sequences() for w in workers] == [0, 0]
    return workers, seqs


def _packed_parts(worker):
    from pagedray.workers.layers.moe import SparseMoE

    linears = [m for m in worker.model.modules() if getattr(m, "quant", None) is not None]
    moes = [m for m in worker.model.modules() if isinstance(m, SparseMoE)]
    return linears, moes


@pytest.mark.parametrize("kind, fmt, options", [
    ("qwen3-moe", "gptq", dict(group=16, desc_act=False, v2=False)),
    ("qwen3-moe", "gptq", dict(group=32, desc_act=False, v2=False)),
    ("qwen3-moe", "awq", dict(group=16)),
    ("qwen3-moe", "fp8", dict(block=16)),
    ("qwen3-moe", "int8", {}),
    ("qwen3-moe-48", "gptq", dict(group=16, desc_act=False, v2=False)),
], ids=["gptq", "gptq-group-32", "awq", "fp8-blocks", "int8", "gptq-rank1-mid-group"])
def test_tp2_packed_moe_is_the_dequantized_model(kind, fmt, options, packed_everywhere, tiny_model_path, tmp_path,
                                                 monkeypatch):
    source = tiny_model_path(kind)
    rows = 24 if kind == "qwen3-moe-48" else 16
    if fmt == "int8":
        path, oracle, model_options = source, str(tmp_path / "dq"), {"quantization": "int8"}
        round_rows_8bit(source, tmp_path / "dq", "int8")
    else:
        quantize_folder(source, tmp_path / "q", tmp_path / "dq", fmt, **options)
        path, oracle, model_options = str(tmp_path / "q"), str(tmp_path / "dq"), {}
    workers, seqs = _run_tp2(monkeypatch, path, **model_options)
    for rank, worker in enumerate(workers):
        linears, moes = _packed_parts(worker)
        assert linears and all(m.weight is None for m in linears)            # attention and the dense MLP
        assert moes and all(m.start == rank * rows and m.rows == rows for m in moes)
        packed = rank == 0 or rows == 16
        assert all((m.packed is not None) == packed for m in moes), f"rank {rank}"
        for m in moes:   # every expert, this rank's slice: gate and up's output columns, down's input rows
            if packed:
                gate_up, down = m.packed
                assert gate_up.qweight.shape[0] == down.qweight.shape[0] == 6
                assert gate_up.scales.shape[-1] == 2 * rows and down.g_idx.shape == (rows,)
            else:
                assert m.gate_up.shape == (6, 2 * rows, 64) and m.down.shape == (6, 64, rows)
    assert [s.output for s in seqs] == hf_greedy_each(oracle, PROMPTS, NEW_TOKENS)
    assert_top_logprobs_match(oracle, seqs)
