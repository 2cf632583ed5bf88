"""Speculative decoding (n-gram prompt lookup, ``num_speculative_tokens``): the proposer, the verification
on rank 0, and the engine end to end.

Exactness: greedy output with speculation equals greedy output without it and transformers' ``generate``
(tiny random Llama, fp32, and SmolLM2 on repetitive prompts), across chunked prefill, preemption,
prefix-cache hits, n=2, stop tokens and max_tokens inside an accepted run, logprobs, and TP=2 on Ray.
A random tiny model's greedy output never repeats itself, so n-gram proposals are rarely accepted
there; the engine tests also plug in ``ScriptedProposer``, which proposes the plain run's own tokens
with every third one wrong, so long accepted runs, rejections at every position and stops inside a
run all happen (SmolLM2 shows the n-gram proposer's own acceptance).
Seeded sampling gives the same tokens with and without speculation (each position draws with its own
(seed, position) noise). The verification keeps the target's distribution: a chi-square test over many
unseeded draws at the first position of a speculative step. No KV block outlives its request."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.hf_oracle import hf_greedy, hf_greedy_each
from helpers.speculation_runs import REPEATING
from helpers.speculation_runs import generate as _generate
from helpers.speculation_runs import tokens as _tokens
from pagedray.cluster import SamplingParams
from pagedray.cluster.speculation import NgramProposer, SpeculationStats
from pagedray.workers.contract.config import EngineConfig, SchedulerConfig
from pagedray.workers.contract.wire import NewSequence, RunningDelta, SampledToken, StepPlan, decode_plan, encode_plan
from pagedray.workers.runner.input_batch import build_host_batch
from pagedray.workers.runner.seq_mirror import SequenceMirror
from pagedray.workers.sampling.sampler import Sampler, SamplingRow
from pagedray.workers.sampling.speculative import cut_after_errors, verify
from pagedray.workers.worker import _sampling_rows


# -- the proposer ---------------------------------------------------------------------------------------------
def test_ngram_proposer_follows_the_latest_longest_match():
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]       # suffix 1 2 3 at 0
    assert proposer.propose([1, 2, 9, 4, 5, 9, 2, 3, 4, 2, 3], 2) == [4, 2]   # latest match of 2 3 wins
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]       # falls back to 2 tokens
    assert proposer.propose([7, 7, 7, 7], 3) == [7]                         # only one token follows
    assert proposer.propose([1, 2, 3, 4], 3) == []                          # no match
    assert proposer.propose([1, 2, 1, 2], 0) == [] and proposer.propose([1, 2], 3) == []
    assert proposer.propose([5, 256, 1, 256], 2) == []                      # byte-level matches are not tokens
    assert NgramProposer(1, 1).propose([4, 8, 4], 2) == [8, 4]
    assert proposer.propose_batch([([1, 2, 3, 1, 2], 2), ([9], 2)]) == [[3, 1], []]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)


def test_options_are_validated():
    for bad in ({"num_speculative_tokens": -1}, {"num_speculative_tokens": 17}, {"num_speculative_tokens": 1.5},
                {"prompt_lookup_min": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2}):
        name = next(iter(bad)) if "prompt_lookup_max" not in bad else "prompt_lookup_max"
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**bad).validate()
    with pytest.raises(ValueError, match="num_speculative_tokens: speculative decoding needs async_scheduling off"):
        EngineConfig(scheduler=SchedulerConfig(num_speculative_tokens=2, async_scheduling=True))
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")
    with pytest.raises(ValueError, match="num_speculative_tokens: set it above 0 to use speculative_model"):
        SchedulerConfig(speculative_model="/models/draft").validate()
    with pytest.raises(ValueError, match="speculative_model"):
        SchedulerConfig(num_speculative_tokens=2, speculative_model="").validate()


def test_stats_count_per_position():
    stats = SpeculationStats()
    stats.record(3, 1)
    stats.record(2, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 3)
    assert stats.proposed_per_position == [2, 2, 1] and stats.accepted_per_position == [2, 1, 0]


# -- verification on rank 0 -----------------------------------------------------------------------------------
def _token(seq_id, token_id, error=None):
    return SampledToken(seq_id, token_id, error=error)


def test_verify_keeps_accepted_drafts_and_the_first_differing_token():
    sampled = [_token(1, 10), _token(1, 11), _token(1, 99), _token(1, 13),   # seq 1: drafts 10 11 12
               _token(2, 50),                                                 # seq 2: no drafts
               _token(3, 7), _token(3, 8)]                                    # seq 3: draft 7, all accepted
    drafts = ((), (10,), (10, 11), (10, 11, 12), (), (), (7,))
    kept = [sampled[i] for i in verify(sampled, drafts)]
    assert [(t.seq_id, t.token_id) for t in kept] == [(1, 10), (1, 11), (1, 99), (2, 50), (3, 7), (3, 8)]
    assert verify([_token(4, 0, error="bad"), _token(4, 5)], ((), (5,))) == [0]   # a failed row ends it
    assert verify(sampled[:2], ()) == [0, 1]
    assert cut_after_errors([_token(1, 3), _token(1, 0, error="x"), _token(1, 4), _token(2, 5)]) == [
        _token(1, 3), _token(1, 0, error="x"), _token(2, 5)]
    with pytest.raises(ValueError, match="row_drafts"):
        verify(sampled, ((),))


def test_rows_after_drafts_see_them_as_output_tokens():
    class State:
        seq_id, params, prompt_token_ids, output_token_ids = 1, SamplingParams(), [1, 2], [3]

    rows = _sampling_rows([State, State, State], ((), (7,), (7, 8)))
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8]]
    assert [r.num_drafts for r in rows] == [0, 1, 2]
    assert State.output_token_ids == [3]


def test_verification_keeps_the_target_distribution():
    """A speculative step with draft d at the first position: the first token kept is drawn from p (the
    target's distribution there), so d is accepted with probability p(d). Chi-square over 4,000 unseeded
    draws on an 8-token vocabulary (7 degrees of freedom; 24.3 is the 0.999 quantile), and the acceptance
    rate within 4 standard deviations of p(d)."""
    probs = torch.tensor([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    logits = torch.stack([probs.log(), torch.randn(8)])            # row 0: p; row 1: after the draft
    draft, draws = 2, 4000
    sampler = Sampler(seed=1234)
    params = SamplingParams(temperature=1.0)
    counts, accepted = torch.zeros(8), 0
    for _ in range(draws):
        rows = [SamplingRow(1, params, [0], []), SamplingRow(1, params, [0], [draft])]
        sampled = sampler(logits, rows)
        kept = [sampled[i] for i in verify(sampled, ((), (draft,)))]
        counts[kept[0].token_id] += 1
        accepted += len(kept) == 2
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts.tolist())
    p = float(probs[draft])
    assert abs(accepted / draws - p) < 4 * math.sqrt(p * (1 - p) / draws)


# -- the workers' mirror and inputs ---------------------------------------------------------------------------
def _mirror_with_one_decoding_sequence():
    mirror = SequenceMirror(block_size=4, num_blocks=32)
    new = NewSequence(seq_id=7, prompt_token_ids=[1, 2, 3, 4, 5], output_token_ids=[], num_computed_tokens=0,
                      num_scheduled_tokens=5, block_ids=[10, 11], sampling_params=SamplingParams())
    mirror.mark_computed(mirror.apply(StepPlan(step_id=0, new_seqs=[new])))
    return mirror


def test_mirror_computes_drafts_as_inputs_then_takes_accepted_ones_and_cut_blocks():
    mirror = _mirror_with_one_decoding_sequence()
    # token 6 sampled; drafts 7 8 9 at positions 6..8 (slots in a new block 12)
    plan = StepPlan(step_id=1, running=[RunningDelta(seq_id=7, num_scheduled_tokens=4, new_block_ids=[12],
                                                     new_token_id=6, draft_token_ids=[7, 8, 9])])
    plan = decode_plan(encode_plan(plan))                       # the fields survive the wire
    batch = mirror.apply(plan)
    host = build_host_batch(batch.batch, block_size=4)
    inputs = host.inputs
    assert inputs.input_ids.tolist() == [6, 7, 8, 9] and inputs.positions.tolist() == [5, 6, 7, 8]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3] and host.row_drafts == ((), (7,), (7, 8), (7, 8, 9))
    mirror.mark_computed(batch)
    state = mirror.state(7)
    assert state.output_token_ids == [6] and state.num_computed_tokens == 6   # drafts are not tokens
    # draft 7 accepted, 5 sampled after it; block 12 was given back, 13 replaces it
    plan = StepPlan(step_id=2, running=[RunningDelta(seq_id=7, num_scheduled_tokens=1, new_block_ids=[13],
                                                     new_token_id=5, accepted_token_ids=[7], num_kept_blocks=2)])
    batch = mirror.apply(plan)
    assert state.output_token_ids == [6, 7, 5] and state.num_computed_tokens == 7 and state.block_ids == [10, 11, 13]
    assert build_host_batch(batch.batch, block_size=4).inputs.input_ids.tolist() == [5]


@pytest.mark.parametrize("delta,field", [
    (RunningDelta(seq_id=7, num_scheduled_tokens=3, new_token_id=6, draft_token_ids=[7]), "draft_token_ids"),
    (RunningDelta(seq_id=7, num_scheduled_tokens=1, new_token_id=6, num_kept_blocks=3), "num_kept_blocks"),
    (RunningDelta(seq_id=7, num_scheduled_tokens=3, new_block_ids=[12], new_token_id=6, draft_token_ids=[7, 8],
                  num_kept_blocks=0), "block_ids"),
])
def test_mirror_refuses_inconsistent_speculative_deltas(delta, field):
    mirror = _mirror_with_one_decoding_sequence()
    with pytest.raises(ValueError, match=field):
        mirror.apply(StepPlan(step_id=1, running=[delta]))
    assert mirror.state(7).output_token_ids == [] and mirror.state(7).block_ids == [10, 11]   # unchanged


# -- the engine end to end ------------------------------------------------------------------------------------
class ScriptedProposer:
    """Proposes, for a sequence that starts with one of ``outputs``' prompts, the tokens the plain run
    emitted next, except that every third position (by output index) is replaced by a wrong token."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab: int = 512) -> None:
        self.script = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.vocab = vocab

    def propose_batch(self, requests):
        return [self.propose(token_ids, max_tokens) for token_ids, max_tokens in requests]

    def propose(self, token_ids, max_tokens):
        for prompt, output in self.script:
            if list(token_ids[:len(prompt)]) == prompt and list(token_ids[len(prompt):]) == output[:len(token_ids)
                                                                                                   - len(prompt)]:
                done = len(token_ids) - len(prompt)
                return [(t + 1) % self.vocab if (done + i) % 3 == 2 else t
                        for i, t in enumerate(output[done:done + max_tokens])]
        return []


def test_greedy_with_speculation_equals_without_and_transformers(tiny_llama_path, tiny_hf_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, plain_stats = _generate(tiny_llama_path, REPEATING, params)
    ngram, _ = _generate(tiny_llama_path, REPEATING, params, num_speculative_tokens=4)
    assert _tokens(ngram) == _tokens(plain)
    script = ScriptedProposer(REPEATING, [t[0] for t in _tokens(plain)])
    spec, stats = _generate(tiny_llama_path, REPEATING, params, script, num_speculative_tokens=4)
    assert _tokens(spec) == _tokens(plain)
    assert [t[0] for t in _tokens(spec)] == [hf_greedy(tiny_hf_model, p, 24) for p in REPEATING]
    assert plain_stats.spec_decode_num_draft_tokens_total == 0
    assert stats.spec_decode_num_draft_tokens_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0
    assert stats.num_steps_total < plain_stats.num_steps_total          # accepted drafts save steps
    positions = stats.spec_decode_accepted_per_position
    assert positions[0][0] == 0 and all(proposed >= accepted for _, proposed, accepted in positions)
    assert sum(accepted for *_, accepted in positions) == stats.spec_decode_num_accepted_tokens_total


def test_exact_across_chunked_prefill_preemption_prefix_hits_and_n2(tiny_llama_path):
    """A small cache (preemptions), a 16-token budget (chunked prefill, drafts cut by the budget),
    prompts sharing a prefix (cache hits), n=2 greedy samples and a stop token."""
    shared = list(range(200, 224))
    prompts = [shared + [5, 6, 5, 6, 5], shared + [9, 9, 9, 9], *REPEATING]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              *[SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=(7, 44))
                for _ in REPEATING]]
    tight = dict(num_blocks=14, max_num_batched_tokens=16, max_num_seqs=4)
    plain, _ = _generate(tiny_llama_path, prompts, params, **tight)
    script = ScriptedProposer(prompts, [r.outputs[0].token_ids for r in plain])
    spec, stats = _generate(tiny_llama_path, prompts, params, script, num_speculative_tokens=3, **tight)
    assert _tokens(spec) == _tokens(plain)
    assert [[c.finish_reason for c in r.outputs] for r in spec] == [[c.finish_reason for c in r.outputs]
                                                                     for r in plain]
    assert stats.num_preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    assert stats.spec_decode_num_accepted_tokens_total > 0


