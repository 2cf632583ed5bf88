"""``sampling_ops.draw_by_cdf``, the Sampler's inverse-CDF draw, against a float64 reference written out
in Python, and at the ends of the uniform's range (where a filtered token must still never come out).
The distribution it draws from is checked statistically in test_sampler_stats.py."""

import math

import pytest
import torch
from pagedray.workers.sampling.sampling_ops import draw_by_cdf

LARGEST_UNIFORM = 1.0 - 2.0**-53     # torch.rand's largest float64


def reference_draw(row: list[float], u: float) -> int:
    """The first index whose running float64 sum of exp(x - max) exceeds u * total."""
    peak = max(row)
    weights = [math.exp(x - peak) if x != -math.inf else 0.0 for x in row]
    target, running = u * sum(weights), 0.0
    for i, w in enumerate(weights):
        running += w
        if running > target:
            return i
    raise AssertionError("no index exceeds the target")


# chunk sizes: one chunk for the whole row, several with a padded last one, one that divides the row
CHUNKS = [1024, 7, 50]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tokens_equal_the_reference_on_random_rows_and_uniforms(chunk):
    gen = torch.Generator().manual_seed(7)
    scaled = torch.randn(40, 300, generator=gen) * 3                  # [rows, vocab]
    scaled[torch.rand(40, 300, generator=gen) < 0.3] = float("-inf")  # filtered tokens in every row
    uniform = torch.rand(40, dtype=torch.float64, generator=gen)
    tokens, ok = draw_by_cdf(scaled, uniform, chunk=chunk)
    assert ok.all()
    expected = [reference_draw(scaled[i].double().tolist(), uniform[i].item()) for i in range(40)]
    # the float32 exponentials may round a boundary differently from float64 ones: near-ties only
    mismatches = [i for i in range(40) if tokens[i].item() != expected[i]]
    assert len(mismatches) <= 1, mismatches
    assert all(scaled[i, tokens[i]].isfinite() for i in range(40))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_ends_of_the_uniform_pick_the_first_and_last_kept_tokens(chunk):
    vocab = 64
    scaled = torch.full((3, vocab), float("-inf"))
    scaled[0, [5, 9, 40]] = torch.tensor([0.3, -1.0, 2.0])
    scaled[1, [0, vocab - 1]] = torch.tensor([1.0, 1.0])
    scaled[2, 17] = 4.0                                                 # one token left: always drawn
    for u, first in ((0.0, True), (LARGEST_UNIFORM, False)):
        tokens, ok = draw_by_cdf(scaled, torch.full((3,), u, dtype=torch.float64), chunk=chunk)
        assert ok.all()
        assert tokens.tolist() == ([5, 0, 17] if first else [40, vocab - 1, 17])


def test_a_weight_that_underflows_is_never_drawn_even_at_the_last_uniform():
    scaled = torch.tensor([[0.0, -200.0]])          # exp(-200) is 0 in float32
    tokens, ok = draw_by_cdf(scaled, torch.tensor([LARGEST_UNIFORM], dtype=torch.float64))
    assert ok.item() and tokens.item() == 0


@pytest.mark.parametrize("chunk", CHUNKS)
def test_rows_without_a_finite_total_are_not_ok_and_still_give_a_valid_index(chunk):
    vocab = 16
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(4, vocab, generator=gen)
    scaled[1, 3] = float("nan")
    scaled[2] = float("-inf")
    scaled[3, 8] = float("inf")
    tokens, ok = draw_by_cdf(scaled, torch.rand(4, dtype=torch.float64, generator=gen), chunk=chunk)
    assert ok.tolist() == [True, False, False, False]
    assert ((tokens >= 0) & (tokens < vocab)).all()


def test_a_row_draws_the_same_token_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(11)
    scaled = torch.randn(6, 500, generator=gen)
    uniform = torch.rand(6, dtype=torch.float64, generator=gen)
    together, _ = draw_by_cdf(scaled, uniform)
    alone = [draw_by_cdf(scaled[i:i + 1].clone(), uniform[i:i + 1])[0].item() for i in range(6)]
    assert together.tolist() == alone


def test_a_target_in_a_later_chunk_lands_past_the_weight_of_the_earlier_ones():
    # weights 1 at tokens 2, 9 and 15 (chunks of 7: chunks 0, 1 and 2): thirds of the uniform's range
    scaled = torch.full((1, 16), float("-inf"))
    scaled[0, [2, 9, 15]] = 0.0
    picks = [draw_by_cdf(scaled, torch.tensor([u], dtype=torch.float64), chunk=7)[0].item()
             for u in (0.0, 0.33, 0.34, 0.66, 0.67, LARGEST_UNIFORM)]
    assert picks == [2, 2, 9, 9, 15, 15]
