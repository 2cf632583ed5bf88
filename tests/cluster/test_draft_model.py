"""Speculative decoding with a draft model on the TP ranks (``speculative_model``, workers/runner/draft_model.py).

Two oracles: the target's output is exactly the output without speculation (and transformers' greedy
``generate``), and every draft the ranks propose is the draft model's own greedy continuation of the
sequence as it stood (transformers ``generate`` on the draft model), which checks the draft's paged KV
cache under the same block ids as the target's: chunked prefill, preemption, prefix hits, rollback after
rejected drafts and the catch-up after a step that accepted all of them."""

from __future__ import annotations

import pytest
from helpers.hf_oracle import hf_greedy, load_hf_model
from helpers.speculation_runs import ENGINE, REPEATING, generate, save_llama, tokens
from pagedray.cluster import LLM, SamplingParams
from pagedray.cluster.llm import build_engine_config
from pagedray.workers.contract.wire import MODEL_DRAFT, NewSequence, StepPlan
from pagedray.workers.runner.draft_model import DraftModel
from pagedray.workers.runner.seq_mirror import SequenceMirror
from pagedray.workers.tp_group import TPGroup
from pagedray.workers.worker import Worker

TIGHT = dict(num_blocks=14, max_num_batched_tokens=16, max_num_seqs=4)   # preemptions, chunked prefill
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
SHARED_PREFIX = [PREFIX + [7, 8, 9], PREFIX + [21, 22]] + REPEATING[:2]


@pytest.fixture(scope="module")
def draft_model_path(tmp_path_factory):
    """A smaller Llama with the tiny Llama's 512-token vocabulary and weights of its own (one layer)."""
    return save_llama(tmp_path_factory.mktemp("draft-llama"), 512, 1, seed=99)


