"""Prefix caching for a hybrid model (Qwen3.5: linear-attention layers with a recurrent state; cluster/hybrid.py,
block_manager/state_pool.py), end to end through ``LLM`` in process, fp32, against transformers' greedy tokens:

- a conversation: each turn's prompt extends the last turn's prompt and output; a turn resumes from the snapshot
  taken at the end of the previous prompt's last full block, then from where it left the cached blocks;
- a shared system prompt: the second prompt finds the system prompt's KV cached but no state there, computes it
  and snapshots it (the branch point); the third resumes from that snapshot.

Each prompt's hit is asserted to the token, so a snapshot taken at the wrong place or a hit that skipped its copy
shows twice: as a wrong count or as tokens that differ from transformers'. Sync and async scheduling in process,
and TP=2 on Ray (each rank snapshots and restores its own heads' states)."""

from __future__ import annotations

import pytest
from helpers.hybrid_runs import conversation_and_system_prompt, hybrid_llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_conversation_turns_and_a_shared_system_prompt_resume_from_snapshots(tiny_model_path, async_scheduling):
    conversation_and_system_prompt(tiny_model_path("qwen3.5"), hybrid_llm(tiny_model_path("qwen3.5"), async_scheduling))


def test_the_same_through_the_triton_delta_rule(tiny_model_path):
    """The CUDA path's delta rule (one Triton launch per phase between cuts) run under the interpreter."""
    llm = hybrid_llm(tiny_model_path("qwen3.5"))
    for layer in llm.engine.executor.worker.model.layers:
        if layer.kind == "linear_attention":
            layer.linear_attn.use_triton = True
    conversation_and_system_prompt(tiny_model_path("qwen3.5"), llm)


@pytest.mark.integration
def test_the_same_at_tp2_on_ray(tiny_model_path, ray_session):
    conversation_and_system_prompt(tiny_model_path("qwen3.5"), hybrid_llm(tiny_model_path("qwen3.5"), tp=2))


def test_snapshots_naming_bad_slots_or_positions_are_value_errors(tiny_model_path):
    from pagedray.workers.models.qwen3_5 import Qwen3_5ForCausalLM

    llm = hybrid_llm(tiny_model_path("qwen3.5"))
    try:
        model = llm.engine.executor.worker.model           # 128 seats + 4 snapshots
        model.check_snapshots([(0, 8, 130)])
        for bad in ((0, 8, 132), (-1, 8, 130), (0, 0, 130), (3, 8, 3)):
            with pytest.raises(ValueError, match="state_snapshots"):
                model.check_snapshots([bad])
    finally:
        llm.shutdown()
    # rows (slot 4: tokens [0, 5) from position 11; slot 6: [5, 9) from position 0): a cut must end inside its row
    cuts = Qwen3_5ForCausalLM._snapshot_cuts([(4, 16, 130), (6, 4, 131), (4, 12, 129)], [11, 0], [0, 5, 9], [4, 6])
    assert cuts == {0: ((1, 129), (5, 130)), 1: ((4, 131),)}
    for seat, position in ((4, 11), (4, 17), (5, 8)):
        with pytest.raises(ValueError, match="state_snapshots: seat"):
            Qwen3_5ForCausalLM._snapshot_cuts([(seat, position, 130)], [11, 0], [0, 5, 9], [4, 6])
