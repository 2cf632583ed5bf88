"""Seeded uniform noise (kernels/seeded_uniform*.py): the Triton kernel against its torch reference
(bit for bit: every value is a 24-bit fraction), the distribution of the values, the key derivation,
the argument checks, and the Sampler's batched seeded rows (one call for the batch) against its own
contract: a seeded row's token depends only on its logits, seed and position."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels.seeded_uniform import noise_keys, seeded_uniform, seeded_uniform_reference
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.sampling.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")


def _keys(count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2**32, (count, 2), generator=gen, dtype=torch.int64)
    keys[0] = torch.tensor([0, 0])                       # the edges of each 32-bit half
    keys[-1] = torch.tensor([2**32 - 1, 2**32 - 1])
    return keys


@pytest.mark.parametrize("vocab", [1, 7, 1000, 1537])
def test_the_kernel_gives_the_references_bits(vocab):
    keys = _keys(5, vocab)
    expected = seeded_uniform_reference(keys, vocab)
    got = seeded_uniform(keys, vocab, use_triton=True)
    assert got.shape == (5, vocab) and got.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_the_kernel_on_the_gpu_gives_the_references_bits():
    keys = _keys(64, 3)
    expected = seeded_uniform_reference(keys, 151_936)
    got = seeded_uniform(keys.cuda(), 151_936)
    assert torch.equal(got.cpu(), expected)


def test_the_values_are_uniform_on_0_1_and_rows_differ():
    keys = noise_keys([(seed, position) for seed in (0, 1, -5) for position in range(4)], CPU)
    values = seeded_uniform_reference(keys, 50_000)                     # [12, 50000]
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    counts = torch.histc(values.flatten(), bins=20, min=0.0, max=1.0)   # 30,000 expected per bin
    chi_square = float(((counts - 30_000) ** 2 / 30_000).sum())
    assert chi_square < 60.0, chi_square                                # 19 dof: p ~ 1e-5 at 60
    assert abs(float(values.mean()) - 0.5) < 0.005
    correlation = torch.corrcoef(values)                                # rows pairwise
    off_diagonal = correlation - torch.eye(12)
    assert float(off_diagonal.abs().max()) < 0.03
    assert len({tuple(row[:8].tolist()) for row in values}) == 12


def test_keys_are_64_bits_of_the_seed_and_position():
    keys = noise_keys([(42, 0), (42, 0), (42, 1), (43, 0)], CPU)
    assert keys.dtype == torch.int64 and keys.shape == (4, 2)
    assert torch.equal(keys[0], keys[1]) and not torch.equal(keys[0], keys[2])
    assert not torch.equal(keys[0], keys[3])
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32
    assert noise_keys([], CPU).shape == (0, 2)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="keys"):
        seeded_uniform(torch.zeros(3, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="keys"):
        seeded_uniform(torch.zeros(3, 2, dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="vocab"):
        seeded_uniform(torch.zeros(3, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="batched_seed_noise"):
        Sampler(batched_seed_noise="yes")


def _row(seq_id, seed, num_output=0, temperature=1.0):
    return SamplingRow(seq_id, SamplingParams(temperature=temperature, seed=seed), [1, 2], [0] * num_output)


def _tokens(sampler, logits, rows):
    return {t.seq_id: t.token_id for t in sampler(logits, rows)}


def test_batched_seeded_rows_depend_only_on_seed_and_position():
    gen = torch.Generator().manual_seed(11)
    logits_by_seq = {i: torch.randn(3000, generator=gen) for i in range(6)}
    seeded = [_row(0, 1234, 4), _row(1, -7), _row(2, 1234, 2)]
    others = [_row(3, None), _row(4, None, temperature=0.0), _row(5, None)]

    def run(batch, sampler_seed):
        sampler = Sampler(seed=sampler_seed, batched_seed_noise=True)
        logits = torch.stack([logits_by_seq[r.seq_id] for r in batch])
        return _tokens(sampler, logits, batch)

    alone = {r.seq_id: run([r], 0)[r.seq_id] for r in seeded}
    for sampler_seed, batch in enumerate([seeded + others, others[::-1] + seeded[::-1]], start=1):
        got = run(batch, sampler_seed)
        assert {k: got[k] for k in alone} == alone
    flat = torch.zeros(1, 1000)
    by_position = [_tokens(Sampler(batched_seed_noise=True), flat, [_row(0, 42, n)])[0] for n in range(12)]
    assert len(set(by_position)) >= 10
    again = [_tokens(Sampler(batched_seed_noise=True), flat, [_row(0, 42, n)])[0] for n in range(12)]
    assert again == by_position


def test_batched_noise_draws_from_the_distribution():
    """A seeded row's token over many seeds follows softmax(logits): the noise is an exact race."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(dim=1)[0]
    sampler = Sampler(batched_seed_noise=True)
    rows = [_row(i, seed) for i, seed in enumerate(range(4000))]
    tokens = list(_tokens(sampler, logits.expand(4000, 4).contiguous(), rows).values())
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(frequencies, probs, atol=0.03), (frequencies, probs)
