"""Statistical checks: sampled frequencies match the analytic distribution on an 8-token vocabulary.

Each case draws N tokens (N identical rows in one batch, or N seeded rows) and compares the empirical
frequency of every token with the analytic renormalised distribution computed independently below in
float64. Tolerance per token: 5 standard errors, 5 * sqrt(p (1 - p) / N) (+1e-9), so a correct
sampler fails with probability < 1e-5 per test; filtered-out tokens must never be drawn. The sampler
seed is fixed, so the outcome is also reproducible.
"""

import math

import pytest
import torch
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.sampling.sampler import Sampler, SamplingRow

PROBS = [0.06, 0.3, 0.02, 0.15, 0.12, 0.2, 0.1, 0.05]  # no cumulative mass lands on a tested top_p
LOGITS = torch.tensor(PROBS, dtype=torch.float64).log().float() + 1.7  # a shift changes nothing
NUM_DRAWS = 20000


def analytic(temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The sampling distribution, written out step by step: temperature, min-p, top-k, top-p."""
    scaled = [x / temperature for x in LOGITS.double().tolist()]
    peak = max(scaled)
    weights = {i: math.exp(x - peak) for i, x in enumerate(scaled)}
    best = max(weights.values())
    # a boundary within float32 noise of a threshold would make the oracle ambiguous
    assert all(abs(w - min_p * best) > 1e-4 * best for w in weights.values()), "min_p on a boundary"
    weights = {i: w for i, w in weights.items() if w >= min_p * best}
    ranked = sorted(weights, key=weights.get, reverse=True)
    if top_k > 0:
        ranked = ranked[:top_k]
    total = sum(weights[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        assert abs(mass - top_p) > 1e-4, "top_p on a boundary"
        if mass < top_p:
            kept.append(i)
        mass += weights[i] / total
    total = sum(weights[i] for i in kept)
    return [weights[i] / total if i in kept else 0.0 for i in range(len(PROBS))]


def assert_matches(tokens, expected):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).tolist()
    n = len(tokens)
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} is filtered out but was drawn {count} times"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / n) + 1e-9
            assert abs(count / n - p) <= tolerance, (token, count / n, p, tolerance)


CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.6": dict(temperature=0.6),
    "temperature 1.8": dict(temperature=1.8),
    "top_k 3": dict(temperature=1.0, top_k=3),
    "top_p 0.6": dict(temperature=1.0, top_p=0.6),
    "min_p 0.3": dict(temperature=1.0, min_p=0.3),
    "combined": dict(temperature=0.8, min_p=0.05, top_k=6, top_p=0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unseeded_batch_matches_analytic_distribution(case):
    params = SamplingParams(**CASES[case])
    rows = [SamplingRow(i, params, [0], []) for i in range(NUM_DRAWS)]
    logits = LOGITS.expand(NUM_DRAWS, -1).contiguous()
    tokens = [t.token_id for t in Sampler(seed=hash(case) % 1000)(logits, rows)]
    expected = analytic(**CASES[case])
    assert sum(p > 0 for p in expected) >= 2  # a real distribution, not a forced token
    assert_matches(tokens, expected)


@pytest.mark.parametrize("case", ["temperature 1", "combined"])
def test_seeded_rows_match_analytic_distribution(case):
    num_rows = 5000
    rows = [SamplingRow(i, SamplingParams(seed=i, **CASES[case]), [0], []) for i in range(num_rows)]
    logits = LOGITS.expand(num_rows, -1).contiguous()
    tokens = [t.token_id for t in Sampler()(logits, rows)]
    assert_matches(tokens, analytic(**CASES[case]))


def test_analytic_reference_is_not_trivial():
    # guards the oracle itself: each filter must remove something on this vocabulary
    assert analytic(1.0) == pytest.approx(PROBS)
    assert sum(p == 0 for p in analytic(1.0, top_k=3)) == 5
    assert sum(p == 0 for p in analytic(1.0, top_p=0.6)) == 5  # mass before 4th token .65 >= .6
    assert sum(p == 0 for p in analytic(1.0, min_p=0.3)) == 3  # p >= 0.09 keeps 5 tokens
