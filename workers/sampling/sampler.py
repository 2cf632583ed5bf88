"""Batched Sampler: one token per row from the logits of a step, plus optional logprobs.

Per row, in this order (the conventions of ``SamplingParams`` and ``sampling_ops``):

0. logit processors: ``logit_bias`` is added; while the row has fewer than ``min_tokens`` output tokens,
   the EOS ids (``Sampler(eos_token_ids=...)``) and its ``stop_token_ids`` get -inf;
1. penalties on the logits: repetition (prompt + output tokens), then frequency and presence
   (output tokens only);
2. greedy rows (``temperature < GREEDY_TEMPERATURE``, i.e. 0 up to float noise, as in vLLM) take the
   argmax of the penalised logits; top-k / top-p / min-p / seed are then irrelevant;
3. sampled rows divide by the temperature, apply min-p, top-k, then top-p (each on the distribution
   renormalised after the previous filters) and draw by inverse CDF (``sampling_ops.draw_by_cdf``): one
   uniform number U per row, and the first token whose cumulative weight (``exp(logit - max)``, summed in
   float64) exceeds ``U * total``. Filtered tokens (weight 0) are never drawn, and a row's draw depends
   only on its own logits and the generator that produced its U. Up to 2026-12-03 the draw was an
   exponential race (``argmax(probs / E)``, one ``E = -log(U)`` per vocabulary entry): exact too, but the
   noise, 786k random numbers a step at 16 rows of SmolLM2, took a fifth of a CPU decode step.

Randomness: a row with ``params.seed`` draws its U from a source that depends only on a hash of
``(seed, len(output_token_ids))``; its token therefore depends only on its own logits, seed and
position, never on the other rows of the batch or on a preemption that recomputes it. Two sources,
chosen per Sampler (``batched_seed_noise``; default: batched on CUDA):
- batched (CUDA): every seeded row of the step in one call of ``kernels.seeded_uniform``, a
  counter-based hash of (key, column), keyed by 64 bits of blake2b of ``"seed:position"``
  (``kernels.noise_keys``): no generator objects and no per-row launches; its two columns (24 bits
  each) make a 48-bit U;
- per row (CPU): a fresh ``torch.Generator`` seeded by the same 64 bits, whose first float64
  ``torch.rand`` number is U.
The two sources give different (each reproducible) draws for the same seed. Rows without a
seed share one generator owned by the Sampler (seeded by ``Sampler(seed=...)``, else from the OS).
Disabled filters are exact no-ops for their rows (no float drift), so a seeded row gives the same token
whichever other filters its batch-mates use.

Logprobs (``params.logprobs = n``): the sampled token's logprob and the ``n`` most likely tokens come
from ``log_softmax`` of the RAW logits, before penalties, temperature and filters (vLLM's default
``raw_logprobs``): they describe the model's distribution and match transformers' log-softmax, whatever
the sampling settings. ``n = 0`` gives the sampled token's logprob and an empty top list. Tokens at -inf
(a grammar row's masked tokens: its raw logits are the masked ones) are left out of the top list.

Failed rows: a row whose greedy token has a non-finite logit (argmax picks a NaN first; every token at
-inf), or whose draw had no finite total weight (a NaN or a +inf logit, every token at -inf), is not sampled: its
SampledToken carries ``error`` (``NON_FINITE_ROW``) and ``PLACEHOLDER_TOKEN``, and the engine ends that
request with finish_reason "error"; the other rows of the step are unaffected. The check costs one
gather per step and rides on the one host transfer of the token ids.

Fast path: a batch of greedy rows without penalties or logprobs is a single argmax. When every row
samples, the greedy argmax and the row gather are skipped. The rest of the cost is the exponential, the
float64 cumulative sum and two ``searchsorted`` per step.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from pagedray.kernels.seeded_uniform import noise_keys, seeded_uniform

from ..contract.sampling_params import SamplingParams
from ..contract.wire import SampledToken
from .sampling_ops import apply_min_p, apply_penalties, apply_top_k_top_p, argmax_rows, draw_by_cdf, token_id_matrix

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_drafts: int = 0     # the last output tokens that are speculative drafts (workers/sampling/speculative.py)


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _has_processor(row: SamplingRow) -> bool:
    """logit_bias, or min_tokens not reached yet."""
    return bool(row.params.logit_bias) or len(row.output_token_ids) < row.params.min_tokens


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def greedy_from(params: SamplingParams) -> int | None:
    """The output length from which a row of ``params`` is a plain argmax (greedy; no penalty, logprobs,
    logit_bias or grammar; ``min_tokens`` reached), or None when it never is."""
    if (not _is_greedy(params) or _has_penalty(params) or params.logprobs is not None or params.logit_bias
            or params.grammar is not None):
        return None
    return params.min_tokens


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on (seed, position): 64 bits of blake2b of both."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


class Sampler:
    """Picks one token per row. Stateless apart from the shared generator of unseeded rows."""

    def __init__(self, seed: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 batched_seed_noise: bool | None = None) -> None:
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed: must be an integer or None, got {seed!r}")
        if batched_seed_noise not in (None, True, False):
            raise ValueError(f"batched_seed_noise: must be True, False or None (auto), got {batched_seed_noise!r}")
        self._seed = seed
        self._batched_seed_noise = batched_seed_noise
        self._eos_token_ids = tuple(eos_token_ids)
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """``logits [num_rows, vocab]`` -> one SampledToken per row, in row order."""
        logits = _validated_logits(logits, rows)
        if all(_is_greedy(r.params) and not _has_penalty(r.params) and r.params.logprobs is None
               and not _has_processor(r) for r in rows):
            return self.argmax([r.seq_id for r in rows], logits)   # fast path: one argmax
        adjusted = _penalised(self._processed(logits, rows), rows)
        tokens, ok = self._choose(adjusted, rows)
        return _with_logprobs(logits, rows, _sampled_tokens(rows, tokens, ok))

    def argmax(self, seq_ids: list[int], logits: torch.Tensor) -> list[SampledToken]:
        """The greedy token of each row of ``logits [rows, vocab]`` (rows whose ``greedy_from`` is reached:
        no penalty, processor or logprobs to apply); a row with a non-finite logit there fails."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise ValueError(f"logits: must be a tensor [{len(seq_ids)} rows, vocab], got "
                             f"{getattr(logits, 'shape', type(logits).__name__)}")
        logits = logits.float()
        if logits.device.type == "cpu" and not logits.requires_grad:     # NumPy: no torch op per small tensor
            values = logits.numpy()                                       # [rows, vocab]
            tokens = values.argmax(axis=1)                                # [rows]; the first NaN, as torch's
            finite = np.isfinite(values[np.arange(len(tokens)), tokens])
            token_ids = np.where(finite, tokens, -1).tolist()
        else:
            tokens = argmax_rows(logits)
            token_ids = torch.where(_finite_at(logits, tokens), tokens, -1).tolist()
        return [SampledToken(seq_id, t) if t >= 0 else SampledToken(seq_id, PLACEHOLDER_TOKEN, error=NON_FINITE_ROW)
                for seq_id, t in zip(seq_ids, token_ids)]

    def _processed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """``logits [rows, vocab]`` with logit_bias added and min_tokens' banned ids at -inf (a copy when any
        row has either; the raw logits stay untouched for logprobs)."""
        if not any(_has_processor(r) for r in rows):
            return logits
        vocab = logits.shape[1]
        row_ids, token_ids, values = [], [], []
        banned_rows, banned_ids = [], []
        for i, r in enumerate(rows):
            for token_id, bias in r.params.logit_bias:
                if token_id < vocab:
                    row_ids.append(i)
                    token_ids.append(token_id)
                    values.append(bias)
            if len(r.output_token_ids) < r.params.min_tokens:
                for token_id in {*self._eos_token_ids, *r.params.stop_token_ids}:
                    if token_id < vocab:
                        banned_rows.append(i)
                        banned_ids.append(token_id)
        out, device = logits.clone(), logits.device
        if row_ids:
            out.index_put_((torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
                           torch.tensor(values, device=device, dtype=out.dtype), accumulate=True)
        if banned_rows:
            out[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = float("-inf")
        return out

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [rows, vocab]`` (penalised) -> (token ids ``[rows]`` int64, ok ``[rows]`` bool): a row is ok
        when its greedy token's logit is finite, or its drawn token had a positive probability (a row with a
        NaN, or with every token at -inf, is not)."""
        sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if not sampled:
            tokens = argmax_rows(logits)
            return tokens, _finite_at(logits, tokens)
        if len(sampled) == len(rows):   # every row samples: no greedy argmax and no row gather needed
            tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
            ok = torch.empty(len(rows), dtype=torch.bool, device=logits.device)
            sampled, sub_rows = slice(None), rows
        else:
            tokens, sub_rows = argmax_rows(logits), [rows[i] for i in sampled]
            ok = _finite_at(logits, tokens)
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in sub_rows], device=device)
        scaled = logits[sampled] / temperature[:, None]  # [n_sampled, vocab] (a new tensor)
        if any(r.params.min_p > 0 for r in sub_rows):
            min_p = torch.tensor([r.params.min_p for r in sub_rows], device=device)
            scaled = apply_min_p(scaled, min_p)
        if any(r.params.top_k > 0 or r.params.top_p < 1 for r in sub_rows):
            top_k = torch.tensor([r.params.top_k for r in sub_rows], dtype=torch.int64, device=device)
            top_p = torch.tensor([r.params.top_p for r in sub_rows], device=device)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        picked, drawn = draw_by_cdf(scaled, self._uniforms(sub_rows, device))
        tokens[sampled] = picked
        ok[sampled] = drawn
        return tokens, ok

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One uniform number per row, ``[len(rows)]`` float64 in [0, 1): seeded rows from their (seed, position),
        one shared generator for the others."""
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        shared = self._shared_generator(device) if len(seeded) < len(rows) else None
        if not seeded:
            return torch.rand(len(rows), dtype=torch.float64, device=device, generator=shared)
        uniform = torch.empty(len(rows), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device, generator=shared)
        batched = self._batched_seed_noise
        if batched if batched is not None else device.type == "cuda":
            keys = noise_keys([(rows[i].params.seed, len(rows[i].output_token_ids)) for i in seeded], device)
            halves = seeded_uniform(keys, 2).double()      # [n_seeded, 2], multiples of 2^-24 in [0, 1)
            uniform[seeded] = halves[:, 0] + halves[:, 1] * 2.0**-24   # 48 bits, at most 1 - 2^-48
        else:
            for i in seeded:
                row = rows[i]
                generator = seeded_generator(row.params.seed, len(row.output_token_ids), device)
                uniform[i] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)[0]
        return uniform

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared_generators[device] = generator
        return generator


