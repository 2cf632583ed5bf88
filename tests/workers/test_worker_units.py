"""Unit checks of the worker's building blocks, with expected values derived by hand (or from
transformers for the rotary frequencies)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_models import tiny_config
from helpers.worker_setup import engine_config
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import NewSequence, StepPlan
from pagedray.workers.kv_cache import KVCache, KVCacheSpec, copy_blocks
from pagedray.workers.layers.partition import HeadPartition, VocabPartition
from pagedray.workers.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedray.workers.models.model_info import model_info
from pagedray.workers.runner.input_batch import build_batch
from pagedray.workers.runner.seq_mirror import BatchedSequence, SequenceState
from pagedray.workers.worker import Worker

GREEDY = SamplingParams(temperature=0.0)


def test_head_partition_splits_and_replicates_kv_heads():
    # 8 query heads, 2 KV heads over 4 ranks: 2 query heads per rank; query heads 0-3 use KV head 0
    parts = [HeadPartition(8, 2, 4, r) for r in range(4)]
    assert [(p.first_head, p.num_local_heads) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(p.first_kv_head, p.num_local_kv_heads) for p in parts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # 8 query, 4 KV heads over 2 ranks: a plain split
    assert [(HeadPartition(8, 4, 2, r).first_kv_head, HeadPartition(8, 4, 2, r).num_local_kv_heads)
            for r in range(2)] == [(0, 2), (2, 2)]
    assert [(VocabPartition(251, 2, r).start, VocabPartition(251, 2, r).end) for r in range(2)] == \
        [(0, 126), (126, 251)]


def _state(seq_id, tokens, computed, blocks):
    return SequenceState(seq_id, tokens, [], computed, blocks, GREEDY)


def test_build_batch_positions_slots_and_logits_rows():
    # block_size 4. seq 7: decode of position 5 (blocks [3, 9]); seq 8: prefill chunk of positions
    # 2..5 after 2 cached tokens (blocks [4, 1]), finishing its 6-token prompt; seq 9: first chunk of
    # 3 tokens of a 10-token prompt (blocks [6]) -> does not sample.
    batch = [BatchedSequence.of(_state(7, [1, 2, 3, 4, 5, 6], 5, [3, 9]), 1),
             BatchedSequence.of(_state(8, [10, 11, 12, 13, 14, 15], 2, [4, 1]), 4),
             BatchedSequence.of(_state(9, list(range(20, 30)), 0, [6]), 3)]
    inputs = build_batch(batch, 4, torch.device("cpu"))
    assert inputs.input_ids.tolist() == [6, 12, 13, 14, 15, 20, 21, 22]
    assert inputs.positions.tolist() == [5, 2, 3, 4, 5, 0, 1, 2]
    # slot = table[p // 4] * 4 + p % 4
    assert inputs.meta.slot_mapping.tolist() == [9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1, 24, 25, 26]
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 1, 5, 8]
    assert inputs.meta.seq_lens_k.tolist() == [6, 6, 3]
    assert inputs.meta.block_tables.tolist() == [[3, 9], [4, 1], [6, 0]]
    assert inputs.meta.block_tables.dtype == torch.int32 and inputs.meta.cu_seqlens_q.dtype == torch.int32
    assert inputs.meta.max_query_len == 4
    assert inputs.logits_indices.tolist() == [0, 4]
    assert [s.seq_id for s in inputs.sampling_seqs] == [7, 8]


def test_copy_blocks_reads_sources_before_writing():
    kv = torch.randn(3, 2, 5, 4, 2, 8)
    before = kv.clone()
    copy_blocks(KVCache(kv), [(1, 2), (2, 4)])       # 4 receives the OLD content of 2
    assert torch.equal(kv[:, :, 2], before[:, :, 1]) and torch.equal(kv[:, :, 4], before[:, :, 2])
    assert torch.equal(kv[:, :, [0, 1, 3]], before[:, :, [0, 1, 3]])
    spec = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert spec.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2
    assert spec.blocks_for_bytes(10 * spec.bytes_per_block + 1) == 10


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config("llama")
    head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(head_dim, rope_parameters(config), torch.device("cpu")).inv_freq
    theirs, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    assert scaling == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert (ours < plain).any() and (ours == plain).any()   # the test config exercises both bands


def test_rotary_is_bit_identical_to_transformers():
    """q and k rotated together in one call (as the decoder does) == HF's apply_rotary_pos_emb, bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=4096)
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 4000, (37,), generator=gen)
    q, k = torch.randn((37, 2, 64), generator=gen), torch.randn((37, 1, 64), generator=gen)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(64, rope_parameters(config), torch.device("cpu")).cos_sin(positions, torch.float32)
    qk = apply_rotary(torch.cat([q, k], dim=1), *ours)
    assert torch.equal(qk[:, :2], q_hf[0].transpose(0, 1)) and torch.equal(qk[:, 2:], k_hf[0].transpose(0, 1))


