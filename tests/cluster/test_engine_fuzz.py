"""Engine fuzzer (issue #32): requests with sampling parameters at their edges x grammar kinds x logprobs,
some with logits poisoned to NaN mid-generation, through the real Engine (LocalExecutor, a tiny random
Llama that carries SmolLM2's tokenizer, so grammars see a real vocabulary).

Properties, after every example: the engine is alive, every request it admitted ended (a poisoned one
or one whose grammar fails at run time with finish_reason "error" and a message, the others as
usual), a grammar request's text follows its grammar, no token came from a NaN row, and every KV block
is free again. Parameters the engine must refuse (a repetition penalty that is 0 in float32, ...) raise
ValueError naming the field and change nothing.

Before #32, one request with the regex ``(a{1000}){1000}`` (llguidance: "lexer too complex" at the first
mask) or a NaN row under a grammar raised out of the step and marked the whole engine dead.
"""

import dataclasses
import json
import re
import shutil
import threading

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pagedray.cluster.engine import Engine
from pagedray.cluster.llm import build_engine_config
from pagedray.deploy.openai.structured_output import _regex_grammar, schema_grammar
from pagedray.workers.contract.sampling_params import SamplingParams

POISON = 7               # a stop token id that marks a request whose logits turn NaN (test-only convention)
POISON_AFTER = 2         # output tokens before the poison
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
TOO_COMPLEX = "(a{1000}){1000}"   # llguidance: lexer too complex, at the first mask


