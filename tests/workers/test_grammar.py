"""GrammarBook (llguidance masks on rank 0) on random logits with the default model's tokenizer: every
sampled text follows its grammar, matchers replay output tokens after a loss, released ones go."""

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedray.deploy.openai.structured_output import _regex_grammar, schema_grammar
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.sampling.grammar import GrammarBook, _unpack
from pagedray.workers.sampling.sampler import Sampler, SamplingRow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "maxItems": 3,
                                                                                "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _generate(book, sampler, grammars, eos, vocab, seed, steps=200):
    """Sample every row until EOS (random logits, temperature 1): the grammar alone keeps the text valid."""
    generator = torch.Generator().manual_seed(seed)
    outputs = [[] for _ in grammars]
    done = [False] * len(grammars)
    for _ in range(steps):
        live = [i for i in range(len(grammars)) if not done[i]]
        if not live:
            return outputs
        rows = [SamplingRow(i, SamplingParams(temperature=1.0, seed=seed + i, max_tokens=steps, grammar=grammars[i]),
                            [1], list(outputs[i])) for i in live]
        logits = torch.randn(len(rows), vocab, generator=generator) * 4
        sampled = sampler(book.mask(logits, rows), rows)
        book.advance(rows, [t.token_id for t in sampled])
        for i, token in zip(live, sampled):
            outputs[i].append(token.token_id)
            done[i] = token.token_id == eos
    raise AssertionError("a grammar never finished")


def test_random_logits_always_give_text_the_grammar_accepts(default_model_path, tokenizer):
    book, sampler = GrammarBook(default_model_path), Sampler(seed=0)
    grammars = [schema_grammar(SCHEMA, "x"), _regex_grammar("(yes|no|maybe)!"), None]
    vocab = len(tokenizer)
    for seed in range(3):
        outs = _generate(book, sampler, grammars[:2], tokenizer.eos_token_id, vocab, seed)
        value = json.loads(tokenizer.decode(outs[0], skip_special_tokens=True))
        jsonschema.validate(value, SCHEMA)
        assert tokenizer.decode(outs[1], skip_special_tokens=True) in ("yes!", "no!", "maybe!")
        book.release(range(2))
    assert len(book) == 0


def test_rows_without_grammar_are_untouched_and_masks_forbid(default_model_path, tokenizer):
    book = GrammarBook(default_model_path)
    logits = torch.randn(2, len(tokenizer), generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(0, SamplingParams(grammar=_regex_grammar("[0-9]+")), [1], []),
            SamplingRow(1, SamplingParams(), [1], [])]
    masked = book.mask(logits, rows)
    assert torch.equal(masked[1], logits[1])
    allowed = torch.isfinite(masked[0]).nonzero()[:, 0].tolist()
    assert allowed and all(tokenizer.decode([t]).strip().isdigit() for t in allowed)
    assert torch.equal(masked[0][allowed], logits[0][allowed])


def test_a_lost_matcher_is_rebuilt_by_replaying_the_output(default_model_path, tokenizer):
    grammar = schema_grammar(SCHEMA, "x")
    prefix = tokenizer.encode('{"name":"Al","age":4', add_special_tokens=False)   # compact JSON
    logits = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(2))
    incremental = GrammarBook(default_model_path)
    for n in range(len(prefix) + 1):
        row = SamplingRow(7, SamplingParams(grammar=grammar), [1], prefix[:n])
        mask_incremental = incremental.mask(logits, [row])
        if n < len(prefix):
            incremental.advance([row], [prefix[n]])
    replayed = GrammarBook(default_model_path).mask(logits, [row])   # first sight, output already there
    assert torch.equal(torch.isfinite(mask_incremental), torch.isfinite(replayed))


def test_unpack_pads_logits_wider_than_the_bitmask():
    bitmask = torch.tensor([[0b101, -2**31]], dtype=torch.int32)   # tokens 0, 2 and 63 allowed
    allowed = _unpack(bitmask, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero()[:, 0].tolist() == [0, 2, 63]


def _object(props, children_required):
    return {"type": "object", "properties": props, "required": children_required, "additionalProperties": False}


_LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda values: {"enum": values},
              st.lists(st.sampled_from(["a", "bc", 1, 20, None]), min_size=1, max_size=3, unique=True)),
)


def _containers(children):
    objects = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: _object(props, required)) if props else st.just(_object({}, [])))
    arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))
    return st.one_of(objects, arrays)


# bounded schemas (string lengths, array sizes, integer ranges, closed objects): random logits finish them
SCHEMAS = st.recursive(_LEAVES, _containers, max_leaves=6)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_200_random_schemas_every_output_validates(grammar_book, tokenizer, schema, seed):
    book, sampler = grammar_book
    out = _generate(book, sampler, [schema_grammar(schema, "x")], tokenizer.eos_token_id, len(tokenizer), seed)[0]
    book.release([0])
    text = tokenizer.decode(out, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def grammar_book(default_model_path):
    return GrammarBook(default_model_path), Sampler(seed=0)