def _recorded_drafts(llm: LLM) -> list[tuple[list[int], tuple[int, ...]]]:
    """Wraps the worker's draft model: every (sequence tokens, drafts) it proposes, as it proposes them."""
    drafter, seen = llm.engine.executor.worker.drafter, []
    propose = drafter.propose

    def recording(batch):
        out = propose(batch)
        seen.extend((item.state.prompt_token_ids + item.state.output_token_ids, item.draft_token_ids)
                    for item in out if item.draft_token_ids)
        return out

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("draft", ["other", "target"])
def test_every_draft_is_the_draft_models_greedy_continuation(tiny_llama_path, draft_model_path, draft):
    """Also across preemptions, chunked prefill and prefix hits; with the target as its own draft nearly
    every step accepts all drafts, so the catch-up run (2 tokens) happens at nearly every step."""
    path = draft_model_path if draft == "other" else tiny_llama_path
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    with LLM(tiny_llama_path, **{**ENGINE, **TIGHT, "num_blocks": 10}, num_speculative_tokens=3,
             speculative_model=path) as llm:
        seen = _recorded_drafts(llm)
        results = llm.generate(SHARED_PREFIX, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert stats.num_preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    assert len(seen) >= 8 and all(MODEL_DRAFT not in drafts for _, drafts in seen)
    hf_draft = load_hf_model(path)
    for context, drafts in seen:
        assert list(drafts) == hf_greedy(hf_draft, context, len(drafts)), context
    plain, _ = generate(tiny_llama_path, SHARED_PREFIX, params)
    assert tokens(results) == tokens(plain)
    accepted = stats.spec_decode_num_accepted_tokens_total / stats.spec_decode_num_draft_tokens_total
    assert accepted > 0.9 if draft == "target" else accepted < 0.9


def test_draft_model_keeps_greedy_and_seeded_output_exact(tiny_llama_path, draft_model_path, tiny_hf_model):
    """A different small model proposes (acceptance is low); exactness holds across preemptions and a
    chunked budget, greedy and seeded, and every block is given back."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = generate(tiny_llama_path, REPEATING, greedy)
    draft_kwargs = dict(num_speculative_tokens=3, speculative_model=draft_model_path)
    results, stats = generate(tiny_llama_path, REPEATING, greedy, **TIGHT, **draft_kwargs)
    assert tokens(results) == tokens(plain)
    assert [t[0] for t in tokens(results)] == [hf_greedy(tiny_hf_model, p, 16) for p in REPEATING]
    assert stats.spec_decode_num_draft_tokens_total > 0 and stats.num_preemptions_total > 0
    seeded = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=12, ignore_eos=True, n=1 + i % 2)
              for i in range(len(REPEATING))]
    plain, _ = generate(tiny_llama_path, REPEATING, seeded)
    spec, _ = generate(tiny_llama_path, REPEATING, seeded, **draft_kwargs)
    assert tokens(spec) == tokens(plain)


def test_the_target_as_its_own_draft_model_accepts_every_greedy_draft(tiny_llama_path):
    """Every greedy draft is what the target samples (up to float rounding between batch shapes), so most
    steps emit k + 1 tokens."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, plain_stats = generate(tiny_llama_path, REPEATING, params)
    spec, stats = generate(tiny_llama_path, REPEATING, params, num_speculative_tokens=4,
                           speculative_model=tiny_llama_path)
    assert tokens(spec) == tokens(plain)
    assert stats.spec_decode_num_accepted_tokens_total >= 0.9 * stats.spec_decode_num_draft_tokens_total
    assert stats.num_steps_total < plain_stats.num_steps_total / 2


@pytest.mark.slow   # the extended tier (README: -m slow): the draft model in process, TP=2 on Ray without it
@pytest.mark.integration
def test_tp2_on_ray_with_a_draft_model_matches_local(ray_session, tiny_llama_path, draft_model_path):
    """Both models sharded over the two ranks; the drafts (argmax on rank 0, broadcast) agree on both."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = generate(tiny_llama_path, REPEATING, params)
    for path in (draft_model_path, tiny_llama_path):
        spec, stats = generate(tiny_llama_path, REPEATING, params, num_speculative_tokens=3, speculative_model=path,
                               tensor_parallel_size=2)
        assert tokens(spec) == tokens(plain)
        assert stats.spec_decode_num_draft_tokens_total > 0
    assert stats.spec_decode_num_accepted_tokens_total > 0.9 * stats.spec_decode_num_draft_tokens_total


def test_the_kv_memory_is_shared_with_the_draft_cache(tiny_llama_path, draft_model_path):
    def worker(**scheduler) -> Worker:
        return Worker(build_engine_config(tiny_llama_path, dtype="float32", kv_cache_gib=0.01, threads_per_worker=1,
                                          **scheduler))

    alone, with_draft = worker(), worker(num_speculative_tokens=2, speculative_model=draft_model_path)
    own, draft = with_draft.kv_spec.bytes_per_block, with_draft.drafter.kv_spec.bytes_per_block
    assert draft < own and alone.available_kv_blocks() > with_draft.available_kv_blocks()
    assert with_draft.available_kv_blocks() == alone.available_kv_blocks() * own // (own + draft)
    for w in (alone, with_draft):
        w.shutdown()


def test_bad_draft_models_are_refused_naming_the_option(tiny_llama_path, tmp_path):
    wide = save_llama(tmp_path / "wide", 1024, 1, seed=5)
    with pytest.raises(ValueError, match="speculative_model: its vocabulary"):
        LLM(tiny_llama_path, **ENGINE, num_speculative_tokens=2, speculative_model=wide)
    config = build_engine_config(tiny_llama_path, num_speculative_tokens=2, speculative_model=wide)
    with pytest.raises(ValueError, match="speculative_model: tensor_parallel_size=4 must divide"):
        DraftModel(wide, config, None, TPGroup(0, 4, "cpu", owns_process_group=False), None, "cpu", 64)
    with pytest.raises(ValueError, match="speculative_model: model: .* is not a folder"):
        LLM(tiny_llama_path, **ENGINE, num_speculative_tokens=2, speculative_model=str(tmp_path / "missing"))


def test_model_draft_placeholders_need_a_draft_model():
    def plan(drafts):
        return StepPlan(step_id=0, new_seqs=[NewSequence(seq_id=1, prompt_token_ids=[5, 6], output_token_ids=[],
                                                         num_computed_tokens=0, num_scheduled_tokens=2 + len(drafts),
                                                         block_ids=[0], sampling_params=SamplingParams(),
                                                         draft_token_ids=drafts)])

    with pytest.raises(ValueError, match="draft_token_ids: seq 1 asks for drafts of a draft model"):
        SequenceMirror(8, 4).apply(plan([MODEL_DRAFT, MODEL_DRAFT]))
    with pytest.raises(ValueError, match="draft_token_ids: seq 1 mixes MODEL_DRAFT placeholders"):
        SequenceMirror(8, 4, model_drafts=True).apply(plan([MODEL_DRAFT, 9]))
    batch = SequenceMirror(8, 4, model_drafts=True).apply(plan([MODEL_DRAFT, MODEL_DRAFT])).batch
    assert batch[0].draft_token_ids == (MODEL_DRAFT, MODEL_DRAFT) and batch[0].samples