@pytest.fixture(scope="module")
def tiny_smol_path(tmp_path_factory, default_model_path):
    """A 1-layer random Llama with SmolLM2's vocabulary and tokenizer files (fast, real tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    path = tmp_path_factory.mktemp("tiny-smol")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return _save_with_smol_tokenizer(LlamaForCausalLM(config), path, tokenizer, default_model_path)


def _save_with_smol_tokenizer(model, path, tokenizer, default_model_path) -> str:
    """``model`` saved to ``path`` with SmolLM2's generation ids and tokenizer files; returns the folder."""
    from transformers import GenerationConfig

    model.eval().save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_path}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def tiny_smol_hybrid_path(tmp_path_factory, default_model_path):
    """A 2-layer random Qwen3.5 (one Gated DeltaNet layer, one gated attention layer) with SmolLM2's vocabulary
    and tokenizer files: the fuzzer's hybrid model, whose sequences each hold a state slot."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    path = tmp_path_factory.mktemp("tiny-smol-hybrid")
    config = Qwen3_5TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                               linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               tie_word_embeddings=True)
    torch.manual_seed(0)
    return _save_with_smol_tokenizer(Qwen3_5ForCausalLM(config), path, tokenizer, default_model_path)


class RepeatProposer:
    """Speculative decoding in the fuzzer: proposes the last token again (accepted under a +100 logit_bias,
    or when the random model repeats itself; masked by grammars; rejected otherwise)."""

    def propose_batch(self, requests):
        return [[token_ids[-1]] * room for token_ids, room in requests]


@pytest.fixture(scope="module", params=["sync", "async_scheduling", "speculative", "draft_model", "hybrid",
                                        "hybrid_sync"])
def engine(request, tiny_smol_path, tiny_smol_hybrid_path):
    """``draft_model``: the model drafts for itself on the rank (greedy drafts; accepted where the target
    samples greedily without a bias, masked by grammars and poisoned rows like any other). ``hybrid``: a Qwen3.5
    under async scheduling, whose sequences (n > 1 forks included) each hold a state slot; ``hybrid_sync``: the same
    scheduled synchronously, where decoding sequences also take trailing prefix-cache state snapshots."""
    hybrid = request.param.startswith("hybrid")
    config = build_engine_config(tiny_smol_hybrid_path if hybrid else tiny_smol_path, dtype="float32", block_size=8,
                                 num_blocks=96, max_num_seqs=8, threads_per_worker=1,
                                 async_scheduling=request.param in ("async_scheduling", "hybrid"),
                                 num_speculative_tokens=3 if request.param in ("speculative", "draft_model") else 0,
                                 speculative_model=tiny_smol_path if request.param == "draft_model" else None)
    engine = Engine(config)
    if request.param == "speculative":
        engine.scheduler.proposer = RepeatProposer()
    _poison_rows(engine)
    yield engine
    engine.shutdown()


def _poison_rows(engine: Engine) -> None:
    """Rank 0's logits turn NaN for rows whose params carry the POISON stop id, after POISON_AFTER tokens
    (a row after speculative drafts counts them)."""
    runner = engine.executor.worker.runner
    run = runner.run

    def poisoned_run(step):
        output = run(step)
        drafts = output.row_drafts or ((),) * len(output.sampling_seqs)
        rows = [i for i, seq in enumerate(output.sampling_seqs)
                if POISON in seq.params.stop_token_ids and len(seq.output_token_ids) + len(drafts[i]) >= POISON_AFTER]
        if not rows:
            return output
        logits = output.logits.clone()   # [rows, vocab]; an inference tensor cannot be written in place
        logits[rows] = float("nan")
        return dataclasses.replace(output, logits=logits)

    runner.run = poisoned_run


GRAMMARS = {
    "none": None,
    "json": lambda: schema_grammar(SCHEMA, "json"),
    "regex": lambda: _regex_grammar("[ab]{1,4}"),
    "choice": lambda: _regex_grammar("yes|no"),
    "too_complex": lambda: _regex_grammar(TOO_COMPLEX),
}

requests = st.fixed_dictionaries({
    "grammar": st.sampled_from(sorted(GRAMMARS)),
    "poison": st.booleans(),
    "n": st.sampled_from([1, 2, 3]),
    "max_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0.0, 0.0, 1e-6, 2e-5, 1.0, 1.0, 1e4] + [1e30]),   # the last one is refused
    "top_p": st.sampled_from([1e-30, 0.5, 1.0]),
    "top_k": st.sampled_from([0, 1, 5]),
    "min_p": st.sampled_from([0.0, 1.0]),
    "repetition_penalty": st.sampled_from([0.01, 1.0, 1.0, 1.0, 1.0, 100.0] + [1e-45, 1e30]),   # the last two refused
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**32), st.sampled_from([2**63 - 1, 2**63 - 2, -(2**63)])),
    "logprobs": st.one_of(st.none(), st.sampled_from([0, 2, 20])),
    "min_tokens": st.sampled_from([0, 1]),
    "logit_bias": st.sampled_from([(), ((5, 100.0),), ((5, -100.0), (6, 100.0))]),
})


def _params(spec: dict) -> SamplingParams:
    fields = {k: v for k, v in spec.items() if k not in ("grammar", "poison")}
    grammar = GRAMMARS[spec["grammar"]]
    if grammar is not None:
        fields["grammar"], fields["min_tokens"] = grammar(), 0   # the ingress refuses min_tokens with a grammar
    if spec["poison"]:
        fields["stop_token_ids"] = (POISON,)
    return SamplingParams(**fields)


def _run(engine: Engine, specs: list[dict], prompt: list[int]) -> dict[str, tuple[dict, object]]:
    admitted = {}
    for i, spec in enumerate(specs):
        try:
            params = _params(spec)
        except ValueError as exc:   # refused up front: names the field, changes nothing
            field = str(exc).split(":", 1)[0]
            assert field in spec, exc
            continue
        request_id = f"r{i}"
        engine.add(request_id, prompt, params)
        admitted[request_id] = (spec, params)
    finals, tokens = {}, {rid: {} for rid in admitted}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            for completion in out.outputs:
                tokens[out.request_id].setdefault(completion.index, []).extend(completion.token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "requests still unfinished after 400 steps"
    assert set(finals) == set(admitted)
    return {rid: (admitted[rid][0], finals[rid], tokens[rid]) for rid in admitted}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(specs=st.lists(requests, min_size=1, max_size=5))
def test_no_request_kills_the_engine_and_every_block_comes_back(engine, specs):
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("Is the sky blue?")
    results = _run(engine, specs, prompt)
    assert not engine.is_dead
    engine.check_health()
    for spec, final, tokens in results.values():
        reasons = {c.finish_reason for c in final.outputs}
        event(f"{spec['grammar']} poison={spec['poison']}: {sorted(reasons)}")
        if spec["grammar"] == "too_complex":
            assert reasons == {"error"} and "grammar" in final.error
            continue
        if "error" in reasons:   # only a poisoned request may fail, and only at its poison
            assert spec["poison"] and final.error and "not finite" in final.error
            assert all(len(t) <= POISON_AFTER for t in tokens.values())
            continue
        if spec["poison"]:   # ended before its logits turned NaN (EOS, a grammar, max_tokens): no token after
            assert all(len(t) <= POISON_AFTER for t in tokens.values()), "a NaN row produced a token"
        if spec["grammar"] in ("regex", "choice", "json"):
            for sample in tokens.values():
                _assert_follows(spec["grammar"], tokenizer.decode(sample, skip_special_tokens=True), reasons)
    engine.step()   # the release-only step
    stats = engine.stats()
    event(f"speculative tokens accepted: {stats.spec_decode_num_accepted_tokens_total > 0}")
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks
    blocks = engine.block_manager.stats()
    assert blocks.num_state_slots == (8 if engine.model_info.hybrid else 0)    # max_num_seqs for the hybrid
    assert blocks.num_free_state_slots == blocks.num_state_slots
    engine.block_manager.check_invariants()


def _assert_follows(kind: str, text: str, reasons: set) -> None:
    if "length" in reasons:   # cut by max_tokens: a prefix of a valid text
        return
    if kind == "regex":
        assert re.fullmatch("[ab]{1,4}", text), text
    elif kind == "choice":
        assert text in ("yes", "no"), text
    else:
        assert json.loads(text).keys() == {"a"}, text


def test_the_speculating_engine_proposed_and_accepted_drafts(engine):
    """The fuzzed engine with speculation really speculated (a +100 logit_bias makes repeats certain; the
    model drafting for itself is right about its own greedy tokens)."""
    if engine.scheduler.proposer is None:
        pytest.skip("the engine runs without speculative decoding")
    bias = ((5, 100.0),) if isinstance(engine.scheduler.proposer, RepeatProposer) else ()
    engine.add("repeat", engine.tokenizer.encode("x"),
                       SamplingParams(temperature=0, max_tokens=9, logit_bias=bias, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens_total >= 6 and not engine.is_dead


def test_a_too_complex_grammar_fails_its_request_and_the_engine_serves_the_next(engine):
    prompt = engine.tokenizer.encode("x")
    bad = SamplingParams(n=4, temperature=1.0, max_tokens=4, grammar=_regex_grammar(TOO_COMPLEX))
    good = SamplingParams(temperature=0, max_tokens=4)
    engine.add("bad", prompt, bad)
    engine.add("good", prompt, good)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert {c.finish_reason for c in finals["bad"].outputs} == {"error"}
    assert finals["bad"].error.startswith("sample ") and len(finals["bad"].error) < 300
    assert [c.finish_reason for c in finals["good"].outputs] == ["length"]
    engine.add("after", prompt, good)
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert finals["after"].outputs[0].finish_reason == "length" and not engine.is_dead


def test_grammar_masks_are_computed_while_the_forward_runs(engine):
    """Rank 0 starts a step's masks before its forward and waits for them after: the forward below does
    not return until the mask thread has begun (a hang guard only; before #32 masks came after it)."""
    worker = engine.executor.worker
    book, runner = worker.grammars, worker.runner
    compute, run = book.compute, runner.run
    started, overlapped = threading.Event(), []

    def compute_and_signal(rows):
        started.set()
        return compute(rows)

    def run_waiting_for_masks(step):
        if step is not None and any(s.params.grammar for s in step.host.sampling_seqs):
            overlapped.append(started.wait(60))
            started.clear()
        return run(step)

    book.compute, runner.run = compute_and_signal, run_waiting_for_masks
    try:
        params = SamplingParams(temperature=0, max_tokens=6, grammar=schema_grammar(SCHEMA, "json"))
        engine.add("masked", engine.tokenizer.encode("JSON:"), params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        book.compute, runner.run = compute, run
    assert overlapped and all(overlapped)
