"""Vectorised logit transforms used by the Sampler: penalties and the min-p / top-k / top-p filters.

Every function works on a batch ``[num_rows, vocab]`` at once with per-row parameter tensors
``[num_rows]``, returns a new tensor (the caller's logits are never modified) and marks removed
tokens with ``-inf``. A filter whose parameter disables it for a row leaves that row unchanged.

Semantics (settled here, following vLLM / Hugging Face / OpenAI):
- repetition penalty ``r`` on every token seen in the prompt or the output: a positive logit is
  divided by ``r``, a negative one multiplied by ``r`` (so ``r > 1`` always discourages).
- frequency ``f`` and presence ``p`` penalties on output tokens only (OpenAI):
  ``logit -= f * count + p * (count > 0)``. Applied after the repetition penalty.
- min-p keeps tokens with ``prob >= min_p * max_prob``, i.e. ``logit >= max_logit + log(min_p)``.
- top-k keeps the ``k`` largest logits (ties with the k-th are kept); ``k <= 0`` disables it.
- top-p keeps the smallest prefix of the tokens, sorted by probability, whose mass reaches ``top_p``
  (a token is kept when the mass strictly before it is < top_p; the best token is always kept),
  computed on the distribution renormalised after min-p and top-k (vLLM's order).
- top-k and top-p together become one logit threshold per row, found among the
  ``TOP_P_CANDIDATES`` largest logits (a ``topk``, several times cheaper than sorting 50k entries on
  CPU); only rows whose top-p prefix is longer than that are fully sorted. Tokens tied with the last
  kept token are kept. On CUDA the full sort runs for every row instead: it is cheap there, and the
  candidate path reads two values back to the host (the widest top-k, whether any row overflowed).
"""

from __future__ import annotations

import torch

TOP_P_CANDIDATES = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, vocab]`` -> the index of each row's largest value ``[rows]`` int64: the first one on ties, the
    first NaN in a row that has one (``torch.argmax``'s result). On CPU through NumPy, whose argmax is
    vectorised: torch 2.13's CPU ``argmax(dim=1)`` took 0.68 ms for 16 x 49,152 float32 logits (SmolLM2's
    vocabulary) and NumPy's 0.054 ms (2-core AMD EPYC VM, one thread, 2026-11-29)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.argmax(dim=1)
    return torch.from_numpy(x.numpy().argmax(axis=1))


