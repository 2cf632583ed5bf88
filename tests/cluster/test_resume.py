"""Continuations (``Engine.add(..., resume_tokens=...)``): a request resumed from its prompt plus the
output tokens a lost run had already streamed goes on token for token as that run would have (greedy,
seeded with penalties, logprobs, a grammar), streams only the new tokens, and bad continuations are
ValueErrors naming ``resume_tokens`` that change nothing. The stream failover of the ingress builds on
it (deploy/serve/failover.py)."""

from __future__ import annotations

import pytest
from pagedray.cluster import SamplingParams
from pagedray.cluster.engine import Engine
from pagedray.cluster.llm import build_engine_config

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46], [3, 3, 3]]


def _engine(path, **kwargs) -> Engine:
    return Engine(build_engine_config(path, dtype="float32", block_size=8, num_blocks=64, threads_per_worker=1,
                                      **kwargs))


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, list[int]]]) -> dict:
    """request id -> (streamed tokens, logprobs, finish reason, how many outputs carried the prompt)."""
    for rid, (prompt, params, resume) in requests.items():
        engine.add(rid, prompt, params, resume_tokens=resume)
    got = {rid: ([], [], None, 0) for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _, prompts = got[out.request_id]
            for completion in out.outputs:
                tokens += completion.token_ids
                logprobs += [lp.logprob for lp in completion.logprobs or []]
                if completion.finish_reason is not None:
                    got[out.request_id] = (tokens, logprobs, completion.finish_reason, prompts)
            if out.prompt_token_ids is not None:
                t, lp, reason, _ = got[out.request_id]
                got[out.request_id] = (t, lp, reason, prompts + 1)
    return got


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=7, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5,
                   min_tokens=10, max_tokens=12, logprobs=0),
], ids=["greedy", "seeded-penalties"])
def test_a_continuation_goes_on_as_the_undisturbed_run(tiny_llama_path, params):
    engine = _engine(tiny_llama_path)
    try:
        full = _run(engine, {f"p{i}": (p, params, []) for i, p in enumerate(PROMPTS)})
        cuts = {}
        for i, prompt in enumerate(PROMPTS):
            tokens = full[f"p{i}"][0]
            for cut in (1, 5, len(tokens) - 1):
                cuts[f"p{i}-{cut}"] = (prompt, params, tokens[:cut])
        resumed = _run(engine, cuts)
        for rid, (_, _, resume) in cuts.items():
            tokens, logprobs, reason, prompts = full[rid.split("-")[0]]
            cut = len(resume)
            got_tokens, got_logprobs, got_reason, got_prompts = resumed[rid]
            assert got_tokens == tokens[cut:] and got_reason == reason and got_prompts == 1, rid
            assert got_logprobs == pytest.approx(logprobs[cut:], abs=1e-4), rid
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_a_continuation_replays_its_grammar(default_model_path):
    from pagedray.deploy.openai.structured_output import _regex_grammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt = tokenizer("List three colours:").input_ids
    params = SamplingParams(temperature=0, max_tokens=24, grammar=_regex_grammar("( (red|green|blue),){3}"))
    engine = Engine(build_engine_config(default_model_path, dtype="float32", num_blocks=64, block_size=16))
    try:
        tokens = _run(engine, {"full": (prompt, params, [])})["full"][0]
        resumed = _run(engine, {"cut": (prompt, params, tokens[:3])})["cut"][0]
    finally:
        engine.shutdown()
    assert tokens[3:] == resumed and tokenizer.decode(tokens).count(",") == 3


def test_bad_continuations_are_refused_naming_resume_tokens(tiny_llama_path):
    engine = _engine(tiny_llama_path, max_model_len=16)
    params = SamplingParams(temperature=0, max_tokens=4)
    try:
        for prompt, p, resume, message in [
                ([5, 6], SamplingParams(n=2, max_tokens=4), [7], "resumes one sample"),
                ([5, 6], params, [7, 8, 9, 10], "already reach max_tokens=4"),
                ([5, 6], params, [7, 10**6], "token 1000000 is not an id"),
                (list(range(10, 23)), SamplingParams(max_tokens=8), [7, 8, 9], "no room within max_model_len=16"),
                ([5, 6], params, "7 8", "must be a list")]:
            with pytest.raises(ValueError, match=f"resume_tokens: .*{message}"):
                engine.add("bad", prompt, p, resume_tokens=resume)
        assert not engine.has_unfinished_requests() and engine.stats().num_waiting == 0
    finally:
        engine.shutdown()
