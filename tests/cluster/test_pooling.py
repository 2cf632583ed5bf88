"""Pooling requests (#66): embeddings and yes/no rerank scores against transformers' hidden states and logits of
the same model (fp32): last-token and mean pooling over chunked prefill, batched with generation requests in the
same steps, a cached prefix, TP=2; a Qwen3-Reranker-shaped random model's scores; the checks and the wire."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_oracle import hf_greedy, load_hf_model
from helpers.tiny_models import save_tiny_classifier, save_tiny_reranker
from pagedray.cluster import LLM, SamplingParams
from pagedray.cluster.pooling import finish_embedding, rerank_prompt, yes_no_score
from pagedray.cluster.request import Request
from pagedray.workers.contract.wire import PooledPart, StepResult, decode_result, encode_result

RNG = random.Random(66)
PROMPTS = [[RNG.randrange(3, 250) for _ in range(n)] for n in (5, 23, 40, 17)]


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", block_size=8, num_blocks=96, threads_per_worker=1, max_num_batched_tokens=16)
    return LLM(path, **{**options, **kwargs})


def hf_hidden(model, prompt: list[int]) -> torch.Tensor:
    """transformers' last_hidden_state of ``prompt``: [len(prompt), hidden]."""
    with torch.inference_mode():
        return model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]


def assert_same_vector(got: list[float], reference: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert torch.nn.functional.cosine_similarity(got, reference.float(), dim=0) >= 0.99999
    torch.testing.assert_close(got, reference.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_embeddings_equal_transformers_pooling_over_chunks_and_next_to_generation(kind, tiny_model_path):
    path = tiny_model_path(kind)
    hf = load_hf_model(path)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _llm(path) as llm:
        # one batch: generation requests and both poolings, in the same steps (16-token chunks)
        params = [greedy, SamplingParams(max_tokens=1, temperature=0, pooling="last"),
                  SamplingParams(max_tokens=1, temperature=0, pooling="mean"), greedy]
        mixed = llm.generate(PROMPTS, params, use_tqdm=False)
        raw = llm.embed(PROMPTS, normalize=False, use_tqdm=False)                 # pooling_type "last"
        means = llm.embed(PROMPTS, normalize=False, pooling_type="mean", use_tqdm=False)
        unit = llm.embed(PROMPTS[:2], use_tqdm=False)                             # normalized by default
        assert llm.engine.block_manager.num_free_blocks == 96                     # nothing held after
    assert mixed[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 6)
    assert mixed[3].outputs[0].token_ids == hf_greedy(hf, PROMPTS[3], 6)
    assert_same_vector(mixed[1].pooled, hf_hidden(hf, PROMPTS[1])[-1])
    assert_same_vector(mixed[2].pooled, hf_hidden(hf, PROMPTS[2]).mean(dim=0))
    for prompt, last, mean in zip(PROMPTS, raw, means):
        hidden = hf_hidden(hf, prompt)
        assert_same_vector(last.embedding, hidden[-1])
        assert_same_vector(mean.embedding, hidden.mean(dim=0))
    for prompt, result in zip(PROMPTS, unit):
        assert_same_vector(result.embedding, torch.nn.functional.normalize(hf_hidden(hf, prompt)[-1], dim=0))


def test_last_token_pooling_reads_the_prefix_cache_and_mean_pooling_does_not(tiny_model_path):
    path = tiny_model_path("llama")
    hf = load_hf_model(path)
    prompt = PROMPTS[2]
    with _llm(path) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # caches its blocks
        last, = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, pooling="last"), use_tqdm=False)
        mean, = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, pooling="mean"), use_tqdm=False)
    assert last.num_cached_prompt_tokens > 0 and mean.num_cached_prompt_tokens == 0
    assert_same_vector(last.pooled, hf_hidden(hf, prompt)[-1])
    assert_same_vector(mean.pooled, hf_hidden(hf, prompt).mean(dim=0))


def test_mean_pooling_survives_preemption(tiny_model_path, monkeypatch):
    """Two decoding requests grow into a 12-block pool while a 70-token mean-pooling prompt prefills: it is the
    preemption victim again and again (its sum starts again at position 0 each time), and its mean is exact."""
    path = tiny_model_path("llama")
    hf = load_hf_model(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (15, 15, 70)]
    generating = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    starts = []
    record = Request.record_pooled
    monkeypatch.setattr(Request, "record_pooled", lambda self, part: starts.append(part.start) or record(self, part))
    with _llm(path, num_blocks=12, watermark=0.0) as llm:
        results = llm.generate(prompts, [generating, generating, SamplingParams(max_tokens=1, pooling="mean")],
                               use_tqdm=False)
        assert llm.engine.block_manager.num_free_blocks == 12
    assert starts.count(0) >= 2                                        # recomputed after a preemption
    assert_same_vector(results[2].pooled, hf_hidden(hf, prompts[2]).mean(dim=0))
    assert results[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], 30)


def test_a_mean_part_restarts_at_zero_and_a_gap_is_an_error():
    request = Request("r", [5] * 6, SamplingParams(max_tokens=1, pooling="mean"), arrival=0)
    request.record_pooled(PooledPart(1, 0, 4, [4.0, 8.0]))
    assert request.pooled_result() is None                          # positions 4..5 still missing
    request.record_pooled(PooledPart(1, 0, 2, [1.0, 1.0]))          # recomputed from 0 after a preemption
    request.record_pooled(PooledPart(1, 2, 4, [5.0, 11.0]))
    assert request.pooled_result() == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="after 6 positions"):
        request.record_pooled(PooledPart(1, 3, 1, [0.0, 0.0]))


