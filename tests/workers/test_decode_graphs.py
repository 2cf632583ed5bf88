"""The decode-graph path on CPU: static buffers, bucket padding and the fixed block-table width run the
same forward the CUDA graphs capture (here without a graph), and greedy tokens still equal transformers'.

CUDA graph capture itself is checked by ``test_worker_gpu.py`` (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_oracle import hf_greedy_each
from helpers.worker_plans import log_bucket_runs
from helpers.worker_setup import engine_config, local_driver
from pagedray import kernels
from pagedray.cluster import LLM, SamplingParams
from pagedray.workers.contract.config import ModelConfig
from pagedray.workers.runner.decode_graphs import DecodeGraphs, bucket_sizes
from pagedray.workers.runner.input_batch import build_host_batch
from pagedray.workers.runner.seq_mirror import BatchedSequence, SequenceState
from pagedray.workers.worker import Worker

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4], list(range(60, 80)),
           [9, 8, 7, 6, 5, 4, 3, 2], [150, 3, 77, 21, 18]]
NEW_TOKENS = 24


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(256)[-3:] == [224, 240, 256] and len(bucket_sizes(256)) == 20
    with pytest.raises(ValueError, match="max_num_seqs"):
        bucket_sizes(0)


def _decode(seq_id: int, tokens: list[int], blocks: list[int]) -> BatchedSequence:
    return BatchedSequence.of(SequenceState(seq_id, tokens, [], len(tokens) - 1, blocks, GREEDY), 1)


def test_padded_host_batch_layout():
    # block_size 4, width 3: two decode rows padded to a bucket of 4
    batch = [_decode(7, [1, 2, 3, 4, 5, 6], [3, 9]), _decode(8, [10, 11, 12], [5])]
    host = build_host_batch(batch, 4, rows=4, width=3)
    inputs = host.inputs
    assert inputs.input_ids.tolist() == [6, 12, 0, 0]
    assert inputs.positions.tolist() == [5, 2, 0, 0]
    assert inputs.meta.slot_mapping.tolist() == [9 * 4 + 1, 5 * 4 + 2, -1, -1]   # padding writes no KV
    assert inputs.meta.seq_lens_k.tolist() == [6, 3, 1, 1]
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert inputs.meta.block_tables.tolist() == [[3, 9, 0], [5, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert host.num_real_rows == 2 and [s.seq_id for s in host.sampling_seqs] == [7, 8]
    assert host.packed.dtype == torch.int32 and host.packed.numel() == host.shape.size
    prefill = BatchedSequence.of(SequenceState(9, [1, 2, 3], [], 0, [4], GREEDY), 3)
    with pytest.raises(ValueError, match="rows"):
        build_host_batch([prefill], 4, rows=4, width=3)
    with pytest.raises(ValueError, match="width"):
        build_host_batch(batch, 4, rows=4, width=1)


def test_host_metadata_check_names_the_bad_field():
    batch = [_decode(7, [1, 2, 3, 4, 5, 6], [3, 9])]
    meta = build_host_batch(batch, 4).inputs.meta
    cache_shape = (10, 4, 2, 16)      # 10 blocks of 4 slots
    kernels.check_host_step_metadata(cache_shape, torch.bfloat16, 1, meta.slot_mapping, meta.cu_seqlens_q,
                                     meta.seq_lens_k, meta.block_tables, 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.check_host_step_metadata((9, 4, 2, 16), torch.bfloat16, 1, meta.slot_mapping,
                                         meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, 1)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.check_host_step_metadata((5, 4, 2, 16), torch.bfloat16, 1, torch.tensor([0], dtype=torch.int32),
                                         meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, 1)


def _with_static_decode(worker: Worker, max_num_seqs: int) -> list[tuple[int, int]]:
    """Route the worker's decode steps through DecodeGraphs (no capture on CPU); returns a log of
    (real rows, bucket) per decode step."""
    runner = worker.runner
    graphs = DecodeGraphs(worker.model, runner.kv_cache, runner.block_size, max_num_seqs, worker.max_model_len,
                          worker.device)
    runner.use_decode_graphs(graphs)
    return log_bucket_runs(graphs)


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen3", "gemma4", "gemma4-moe"])
def test_static_decode_path_matches_transformers(kind, tiny_model_path):
    path = tiny_model_path(kind)
    worker, driver = local_driver(path, token_budget=24, max_chunk=16)
    log = _with_static_decode(worker, max_num_seqs=6)
    assert driver.generate(PROMPTS, NEW_TOKENS) == hf_greedy_each(path, PROMPTS, NEW_TOKENS)
    assert worker.num_sequences() == 0
    # decode steps ran in several buckets, padded ones included (3 rows in a bucket of 4, 5 in 6)
    assert {1, 4, 6} <= {bucket for _, bucket in log}
    assert (3, 4) in log and (5, 6) in log
    # mixed / prefill steps stayed eager: fewer bucket runs than steps with sampled tokens
    assert len(log) < len(driver.plans)


@pytest.mark.parametrize("kind, use_triton", [("qwen3.5", False), ("qwen3.5", True), ("qwen3.5-moe", False)])
def test_hybrid_static_decode_path_without_host_reads_matches_transformers(kind, use_triton, tiny_model_path):
    """Qwen3.5 (dense and MoE) decode steps through the static buffers CUDA graphs replay, on the path a CUDA step
    takes (``decode_reads_host`` off: slots, fresh flags and the delta rule's states stay tensors; padding rows
    share the scratch slot); the torch delta rule and the Triton kernel under the interpreter."""
    path = tiny_model_path(kind)
    worker, driver = local_driver(path, token_budget=24, max_chunk=16)
    worker.model.decode_reads_host = False
    assert worker.model.graph_safe
    for layer in worker.model.layers:
        if layer.kind == "linear_attention":
            layer.linear_attn.use_triton = use_triton
    log = _with_static_decode(worker, max_num_seqs=6)
    assert driver.generate(PROMPTS, NEW_TOKENS) == hf_greedy_each(path, PROMPTS, NEW_TOKENS)
    assert worker.num_sequences() == 0
    assert (3, 4) in log and (5, 6) in log            # padded buckets: several rows on the scratch slot


def test_static_decode_path_with_prefix_hits_and_preemption(tiny_model_path):
    path = tiny_model_path("llama")
    prompts = [[7, 8, 9, 10] * 4 + [i + 20, i + 40] for i in range(5)]     # a shared 16-token prefix
    params = SamplingParams(temperature=0, max_tokens=16)

    def generate(static: bool):
        llm = LLM(path, dtype="float32", block_size=8, num_blocks=16, watermark=0.0, threads_per_worker=1,
                  max_num_seqs=6)
        log = _with_static_decode(llm.engine.executor.worker, 6) if static else None
        try:
            results = llm.generate(prompts, params, use_tqdm=False)
            return [r.outputs[0].token_ids for r in results], llm.engine.stats(), log
        finally:
            llm.shutdown()

    eager, _, _ = generate(static=False)
    static, stats, log = generate(static=True)
    assert static == eager
    assert stats.num_preemptions_total > 0 and stats.prefix_hit_rate > 0
    assert any(rows < bucket for rows, bucket in log), log


def test_graphs_only_on_cuda_and_not_with_enforce_eager(tiny_model_path):
    worker = Worker(engine_config(tiny_model_path("llama")))
    assert worker.device.type == "cpu" and not worker.uses_decode_graphs
    worker.init_kv_cache(8)
    assert worker.runner.decode_graphs is None and worker.graph_report is None
    graphs = DecodeGraphs(worker.model, worker.runner.kv_cache, 8, 4, 64, worker.device)
    with pytest.raises(ValueError, match="device"):
        graphs.capture()
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig(enforce_eager="yes").validate()
