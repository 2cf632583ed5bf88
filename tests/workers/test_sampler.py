"""Sampler: greedy, penalties, logprobs, seeds and input validation (exact checks on random logits).

The statistical checks of temperature / top-k / top-p / min-p are in test_sampler_stats.py.
"""

import math

import pytest
import torch
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.sampling import sampling_ops
from pagedray.workers.sampling.sampler import Sampler, SamplingRow
from pagedray.workers.sampling.sampling_ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    token_id_matrix,
    top_k_top_p_by_sort,
)

VOCAB = 64


def _logits(num_rows, vocab=VOCAB, seed=0):
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _row(seq_id, prompt=(1, 2, 3), output=(), **params):
    return SamplingRow(seq_id=seq_id, params=SamplingParams(**params), prompt_token_ids=list(prompt),
                       output_token_ids=list(output))


def _reference_penalties(logits, prompt, output, repetition, frequency, presence):
    """Hand-written per-token loops over one row (the semantics of vLLM / OpenAI)."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_greedy_is_argmax_fast_path():
    logits = _logits(7, vocab=1000)
    rows = [_row(10 + i, temperature=0.0) for i in range(7)]
    tokens = Sampler()(logits, rows)
    assert [t.seq_id for t in tokens] == list(range(10, 17))
    assert [t.token_id for t in tokens] == logits.argmax(dim=1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in tokens)


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = _logits(6, vocab=500, seed=1)
    rows = [_row(i, temperature=0.0) if i % 2 == 0 else _row(i, temperature=1.3, top_k=5, seed=i)
            for i in range(6)]
    tokens = Sampler(seed=0)(logits, rows)
    for i in (0, 2, 4):
        assert tokens[i].token_id == logits[i].argmax().item()


def test_penalties_match_hand_written_reference():
    gen = torch.Generator().manual_seed(2)
    logits = _logits(4, seed=3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 20, 1, 12)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 0, 30, 4)]
    repetition = [1.3, 0.8, 1.0, 2.0]
    frequency = [0.5, -0.4, 1.5, 0.0]
    presence = [-1.0, 0.7, 0.0, 0.3]
    got = apply_penalties(logits, token_id_matrix([p + o for p, o in zip(prompts, outputs)], VOCAB, "cpu"),
                          token_id_matrix(outputs, VOCAB, "cpu"), torch.tensor(repetition),
                          torch.tensor(frequency), torch.tensor(presence))
    for i in range(4):
        expected = _reference_penalties(logits[i], prompts[i], outputs[i], repetition[i], frequency[i],
                                        presence[i])
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-6)
    assert (logits != got).any()  # the reference really changes something


def test_greedy_with_penalties_is_argmax_of_penalised_logits():
    logits = _logits(3, seed=4)
    top = logits.argmax(dim=1).tolist()
    # the current argmax was already generated, so a strong penalty must move the choice elsewhere
    rows = [_row(0, prompt=[top[0]], temperature=0.0, repetition_penalty=50.0),
            _row(1, output=[top[1]] * 3, temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
            _row(2, output=[top[2]], temperature=0.0)]
    tokens = Sampler()(logits, rows)
    for i, row in enumerate(rows):
        p = row.params
        expected = _reference_penalties(logits[i], row.prompt_token_ids, row.output_token_ids,
                                        p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        assert tokens[i].token_id == expected.argmax().item()
    assert tokens[0].token_id != top[0] and tokens[1].token_id != top[1] and tokens[2].token_id == top[2]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = _logits(4, vocab=200, seed=5)
    rows = [_row(0, temperature=0.0, logprobs=5),
            _row(1, temperature=0.7, top_p=0.5, repetition_penalty=1.5, seed=9, logprobs=3),
            _row(2, temperature=1.0, logprobs=0),
            _row(3, temperature=1.0)]
    tokens = Sampler(seed=1)(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=1)
    for i in range(3):
        token = tokens[i]
        assert math.isclose(token.logprob, reference[i, token.token_id].item(), abs_tol=1e-5)
        n = rows[i].params.logprobs
        assert len(token.top_logprobs) == n
        expected_ids = reference[i].topk(n).indices.tolist() if n else []
        assert [t for t, _ in token.top_logprobs] == expected_ids
        values = [v for _, v in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        for t, v in token.top_logprobs:
            assert math.isclose(v, reference[i, t].item(), abs_tol=1e-5)
    assert tokens[0].top_logprobs[0][0] == tokens[0].token_id  # greedy picks the best raw token
    assert tokens[3].logprob is None and tokens[3].top_logprobs is None


def _batch_tokens(logits_by_seq, rows, sampler_seed):
    """Run the rows as one batch; return {seq_id: token_id}."""
    logits = torch.stack([logits_by_seq[r.seq_id] for r in rows])
    return {t.seq_id: t.token_id for t in Sampler(seed=sampler_seed)(logits, rows)}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits_by_seq = {i: row for i, row in enumerate(_logits(8, vocab=3000, seed=6) / 3)}
    seeded = [_row(0, output=[5] * 4, temperature=1.0, seed=1234),
              _row(1, temperature=0.9, top_k=50, top_p=0.95, seed=-7),
              _row(2, output=[1, 2], temperature=1.2, min_p=0.01, seed=1234)]
    others = [_row(3, temperature=1.0), _row(4, temperature=0.0), _row(5, temperature=0.5, top_p=0.3),
              _row(6, temperature=1.0, top_k=3, repetition_penalty=1.4), _row(7, temperature=2.0, min_p=0.2)]
    alone = {r.seq_id: _batch_tokens(logits_by_seq, [r], 0)[r.seq_id] for r in seeded}
    batches = [seeded + others, others[::-1] + seeded[::-1], [others[0], seeded[1], others[2], seeded[0]]]
    for sampler_seed, batch in enumerate(batches, start=1):
        got = _batch_tokens(logits_by_seq, batch, sampler_seed)
        assert {k: v for k, v in got.items() if k in alone} == {k: alone[k] for k in got if k in alone}


def test_seed_and_position_drive_the_draw():
    flat = torch.zeros(1, 1000)  # uniform over 1000 tokens: equal draws by chance are rare

    def draw(seed, num_output):
        return Sampler()(flat, [_row(0, output=[0] * num_output, temperature=1.0, seed=seed)])[0].token_id

    by_position = [draw(42, n) for n in range(12)]
    assert by_position == [draw(42, n) for n in range(12)]  # reproducible, e.g. after a preemption
    assert len(set(by_position)) >= 10  # a new position gives a new draw
    assert [draw(43, n) for n in range(12)] != by_position


def test_shared_generator_follows_the_sampler_seed():
    logits = torch.zeros(16, 1000)
    rows = [_row(i, temperature=1.0) for i in range(16)]

    def tokens(sampler):
        return [t.token_id for t in sampler(logits, rows)]

    assert tokens(Sampler(seed=5)) == tokens(Sampler(seed=5))
    assert tokens(Sampler(seed=5)) != tokens(Sampler(seed=6))


def test_disabled_filters_are_exact_no_ops():
    logits = _logits(5, vocab=300, seed=7)
    assert torch.equal(apply_min_p(logits, torch.zeros(5)), logits)
    assert torch.equal(apply_top_k_top_p(logits, torch.zeros(5, dtype=torch.int64), torch.ones(5)), logits)


def test_filters_keep_the_expected_tokens():
    probs = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()
    one = torch.ones(1, dtype=torch.int64)
    assert kept(apply_top_k_top_p(logits, 2 * one, torch.ones(1))) == [1, 3]
    # mass before each token in order 1, 3, 4, 0, 2: 0, .4, .7, .85, .95 -> top_p .8 keeps 1, 3, 4
    assert kept(apply_top_k_top_p(logits, 0 * one, torch.tensor([0.8]))) == [1, 3, 4]
    # top-p on the renormalised top-3 (.4, .3, .15)/.85: mass before token 4 is .82 >= .8
    assert kept(apply_top_k_top_p(logits, 3 * one, torch.tensor([0.8]))) == [1, 3]
    assert kept(apply_min_p(logits, torch.tensor([0.3]))) == [1, 3, 4]  # p >= 0.12


def test_candidate_top_k_top_p_equals_full_sort(monkeypatch):
    # rows: sharp and flat distributions (flat + top_p .9 needs more than 32 candidates -> fallback)
    gen = torch.Generator().manual_seed(8)
    scales = torch.tensor([4.0, 4.0, 0.05, 0.05, 1.0, 3.0, 0.05, 2.0])[:, None]
    logits = torch.randn(8, 2000, generator=gen) * scales
    top_k = torch.tensor([0, 20, 0, 0, 7, 0, 100, 0])
    top_p = torch.tensor([0.9, 0.8, 0.9, 1.0, 1.0, 0.3, 0.95, 1.0])
    fallback_rows = []
    original = sampling_ops.top_k_top_p_by_sort
    monkeypatch.setattr(sampling_ops, "top_k_top_p_by_sort",
                        lambda lg, k, p: fallback_rows.append(lg.shape[0]) or original(lg, k, p))
    got = apply_top_k_top_p(logits, top_k, top_p, candidates=32)
    assert fallback_rows == [1]  # only row 2 (flat, top-p without top-k) overflows the candidates
    assert torch.equal(got, top_k_top_p_by_sort(logits, top_k, top_p))
    kept = torch.isfinite(got).sum(dim=1).tolist()
    assert kept[1] <= 20 and kept[3] == kept[7] == 2000 and kept[4] == 7 and 80 < kept[6] < 100


def test_bad_input_raises_before_touching_the_generator():
    sampler = Sampler(seed=3)
    good = [_row(0, temperature=1.0), _row(1, output=[2], temperature=1.0, repetition_penalty=1.2)]
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.randn(VOCAB), good[:1])
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.randn(3, VOCAB), good)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(2, VOCAB, dtype=torch.int64), good)
    with pytest.raises(ValueError, match="rows"):
        sampler(torch.randn(1, VOCAB), [("not", "a row")])
    with pytest.raises(ValueError, match="rows"):
        sampler(torch.randn(2, VOCAB), [good[0], _row(1, output=[VOCAB], temperature=1.0,
                                                       repetition_penalty=1.2)])
    with pytest.raises(ValueError, match="seed"):
        Sampler(seed="1")
    logits = torch.zeros(2, VOCAB)
    assert [t.token_id for t in sampler(logits, good)] == [t.token_id for t in Sampler(seed=3)(logits, good)]


def test_logit_bias_moves_the_greedy_choice_and_leaves_logprobs_raw():
    logits = _logits(3, vocab=1000, seed=5)
    order = logits.argsort(dim=1, descending=True)
    worst, best = order[0, -1].item(), order[1, 0].item()
    rows = [_row(0, temperature=0.0, logit_bias=((worst, 100.0),), logprobs=1),
            _row(1, temperature=0.0, logit_bias=((best, -100.0),)),
            _row(2, temperature=0.0)]                                   # no bias: untouched in the same batch
    tokens = Sampler()(logits, rows)
    # +100 beats a gap of at most ~2 x 3 x 4 sigma of these logits; -100 drops the argmax below the second
    assert tokens[0].token_id == worst
    assert tokens[1].token_id == order[1, 1].item()
    assert tokens[2].token_id == order[2, 0].item()
    raw = logits[0].log_softmax(dim=0)
    assert tokens[0].logprob == pytest.approx(raw[worst].item(), abs=1e-5)
    assert tokens[0].top_logprobs[0][0] == order[0, 0].item()         # the raw distribution's best


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = _logits(4, vocab=1000, seed=6)
    order = logits.argsort(dim=1, descending=True)
    eos, stop = order[0, 0].item(), order[1, 0].item()
    sampler = Sampler(eos_token_ids=(eos,))
    rows = [_row(0, temperature=0.0, min_tokens=2, output=(7,)),        # 1 < 2: EOS banned
            _row(1, temperature=0.0, min_tokens=2, output=(7,), stop_token_ids=(stop,)),   # stop id banned
            _row(2, temperature=0.0, min_tokens=2, output=(7, 8)),     # reached: EOS allowed again
            _row(3, temperature=0.7, seed=3, min_tokens=5, stop_token_ids=(order[3, 0].item(),))]
    tokens = sampler(logits, rows)
    assert tokens[0].token_id == order[0, 1].item()
    assert tokens[1].token_id == order[1, 1].item()
    assert tokens[2].token_id == order[2, 0].item()
    assert tokens[3].token_id not in (order[3, 0].item(), eos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_equals_torch_argmax_with_ties_nans_and_infinities(dtype):
    from pagedray.workers.sampling.sampling_ops import argmax_rows

    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (64, 300), generator=gen).to(dtype)   # [rows, vocab]: many ties
    x[3, 17] = float("nan")
    x[4, :] = float("-inf")
    x[5, [9, 200]] = float("nan")
    x[6, 11] = float("inf")
    strided = torch.randn(300, 64, generator=gen, dtype=dtype).T      # not contiguous
    for logits in (x, strided, x[:0]):
        got = argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=1))