def test_model_info_merges_eos_ids(tmp_path, tiny_model_path):
    folder = tiny_model_path("qwen3")
    info = model_info(folder)
    assert (info.architecture, info.vocab_size, info.max_position_embeddings) == ("Qwen3ForCausalLM", 251, 512)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, 1, 24)
    assert info.eos_token_ids == (2,)
    tiny_config("llama").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert model_info(tmp_path).eos_token_ids == (2, 7, 9)
    with pytest.raises(ValueError, match="no config.json"):
        model_info(tmp_path / "nowhere")


def test_reduced_precision_weights_and_cache(tiny_model_path):
    path = tiny_model_path("llama")
    plan = StepPlan(0, new_seqs=[NewSequence(0, [5, 17, 33, 8], [], 0, 4, [0], SamplingParams(temperature=0.0,
                                                                                            logprobs=3))])
    results = {}
    for dtype in ("float32", "bfloat16"):
        worker = Worker(engine_config(path, num_blocks=4, dtype=dtype))
        worker.init_kv_cache(4)
        assert {p.dtype for p in worker.model.parameters()} == {getattr(torch, dtype)}
        assert worker.runner.kv_cache.data.dtype == getattr(torch, dtype)
        results[dtype] = worker.execute(plan).sampled[0]
    top32 = dict(results["float32"].top_logprobs)
    for token, logprob in results["bfloat16"].top_logprobs:
        assert abs(top32[token] - logprob) < 0.1


def test_cpu_capacity_from_kv_cache_gib(tiny_model_path):
    from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig

    config = EngineConfig(model=ModelConfig(model=tiny_model_path("llama"), dtype="float32"),
                          cache=CacheConfig(block_size=8, kv_cache_gib=0.001))
    worker = Worker(config)
    # 2 layers x (K, V) x 8 slots x 2 KV heads x head_dim 16 x 4 bytes = 4096 bytes per block
    assert worker.kv_spec.bytes_per_block == 4096
    assert worker.available_kv_blocks() == int(0.001 * 2**30) // 4096 == 262
    worker.init_kv_cache(262)
    assert tuple(worker.runner.kv_cache.data.shape) == (2, 2, 262, 8, 2, 16)


def test_a_pending_token_is_the_one_rank_0_drew_for_that_sequence_at_its_last_step(tiny_model_path):
    """PENDING_TOKEN (async scheduling) resolves to the token the worker sampled at its previous
    step: the next step then runs exactly as if the engine had sent that token's id."""
    from pagedray.workers.contract.wire import PENDING_TOKEN, RunningDelta

    def new_plan(step_id):
        return StepPlan(step_id=step_id, new_seqs=[NewSequence(
            seq_id=7, prompt_token_ids=[3, 4, 5], output_token_ids=[], num_computed_tokens=0,
            num_scheduled_tokens=3, block_ids=[0], sampling_params=SamplingParams(temperature=0))])

    results = []
    for pending in (False, True):
        worker = Worker(engine_config(tiny_model_path("llama")))
        worker.init_kv_cache(8)
        first = worker.execute(new_plan(0)).sampled[0].token_id
        token = PENDING_TOKEN if pending else first
        second = worker.execute(StepPlan(step_id=1, running=[RunningDelta(seq_id=7, num_scheduled_tokens=1,
                                                                          new_token_id=token)]))
        results.append((first, second.sampled[0].token_id))
        if pending:
            with pytest.raises(ValueError, match="seq 8 asks for the token drawn at the previous step"):
                worker.execute(StepPlan(step_id=2, running=[RunningDelta(seq_id=8, num_scheduled_tokens=1,
                                                                         new_token_id=PENDING_TOKEN)]))
        worker.shutdown()
    assert results[0] == results[1]