def _validated_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: must be a 2-D floating-point tensor [num_rows, vocab], got "
                         f"{type(logits).__name__} {getattr(logits, 'shape', '')}")
    if not isinstance(rows, list) or not all(isinstance(r, SamplingRow) for r in rows):
        raise ValueError("rows: must be a list of SamplingRow")
    if logits.shape[0] != len(rows) or logits.shape[1] == 0:
        raise ValueError(f"logits: shape {tuple(logits.shape)} does not match {len(rows)} rows "
                         "(or has an empty vocabulary)")
    if not all(isinstance(r.params, SamplingParams) for r in rows):
        raise ValueError("rows: every row's params must be a SamplingParams")
    return logits.float()


def _penalised(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Copy of ``logits [rows, vocab]`` with each row's penalties applied (rows without any: unchanged)."""
    penalised_rows = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not penalised_rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    sub = [rows[i] for i in penalised_rows]
    seen = token_id_matrix([r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0
                            else [] for r in sub], vocab, device)
    output = token_id_matrix([r.output_token_ids for r in sub], vocab, device)
    repetition = torch.tensor([r.params.repetition_penalty for r in sub], device=device)
    frequency = torch.tensor([r.params.frequency_penalty for r in sub], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in sub], device=device)
    out = logits.clone()
    out[penalised_rows] = apply_penalties(logits[penalised_rows], seen, output, repetition, frequency, presence)
    return out