def token_id_matrix(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Pad ragged token id lists into ``[num_rows, max_len]`` int64, padding with ``vocab_size``.

    The padding id points at an extra scratch column that callers drop, so scatters need no mask.
    Raises ValueError (naming ``rows``) for an id outside ``[0, vocab_size)``.
    """
    for ids in token_lists:
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"rows: token ids must lie in [0, {vocab_size}) for logits of that vocab size")
    width = max((len(ids) for ids in token_lists), default=0)
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_lists]
    matrix = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(token_lists), width)
    return matrix


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``ids [rows, len]`` (padded with vocab_size) -> counts ``[rows, vocab_size]`` float32."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, seen_ids: torch.Tensor, output_ids: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of ``logits [rows, vocab]``.

    seen_ids: ``[rows, a]`` prompt + output ids; output_ids: ``[rows, b]`` output ids (both padded with
    vocab); repetition / frequency / presence: ``[rows]`` float32 (1, 0, 0 = no penalty).
    """
    vocab = logits.shape[1]
    seen = token_counts(seen_ids, vocab) > 0
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    counts = token_counts(output_ids, vocab)
    return out - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens with ``prob < min_p * max_prob``; ``min_p [rows]``, 0 disables."""
    threshold = logits.max(dim=1, keepdim=True).values + torch.log(min_p)[:, None]  # log(0) = -inf
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Top-k then top-p as one per-row logit threshold found among the largest ``candidates`` logits.

    ``logits [rows, vocab]``; ``top_k [rows]`` int64 (<= 0: off); ``top_p [rows]`` (1: off).
    A full sort of the vocabulary costs ~25x a top-k of a few hundred entries on CPU, and top-p nearly
    always stops inside the first few hundred tokens; rows whose top-p prefix is longer than the
    candidate set (very flat distributions) fall back to ``top_k_top_p_by_sort``.
    Tokens tied with the last kept token are kept.
    """
    if logits.is_cuda:
        return top_k_top_p_by_sort(logits, top_k, top_p)   # no device-to-host reads
    num_rows, vocab = logits.shape
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    width = min(vocab, max(candidates, int(top_k.max().clamp(min=1))))
    values = logits.topk(width, dim=1).values  # [rows, width], best first
    neg_inf = torch.full((num_rows,), float("-inf"), device=logits.device)
    kth = torch.where(top_k > 0, values.gather(1, (k.clamp(max=width) - 1)[:, None])[:, 0], neg_inf)
    values = values.masked_fill(values < kth[:, None], float("-inf"))
    # top-p over the renormalised top-k survivors (all inside the candidates) or the whole row
    log_norm = torch.where(top_k > 0, values.logsumexp(dim=1), logits.logsumexp(dim=1))
    probs = (values - log_norm[:, None]).exp()
    cumulative = probs.cumsum(dim=1)
    keep = (cumulative - probs) < top_p[:, None]
    keep[:, 0] = True
    p_threshold = torch.where(keep, values, float("inf")).amin(dim=1)
    p_threshold = torch.where(top_p < 1, p_threshold, neg_inf)
    out = logits.masked_fill(logits < torch.maximum(kth, p_threshold)[:, None], float("-inf"))
    overflow = (top_p < 1) & (top_k <= 0) & (cumulative[:, -1] < top_p) & (width < vocab)
    if bool(overflow.any()):
        rows = overflow.nonzero()[:, 0]
        out[rows] = top_k_top_p_by_sort(logits[rows], top_k[rows], top_p[rows])
    return out


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Reference / fallback for ``apply_top_k_top_p`` with one full descending sort per row."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # ties with the k-th largest survive
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    # rows with top_p == 1 are skipped explicitly: cumsum can round to 1.0 before the tail
    drop = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


CDF_CHUNK = 1024   # vocabulary entries per chunk of draw_by_cdf's first search


def draw_by_cdf(scaled: torch.Tensor, uniform: torch.Tensor,
                chunk: int = CDF_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``scaled [rows, vocab]`` float32 logits after temperature and filters (removed tokens at -inf),
    ``uniform [rows]`` float64 in [0, 1) -> (token ids ``[rows]`` int64, ok ``[rows]`` bool).

    Inverse-CDF draw: with weights ``w = exp(scaled - row max)`` and ``target = uniform * sum(w)``, the token
    is the first whose running sum of w exceeds the target, so token i comes out with probability
    ``w_i / sum(w)``. The sums are float64 (exact for any weight above ~1e-16 of the total) and taken in two
    levels: the weights' sums per chunk of ``chunk`` entries and their running sum pick the chunk, then the
    running sum inside that one chunk picks the token, so no float64 copy of the whole row is made (a
    float64 ``cumsum`` of 16 x 49,152 float32 took 4.2 ms, converting them being most of it). A token of
    weight 0 (filtered out, underflowed, or the padding of the last chunk) is never drawn: the first index
    past a target has a weight > 0, and each level is capped at its last index with one, in case the
    rounding of a sum puts the target at the very end. A row is not ok when its total is not finite (a NaN
    in it, a +inf logit, or every token at -inf); its token is then any valid index.

    Cost on CPU, the Sampler's whole call on 16 x 49,152 logits at temperature 1 (SmolLM2's vocabulary, 2
    threads, glibc's malloc set as a CPU worker sets it: workers/host_memory.py): 1.8 ms median, against 5.9
    ms with the exponential race it replaced (one ``E = -log(U)`` per entry; ``torch.rand`` alone took 4.9
    ms); this function 1.0-1.2 ms of it (2-core AMD EPYC VM, 2026-12-03, 5 x 40 calls each)."""
    rows, vocab = scaled.shape
    num_chunks = -(-vocab // chunk)
    weights = (scaled - scaled.amax(dim=1, keepdim=True)).exp_()              # [rows, vocab], max 1 in an ok row
    if num_chunks * chunk != vocab:
        weights = torch.nn.functional.pad(weights, (0, num_chunks * chunk - vocab))   # zeros: never drawn
    chunks = weights.view(rows, num_chunks, chunk)                              # [rows, num_chunks, chunk]
    chunk_cdf = chunks.sum(dim=2, dtype=torch.float64).cumsum(dim=1)            # [rows, num_chunks]
    total = chunk_cdf[:, -1:].contiguous()                                      # [rows, 1], >= 1 in an ok row
    target = uniform[:, None] * total                                           # [rows, 1]
    c = _first_above(chunk_cdf, target, total)                                  # [rows, 1] chunk index
    before = torch.where(c > 0, chunk_cdf.gather(1, (c - 1).clamp_(min=0)), 0.0)   # [rows, 1] weight before it
    inner = chunks.gather(1, c[:, :, None].expand(rows, 1, chunk))[:, 0]          # [rows, chunk]
    inner_cdf = inner.cumsum(dim=1, dtype=torch.float64)                        # [rows, chunk]
    j = _first_above(inner_cdf, target - before, inner_cdf[:, -1:].contiguous())   # [rows, 1]
    tokens = (c * chunk + j).clamp_(max=vocab - 1)[:, 0]
    return tokens, total[:, 0].isfinite()


def _first_above(cdf: torch.Tensor, target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``cdf [rows, n]`` nondecreasing, ``target`` and ``total`` (= ``cdf[:, -1:]``) ``[rows, 1]`` -> ``[rows, 1]``:
    the first index whose value exceeds the target, at most the last index where the cdf grows (the first
    that reaches the total), and within [0, n - 1] whatever the values (a NaN row)."""
    first = torch.searchsorted(cdf, target.contiguous(), right=True)
    last_growth = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(first, last_growth).clamp_(max=cdf.shape[1] - 1)
