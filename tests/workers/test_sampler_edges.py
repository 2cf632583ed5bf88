"""The Sampler at the edges (issue #32): random logits rows that hold NaN, +inf or only -inf next to
ordinary ones, and sampling parameters drawn at the ends of their ranges. A row that cannot be sampled
must come back with ``error`` (the request ends, never the step); every other row must get a token
whose processed logit is finite, and no logprob is ever NaN or infinite.

Before #32 a NaN row was sampled as its argmax (token 0 for an all-NaN row) and returned as a token.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedray.workers.contract.sampling_params import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SamplingParams
from pagedray.workers.sampling.sampler import NON_FINITE_ROW, Sampler, SamplingRow

VOCAB = 48
EOS = 1
ROW_KINDS = ("finite", "some_neg_inf", "nan_somewhere", "all_neg_inf", "pos_inf")

edge_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-6, 1e-5, 2e-5, 0.7, 1.0, MAX_TEMPERATURE]),
    "top_p": st.sampled_from([1e-30, 1e-7, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 3, VOCAB + 5]),
    "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([REPETITION_PENALTY_RANGE[0], 1.0, REPETITION_PENALTY_RANGE[1]]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "min_tokens": st.sampled_from([0, 3]),
    "logit_bias": st.lists(st.tuples(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0])),
                           max_size=3, unique_by=lambda pair: pair[0]),
})


def _row_logits(kind: str, generator: torch.Generator) -> torch.Tensor:
    row = torch.randn(VOCAB, generator=generator) * 4
    positions = torch.randperm(VOCAB, generator=generator)[:5]
    if kind == "some_neg_inf":
        row[positions] = float("-inf")
    elif kind == "nan_somewhere":
        row[positions[0]] = float("nan")
    elif kind == "all_neg_inf":
        row[:] = float("-inf")
    elif kind == "pos_inf":
        row[positions[0]] = float("inf")
    return row


def _banned(params: SamplingParams, output: list[int]) -> set[int]:
    return {EOS, *params.stop_token_ids} if len(output) < params.min_tokens else set()


def _expect_ok(row: torch.Tensor, banned: set[int]) -> bool:
    """Sampleable: no NaN or +inf outside the ids min_tokens bans (they are set to -inf first, NaN or
    not), and some finite logit it does not ban."""
    row = row.clone()
    row[sorted(banned)] = float("-inf")
    if row.isnan().any() or (row == float("inf")).any():
        return False
    return any(math.isfinite(v) and t not in banned for t, v in enumerate(row.tolist()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from(ROW_KINDS), edge_params, st.integers(0, 6)), min_size=1,
                     max_size=6),
       seed=st.integers(0, 2**31 - 1))
def test_rows_at_the_edges_fail_alone_and_never_pick_a_non_finite_token(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    logits, sampling_rows, banned = [], [], []
    for i, (kind, fields, output_len) in enumerate(rows):
        params = SamplingParams(max_tokens=16, **fields)
        output = torch.randint(2, VOCAB, (output_len,), generator=generator).tolist()
        prompt = torch.randint(2, VOCAB, (4,), generator=generator).tolist()
        logits.append(_row_logits(kind, generator))
        sampling_rows.append(SamplingRow(i, params, prompt, output))
        banned.append(_banned(params, output))
    logits = torch.stack(logits)                                              # [rows, vocab]
    sampled = Sampler(seed=seed, eos_token_ids=(EOS,))(logits.clone(), sampling_rows)
    assert [s.seq_id for s in sampled] == list(range(len(rows)))
    for row_logits, row, token, ban in zip(logits, sampling_rows, sampled, banned):
        if not _expect_ok(row_logits, ban):
            assert token.error == NON_FINITE_ROW and token.logprob is None
            continue
        assert token.error is None
        assert 0 <= token.token_id < VOCAB and token.token_id not in ban
        assert math.isfinite(row_logits[token.token_id].item())
        if row.params.logprobs is not None:
            assert math.isfinite(token.logprob)
            assert all(math.isfinite(v) for _, v in token.top_logprobs)
            assert len(token.top_logprobs) <= row.params.logprobs


def test_a_nan_row_fails_while_its_batch_mates_are_sampled_as_before():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=generator)
    rows = [SamplingRow(i, SamplingParams(temperature=0), [5], []) for i in range(3)]
    expected = logits.argmax(dim=1).tolist()
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    sampled = Sampler(seed=0)(poisoned, rows)
    assert [s.error for s in sampled] == [None, NON_FINITE_ROW, None]
    assert [sampled[0].token_id, sampled[2].token_id] == [expected[0], expected[2]]


def test_masked_tokens_never_appear_in_top_logprobs():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, 3:] = float("-inf")        # a grammar row that allows three tokens
    row = SamplingRow(0, SamplingParams(temperature=0, logprobs=5), [5], [])
    token = Sampler(seed=0)(logits, [row])[0]
    assert token.error is None and token.token_id in (0, 1, 2)
    assert sorted(t for t, _ in token.top_logprobs) == [0, 1, 2]
    assert all(math.isfinite(v) for _, v in token.top_logprobs)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_logit_at_an_id_min_tokens_bans_leaves_the_logprobs_finite(value):
    """The row is sampleable (the NaN / +inf sits at EOS, which min_tokens bans), so its logprobs must be
    finite too: that logit counts as -inf in the log-softmax, as in sampling (hypothesis found +inf)."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[0, EOS] = value
    params = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=3, logprobs=5)
    token = Sampler(seed=0, eos_token_ids=(EOS,))(logits.clone(), [SamplingRow(0, params, [2, 3], [4])])[0]
    expected = logits[0].clone()
    expected[EOS] = float("-inf")
    assert token.error is None and token.token_id == int(expected.argmax())
    expected = expected.log_softmax(0)
    assert math.isfinite(token.logprob) and token.logprob == expected[token.token_id].item()
    assert len(token.top_logprobs) == 5 and all(t != EOS and math.isfinite(v) for t, v in token.top_logprobs)