def test_finishing_an_embedding_truncates_then_normalizes():
    assert finish_embedding([3.0, 4.0, 12.0], normalize=True, dimensions=2, matryoshka=True) == [0.6, 0.8]
    assert finish_embedding([3.0, 4.0], normalize=False) == [3.0, 4.0]
    assert finish_embedding([0.0, 0.0], normalize=True) == [0.0, 0.0]
    with pytest.raises(ValueError, match="dimensions: this model does not declare"):
        finish_embedding([3.0, 4.0], normalize=True, dimensions=1)
    with pytest.raises(ValueError, match=r"dimensions: must be an integer in \[1, 2\]"):
        finish_embedding([3.0, 4.0], normalize=True, dimensions=3, matryoshka=True)


@pytest.mark.parametrize("field, kwargs", [("pooling", {"pooling": "max"}), ("n", {"pooling": "last", "n": 2}),
                                           ("pooling_token_ids", {"pooling_token_ids": [3]}),
                                           ("pooling_token_ids", {"pooling": "last", "pooling_token_ids": [-1]})])
def test_sampling_params_name_a_bad_pooling_field(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_the_engine_refuses_a_score_token_outside_the_vocabulary_and_changes_nothing(tiny_model_path):
    with _llm(tiny_model_path("llama")) as llm:
        with pytest.raises(ValueError, match="pooling_token_ids: token 999"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, pooling="last", pooling_token_ids=[999]),
                         use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions: this model does not declare"):
            llm.embed([PROMPTS[0]], dimensions=8, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_free_blocks == 96


def test_step_result_with_pooled_parts_round_trips_the_wire():
    result = StepResult(3, [], [], pooled=[PooledPart(4, 0, 16, [0.5, -1.25]), PooledPart(5, 8, 1, [2.0], [1.5, -3.0])])
    assert decode_result(encode_result(result)) == result


def test_rerank_scores_equal_transformers_yes_no_logits_and_order(tmp_path, default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_reranker(tmp_path / "reranker", default_model_path)
    query = "Which animals live in the forest?"
    documents = ["Deer, foxes and owls live among the trees.", "The stock market closed higher today.",
                 "Bears sleep through the winter in dens.", "A recipe for lemon cake with three eggs."]
    with _llm(path, max_num_batched_tokens=64, num_blocks=256) as llm:
        scores = llm.score(query, documents, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected = []
    for document in documents:
        ids = tokenizer(rerank_prompt(query, document)).input_ids
        with torch.inference_mode():
            last = model(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(last[[no, yes]], dim=0)[1].item())   # the model card's score
    assert [s.index for s in scores] == [0, 1, 2, 3] and [s.document for s in scores] == documents
    assert [s.score for s in scores] == pytest.approx(expected, abs=1e-5)
    assert sorted(range(4), key=lambda i: -scores[i].score) == sorted(range(4), key=lambda i: -expected[i])
    assert len(set(round(e, 4) for e in expected)) == 4                 # distinct: the ordering means something


@pytest.mark.parametrize("num_labels", [1, 2])
def test_a_sequence_classification_reranker_scores_with_its_head_as_transformers(tmp_path, default_model_path,
                                                                                 num_labels):
    """A ``*ForSequenceClassification`` checkpoint: the engine pools the last token's hidden state and the front
    applies the checkpoint's ``score`` head (sigmoid of one logit; the second label's softmax of two)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_classifier(tmp_path / "classifier", default_model_path, num_labels)
    query, documents = "Which animals live in the forest?", ["Deer and owls.", "Stock prices.", "Bears in dens."]
    with _llm(path, max_num_batched_tokens=64, num_blocks=256) as llm:
        scores = llm.score(query, documents, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    expected = []
    for document in documents:
        with torch.inference_mode():
            logits = model(torch.tensor([tokenizer(rerank_prompt(query, document)).input_ids])).logits[0]
        expected.append(torch.sigmoid(logits[0]).item() if num_labels == 1 else torch.softmax(logits, 0)[1].item())
    assert [s.score for s in scores] == pytest.approx(expected, abs=1e-5)
    assert len(set(round(e, 4) for e in expected)) == 3


def test_yes_no_score_is_the_two_way_softmax():
    assert yes_no_score([2.0, 2.0]) == 0.5
    assert yes_no_score([1000.0, 0.0]) == 1.0 and yes_no_score([0.0, 1000.0]) == 0.0
    assert yes_no_score([1.0, 0.0]) == pytest.approx(torch.softmax(torch.tensor([0.0, 1.0]), 0)[1].item())


def test_tp2_embeddings_equal_tp1(tiny_model_path, ray_session):
    path = tiny_model_path("qwen3")                   # one KV head, replicated over the two ranks
    hf = load_hf_model(path)
    with _llm(path, tensor_parallel_size=2, executor="ray") as llm:
        lasts = llm.embed(PROMPTS, normalize=False, use_tqdm=False)
        means = llm.embed(PROMPTS, normalize=False, pooling_type="mean", use_tqdm=False)
    for prompt, last, mean in zip(PROMPTS, lasts, means):
        hidden = hf_hidden(hf, prompt)
        assert_same_vector(last.embedding, hidden[-1])
        assert_same_vector(mean.embedding, hidden.mean(dim=0))