NON_FINITE_ROW = "its logits are not finite (NaN, or every token masked)"
PLACEHOLDER_TOKEN = 0   # the token id of a failed row: keeps worker mirrors well-formed until it is released


def _finite_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: whether each row's logit at its chosen token is finite (argmax picks a NaN first)."""
    return logits.gather(1, tokens[:, None])[:, 0].isfinite()


def _sampled_tokens(rows: list[SamplingRow], tokens: torch.Tensor, ok: torch.Tensor) -> list[SampledToken]:
    """One SampledToken per row (one host transfer); a row that is not ok carries ``error`` and the
    placeholder token instead of whatever its argmax picked."""
    token_ids = torch.where(ok, tokens, -1).tolist()
    return [SampledToken(seq_id=r.seq_id, token_id=t) if t >= 0 else
            SampledToken(seq_id=r.seq_id, token_id=PLACEHOLDER_TOKEN, error=NON_FINITE_ROW)
            for r, t in zip(rows, token_ids)]


def _with_logprobs(raw_logits: torch.Tensor, rows: list[SamplingRow],
                   results: list[SampledToken]) -> list[SampledToken]:
    """``results`` with logprobs from log_softmax of the raw logits for the rows that ask (failed rows get
    none). Tokens at -inf (masked by a grammar) never appear in ``top_logprobs``, so a row may list fewer
    than it asked for; no logprob is ever NaN or infinite. An ok row holds NaN or +inf only at ids
    min_tokens bans (``_validated_logits``); those count as -inf here, as in sampling, so the rest of the
    row keeps finite logprobs."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None and results[i].error is None]
    if not wanted:
        return results
    raw = raw_logits[wanted]
    banned = raw.isnan() | (raw == float("inf"))
    logprobs = raw.masked_fill(banned, float("-inf")).log_softmax(dim=1)  # [n_wanted, vocab]
    chosen_ids = torch.tensor([results[i].token_id for i in wanted], device=raw_logits.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    top_n = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(top_n, dim=1)  # sorted, best first
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        results[i].logprob = chosen[j]   # finite: the row is ok, so its token's raw logit is finite
        results[i].top_logprobs = [(t, v) for t, v in zip(top_ids[j][:n], top_values[j][:n]) if math.isfinite(v)]
    return results