def test_max_tokens_stop_and_opt_out(tiny_llama_path):
    """Accepted runs never pass max_tokens or a stop token; ``speculative=False`` proposes nothing."""
    prompt = [3] * 12
    long_run, _ = _generate(tiny_llama_path, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    script = ScriptedProposer([prompt], [long_run[0].outputs[0].token_ids])
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        spec, _ = _generate(tiny_llama_path, [prompt], params, script, num_speculative_tokens=4)
        assert spec[0].outputs[0].token_ids == long_run[0].outputs[0].token_ids[:max_tokens]
    stop = long_run[0].outputs[0].token_ids[4]           # a stop token inside an accepted run
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    spec, _ = _generate(tiny_llama_path, [prompt], params, script, num_speculative_tokens=4)
    first = long_run[0].outputs[0].token_ids.index(stop)
    assert spec[0].outputs[0].token_ids == long_run[0].outputs[0].token_ids[:first + 1]
    assert spec[0].outputs[0].finish_reason == "stop"
    off = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    _, stats = _generate(tiny_llama_path, REPEATING, off, ScriptedProposer(REPEATING, [[0] * 12] * 4),
                         num_speculative_tokens=4)
    assert stats.spec_decode_num_draft_tokens_total == 0


def test_seeded_sampling_and_logprobs_are_unchanged(tiny_llama_path):
    """Seeded draws depend on (seed, position) only, so speculation changes no token; logprobs of
    accepted tokens come from the target's rows and equal the plain run's."""
    params = [SamplingParams(temperature=0.8, top_k=20, seed=11 + i, max_tokens=16, ignore_eos=True, logprobs=2)
              for i in range(len(REPEATING))]
    plain, _ = _generate(tiny_llama_path, REPEATING, params)
    script = ScriptedProposer(REPEATING, [t[0] for t in _tokens(plain)])
    spec, stats = _generate(tiny_llama_path, REPEATING, params, script, num_speculative_tokens=4)
    assert _tokens(spec) == _tokens(plain)
    assert stats.spec_decode_num_accepted_tokens_total > 0
    for a, b in zip(spec, plain):
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 16
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
            assert [v for _, v in x.top_logprobs] == pytest.approx([v for _, v in y.top_logprobs], abs=1e-5)


def test_smollm2_greedy_on_repetitive_text_equals_transformers(default_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
             "Copy the list: red, green, blue, red, green, blue, red, green,"]
    prompts = [tokenizer(t).input_ids for t in texts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec, stats = _generate(default_model_path, prompts, params, num_speculative_tokens=4, num_blocks=64,
                            block_size=16)
    assert [t[0] for t in _tokens(spec)] == hf_greedy_each(default_model_path, prompts, 32)
    assert stats.spec_decode_num_accepted_tokens_total > 0


@pytest.mark.slow   # the extended tier (README: -m slow): speculation in process, TP=2 on Ray without it
@pytest.mark.integration
def test_tp2_on_ray_with_speculation_matches_local(ray_session, tiny_llama_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = _generate(tiny_llama_path, REPEATING, params)
    script = ScriptedProposer(REPEATING, [t[0] for t in _tokens(plain)])
    spec, stats = _generate(tiny_llama_path, REPEATING, params, script, num_speculative_tokens=3,
                            tensor_parallel_size=2)
    assert _tokens(spec) == _tokens(plain)
    assert stats.spec_decode_num_accepted_tokens_total > 0


# -- structured output ----------------------------------------------------------------------------------------
def test_grammar_masks_after_drafts_and_rollback(default_model_path):
    """Row j of a speculating grammar sequence is masked as the grammar stands after its drafts; the drafts
    are rolled back (the matcher keeps its committed state); a forbidden draft leaves later rows masked by
    the state before it (no failure: verification discards those rows)."""
    from pagedray.deploy.openai.structured_output import _regex_grammar
    from pagedray.workers.sampling.grammar import GrammarBook
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    grammar = _regex_grammar("(ab|cd)+!")
    params = SamplingParams(grammar=grammar)
    ab, cd = tokenizer.encode("ab", add_special_tokens=False), tokenizer.encode("cd", add_special_tokens=False)
    bang = tokenizer.encode("!", add_special_tokens=False)
    committed, drafts = ab, cd + bang
    logits = torch.randn(len(drafts) + 1, len(tokenizer), generator=torch.Generator().manual_seed(4))
    book = GrammarBook(default_model_path)
    rows = [SamplingRow(5, params, [1], committed + drafts[:j], j) for j in range(len(drafts) + 1)]
    masked = book.mask(logits, rows)
    for j in range(len(drafts) + 1):
        fresh = GrammarBook(default_model_path).mask(logits[j:j + 1], [SamplingRow(9, params, [1],
                                                                                    committed + drafts[:j])])
        assert torch.equal(torch.isfinite(masked[j]), torch.isfinite(fresh[0]))
    assert book._tracked[5].consumed == len(committed)                    # drafts were rolled back
    forbidden = [tokenizer.encode("x", add_special_tokens=False)[0]]
    rows = [SamplingRow(5, params, [1], committed + forbidden[:j], j) for j in range(2)]
    masks = book.compute(rows)
    assert masks.failures == {} and bool(torch.isfinite(book.apply(logits[:2], masks)[1]).any())


def test_structured_output_with_speculation_keeps_output_and_grammar(default_model_path):
    from pagedray.deploy.openai.structured_output import _regex_grammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt = tokenizer("Copy the list: red, green, blue, red, green, blue, red, green, blue,").input_ids
    params = SamplingParams(temperature=0, max_tokens=40, grammar=_regex_grammar("( (red|green|blue),){6}"))
    plain, _ = _generate(default_model_path, [prompt], params, num_blocks=64, block_size=16)
    spec, stats = _generate(default_model_path, [prompt], params, num_blocks=64, block_size=16,
                            num_speculative_tokens=4)
    assert _tokens(spec) == _tokens(plain)
    text = tokenizer.decode(spec[0].outputs[0].token_ids, skip_special_tokens=True)
    assert text.count(",") == 6 and set(text.replace(",", " ").split()) <= {"red", "green", "blue"}
    assert stats.spec_decode_num_accepted_tokens_total > 0
