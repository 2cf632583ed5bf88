"""Torch references for the paged-attention kernels: the test oracle *and* the CPU attention path.

Same signatures as the public kernels; no argument validation here (the public wrappers do it).

Decisions: docs/design/kernels.md, ``pagedray.kernels.reference.attention``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..kv_quant import quantize_rows

GATHER_BUDGET_BYTES = 2 << 20
# paged_prefill_reference: by default, chunks up to this long run as decode rows when a decode pass is given
# (the CPU path: the C decode kernel). The CPU path passes the length timed on the machine instead
# (``cpu_twins.prefill_c_max``); this value is what ``PAGEDRAY_CPU_TWINS=c`` (the tests) keeps.
ROW_CHUNK_MAX = 1024


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                       static_scales=None) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> cache slots; slot < 0 is skipped. With scales
    (an 8-bit cache) the rows are quantized (``kv_quant.quantize_rows``, with ``static_scales`` (k, v) a
    checkpoint's scales) and their scales stored too."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if k_scale is not None:
        k_static, v_static = static_scales or (None, None)
        key, k_rows = quantize_rows(key, k_cache.dtype, k_static)
        value, v_rows = quantize_rows(value, v_cache.dtype, v_static)
        k_scale.view(-1, k_scale.shape[2])[slots] = k_rows      # scales are allocated contiguous
        v_scale.view(-1, v_scale.shape[2])[slots] = v_rows
    if k_cache.is_contiguous() and v_cache.is_contiguous():   # the usual case: one copy per cache
        # as bytes when 8-bit: torch has no index_copy_ for float8
        raw = torch.uint8 if k_scale is not None else k_cache.dtype
        k_cache.view(raw).view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype).view(raw))
        v_cache.view(raw).view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype).view(raw))
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def _blocks_f32(cache, scales, ids):
    """cache [NB, bs, Hkv, D] (scales [NB, bs, Hkv] for an 8-bit cache, else None), ids [n] long ->
    those blocks as float32 [n, bs, Hkv, D], dequantized."""
    g = cache.index_select(0, ids).to(torch.float32)
    return g if scales is None else g.mul_(scales.index_select(0, ids).to(torch.float32).unsqueeze(-1))


def _gather(cache, table, lo: int, hi: int, scales=None):
    """cache [NB, bs, Hkv, D], table [B, nb] long -> key positions [lo, hi) as [B, Hkv, hi-lo, D] fp32."""
    block_size = cache.shape[1]
    first, last = lo // block_size, (hi + block_size - 1) // block_size
    ids = table[:, first:last].clamp(0, cache.shape[0] - 1)
    g = _blocks_f32(cache, scales, ids.reshape(-1))                               # [B*nb, bs, Hkv, D]
    g = g.view(ids.shape[0], -1, cache.shape[2], cache.shape[3])                  # [B, nb*bs, Hkv, D]
    start = lo - first * block_size
    return g[:, start:start + hi - lo].transpose(1, 2)


def _sdpa(queries, keys, values, mask, scale, softcap, sink_rows=None):
    """SDPA, or with ``softcap`` (Gemma 2) transformers' eager formula: softcap * tanh(scale q k^T / softcap),
    + mask (bool: visible, float: bias with -inf), softmax, @ v. With ``sink_rows`` (gpt-oss; float32
    [Hkv, R] for queries [.., Hkv, R, D]) each row's sink logit joins the softmax as one more column that has
    no value row, as transformers' eager attention concatenates it. Rows with no visible key give NaN here
    without sinks (the callers zero them) and zeros with them."""
    if softcap is None and sink_rows is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sink_rows is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    sink = sink_rows[..., None].expand(*scores.shape[:-1], 1)                    # [.., Hkv, R, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values)


def _sink_rows(sinks, num_kv_heads: int, tokens: int):
    """[Hq] -> [Hkv, group * T] float32 (row = g * T + t, ``_group_rows``' order), or None."""
    if sinks is None:
        return None
    per_head = sinks.to(torch.float32).view(num_kv_heads, -1, 1)
    return per_head.expand(-1, -1, tokens).reshape(num_kv_heads, -1)


def _attend(q_rows, keys, values, row_pos, k_lo: int, k_lens, scale, row_slopes, sliding_window, softcap=None,
            sink_rows=None):
    """q_rows [B, Hkv, R, D]; keys/values [B, Hkv, L, D] holding positions [k_lo, k_lo + L);
    row_pos [B, R] absolute query positions; k_lens [B] keys that exist; row_slopes / sink_rows [Hkv, R] or None.
    -> [B, Hkv, R, D] float32."""
    k_pos = torch.arange(k_lo, k_lo + keys.shape[2], device=keys.device)          # [L]
    visible = (k_pos <= row_pos[:, :, None]) & (k_pos < k_lens[:, None, None])    # [B, R, L]
    if sliding_window is not None:
        visible &= k_pos > row_pos[:, :, None] - sliding_window
    if row_slopes is None:
        mask = visible[:, None]                                                   # [B, 1, R, L]
    else:
        rel = (k_pos - row_pos[:, :, None]).to(torch.float32)                     # [B, R, L]
        mask = (row_slopes[None, :, :, None] * rel[:, None]).masked_fill_(~visible[:, None], float("-inf"))
    out = _sdpa(q_rows, keys, values, mask, scale, softcap, sink_rows)
    return out.nan_to_num_(0.0)                                                   # rows with no key


def _group_rows(x, num_kv_heads: int):
    """[B, T, Hq, D] -> [B, Hkv, group * T, D] float32, row = g * T + t."""
    b, t, hq, d = x.shape
    x = x.to(torch.float32).view(b, t, num_kv_heads, hq // num_kv_heads, d)
    return x.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, -1, d)


def _ungroup_rows(x, tokens: int):
    """[B, Hkv, group * T, D] -> [B, T, Hq, D]."""
    b, hkv, r, d = x.shape
    return x.view(b, hkv, r // tokens, tokens, d).permute(0, 3, 1, 2, 4).reshape(b, tokens, -1, d)


def _row_slopes(alibi_slopes, num_kv_heads: int, tokens: int):
    """[Hq] -> [Hkv, group * T] slope of each query row, or None."""
    if alibi_slopes is None:
        return None
    per_head = alibi_slopes.to(torch.float32).view(num_kv_heads, -1, 1)
    return per_head.expand(-1, -1, tokens).reshape(num_kv_heads, -1)


def _decode_mask(lens, width: int, slopes, sliding_window):
    """lens [n] long -> mask for queries at positions lens - 1 over key positions [0, width):
    bool [n, 1, 1, width] (visible), or with ALiBi float [n, Hkv, G, width] (bias, -inf where hidden)."""
    k_pos = torch.arange(width, device=lens.device)                                # [L]
    q_pos = (lens - 1)[:, None]                                                   # [n, 1]
    visible = k_pos <= q_pos                                                      # [n, L]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    visible = visible[:, None, None]
    if slopes is None:
        return visible
    rel = (k_pos - q_pos).to(torch.float32)[:, None, None]                        # [n, 1, 1, L]
    return (slopes[None, :, :, None] * rel).masked_fill_(~visible, float("-inf"))


def _length_groups(sorted_lens: list[int], bytes_per_position: int, block_size: int) -> list[tuple[int, int]]:
    """Cut lengths sorted ascending into ranges ``[a, b)`` whose padded gather (``b - a`` sequences x the
    last one's length rounded up to whole blocks x ``bytes_per_position``) fits GATHER_BUDGET_BYTES;
    a range holds at least one sequence. Zero lengths are left out (their rows stay zero)."""
    ranges, start = [], next((i for i, n in enumerate(sorted_lens) if n > 0), len(sorted_lens))
    for i in range(start, len(sorted_lens)):
        padded = -(-sorted_lens[i] // block_size) * block_size
        if i > start and (i + 1 - start) * padded * bytes_per_position > GATHER_BUDGET_BYTES:
            ranges.append((start, i))
            start = i
    if start < len(sorted_lens):
        ranges.append((start, len(sorted_lens)))
    return ranges


def _decode_rows(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes, sliding_window,
                 logit_softcap=None, k_scale=None, v_scale=None, sinks=None):
    """q [S, Hq, D] one query per sequence at position seq_len - 1 -> [S, Hq, D] float32.

    Sequences are sorted by length (so a group pads little) and cut into groups (``_length_groups``).
    Per group: one ``index_select`` of the used blocks for K and one for V (``[n, L, Hkv, D]``, viewed
    as ``[n, Hkv, L, D]`` without a copy) and one SDPA call whose query rows are the ``G = Hq / Hkv``
    heads of each KV head (``[n, Hkv, G, D]``).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    lens_host = seq_lens.tolist()
    order_host = sorted(range(num_seqs), key=lens_host.__getitem__)
    permuted = order_host != list(range(num_seqs))
    order = torch.tensor(order_host, device=q.device) if permuted else slice(None)
    lens = seq_lens.to(device=q.device, dtype=torch.long)[order]                  # sorted ascending
    tables = block_tables[order]
    queries = q.reshape(num_seqs, num_kv_heads, group, head_dim)[order].to(torch.float32)
    slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).view(num_kv_heads, group)
    sink_rows = None if sinks is None else sinks.to(torch.float32).view(num_kv_heads, group)
    sorted_out = torch.zeros((num_seqs, num_kv_heads, group, head_dim), dtype=torch.float32, device=q.device)
    sorted_lens = [lens_host[i] for i in order_host]
    for s0, s1 in _length_groups(sorted_lens, 2 * 4 * num_kv_heads * head_dim, block_size):
        used = min(-(-sorted_lens[s1 - 1] // block_size), tables.shape[1])   # capacity is checked by the API
        ids = tables[s0:s1, :used].long().clamp_(0, num_blocks - 1).reshape(-1)       # [n * used]
        shape = (s1 - s0, used * block_size, num_kv_heads, head_dim)
        keys = _blocks_f32(k_cache, k_scale, ids).view(shape).transpose(1, 2)          # [n, Hkv, L, D]
        values = _blocks_f32(v_cache, v_scale, ids).view(shape).transpose(1, 2)
        mask = _decode_mask(lens[s0:s1], shape[1], slopes, sliding_window)
        sorted_out[s0:s1] = _sdpa(queries[s0:s1], keys, values, mask, scale, logit_softcap, sink_rows).nan_to_num_(0.0)
    result = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out) if permuted else sorted_out
    return result.view(num_seqs, num_q_heads, head_dim)


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes=None,
                           sliding_window=None, out=None, logit_softcap=None, k_scale=None, v_scale=None, sinks=None):
    """q [num_seqs, num_q_heads, head_dim] -> out [num_seqs, num_q_heads, head_dim] (q.dtype)."""
    result = _decode_rows(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes, sliding_window,
                          logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _prefill_one(q_chunk, k_cache, v_cache, table_row, seq_len_k: int, scale, alibi_slopes,
                 sliding_window, result, softcap=None, k_scale=None, v_scale=None, sinks=None):
    """q_chunk [nq, Hq, D] = the last nq positions of a sequence of seq_len_k keys; writes
    result [nq, Hq, D] float32 one query block at a time (each block's mask stays under the budget
    and only sees keys up to its last query)."""
    nq, num_q_heads, head_dim = q_chunk.shape
    num_kv_heads = k_cache.shape[2]
    if seq_len_k == nq and alibi_slopes is None and sliding_window is None and softcap is None and sinks is None:
        # no history, no bias: plain causal attention, SDPA's is_causal (no mask tensor, no row grouping;
        # the same values, 15-55% less time at 16-256 tokens on the 2-core VM)
        table = table_row[None].long()
        keys, values = _gather(k_cache, table, 0, nq, k_scale), _gather(v_cache, table, 0, nq, v_scale)
        queries = q_chunk.to(torch.float32).transpose(0, 1)[None]                        # [1, Hq, nq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=num_kv_heads != num_q_heads)
        result.copy_(out[0].transpose(0, 1))
        return
    per_row = 4 * num_q_heads if alibi_slopes is not None else num_q_heads // num_kv_heads
    block_q = max(1, GATHER_BUDGET_BYTES // (per_row * seq_len_k))
    first = seq_len_k - nq
    lo0 = 0 if sliding_window is None else max(0, first - sliding_window + 1)
    table = table_row[None].long()
    keys = _gather(k_cache, table, lo0, seq_len_k, k_scale)                       # [1, Hkv, L, D]
    values = _gather(v_cache, table, lo0, seq_len_k, v_scale)
    k_len = torch.tensor([seq_len_k], device=q_chunk.device)
    for t0 in range(0, nq, block_q):
        t1 = min(nq, t0 + block_q)
        lo = 0 if sliding_window is None else max(0, first + t0 - sliding_window + 1)
        hi = first + t1                                                            # last query pos + 1
        rows = _group_rows(q_chunk[None, t0:t1], num_kv_heads)                    # [1, Hkv, G*T, D]
        pos = torch.arange(first + t0, hi, device=q_chunk.device)
        row_pos = pos.repeat(rows.shape[2] // (t1 - t0))[None]                     # [1, G*T]
        slopes = _row_slopes(alibi_slopes, num_kv_heads, t1 - t0)
        out = _attend(rows, keys[:, :, lo - lo0:hi - lo0], values[:, :, lo - lo0:hi - lo0], row_pos, lo,
                      k_len, scale, slopes, sliding_window, softcap, _sink_rows(sinks, num_kv_heads, t1 - t0))
        result[t0:t1] = _ungroup_rows(out, t1 - t0)[0]


def paged_prefill_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                            alibi_slopes=None, out=None, *, sliding_window=None, decode_rows=None,
                            logit_softcap=None, k_scale=None, v_scale=None, row_chunk_max=ROW_CHUNK_MAX,
                            chunk_rows=None, sinks=None):
    """q [total_q, Hq, D] holding each sequence's newest chunk -> out [total_q, Hq, D] (q.dtype).

    Length-1 chunks go through one batched decode pass (``decode_rows``, a function with
    ``_decode_rows``' arguments and result shape; default ``_decode_rows``, the compiled CPU kernel on
    the CPU path). With a ``decode_rows`` given, chunks of at most ``row_chunk_max`` tokens join that pass
    too, one row per token, each attending up to its own position (causal): a batch of such chunks is
    one decode call over all its tokens (``_all_rows``). With ``chunk_rows`` also given (a function with
    ``cpu_prefill.paged_prefill_cpu``'s arguments and result), the chunks of 2 to ``row_chunk_max`` tokens
    go through it instead, in one call. Longer chunks are done per sequence.
    """
    cu = cu_seqlens_q.tolist()
    k_lens = seq_lens_k.tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    short = row_chunk_max if decode_rows is not None else 1
    if chunk_rows is not None and decode_rows is not None and 2 <= min(lengths, default=0) and max(lengths) <= short:
        result = chunk_rows(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, sliding_window)
        return result if out is None else out.copy_(result)
    if chunk_rows is None and decode_rows is not None and max(lengths, default=0) <= short:
        result = _all_rows(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes,
                           sliding_window, decode_rows, logit_softcap, k_scale, v_scale, sinks)
    else:
        result = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        by_rows = [i for i, n in enumerate(lengths) if 1 <= n <= (1 if chunk_rows is not None else short)]
        if by_rows:
            _rows_into(result, by_rows, cu, k_lens, q, k_cache, v_cache, block_tables, seq_lens_k.dtype, scale,
                       alibi_slopes, sliding_window, decode_rows or _decode_rows, logit_softcap, k_scale, v_scale,
                       sinks)
        by_chunks = [i for i, n in enumerate(lengths) if 2 <= n <= short] if chunk_rows is not None else []
        if by_chunks:
            _chunks_into(result, by_chunks, cu, lengths, q, k_cache, v_cache, seq_lens_k, block_tables, scale,
                         sliding_window, chunk_rows)
        for i, nk in enumerate(k_lens):
            if lengths[i] > short:
                start, end = cu[i], cu[i + 1]
                _prefill_one(q[start:end], k_cache, v_cache, block_tables[i], nk, scale, alibi_slopes,
                             sliding_window, result[start:end], logit_softcap, k_scale, v_scale, sinks)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _rows_into(result, seq_ids, cu, k_lens, q, k_cache, v_cache, block_tables, lens_dtype, scale, alibi_slopes,
               sliding_window, decode_rows, logit_softcap, k_scale, v_scale, sinks=None) -> None:
    """The chunks of sequences ``seq_ids`` as decode rows, one call: token t of a chunk sees the positions up
    to its own. Writes their rows of result [total_q, Hq, D] float32."""
    rows, seqs, lens = [], [], []
    for i in seq_ids:
        n = cu[i + 1] - cu[i]
        rows += range(cu[i], cu[i + 1])
        seqs += [i] * n
        lens += range(k_lens[i] - n + 1, k_lens[i] + 1)
    rows_t = torch.tensor(rows, device=q.device)
    idx = torch.tensor(seqs, device=q.device)
    row_lens = torch.tensor(lens, dtype=lens_dtype, device=q.device)
    rows_out = decode_rows(q[rows_t], k_cache, v_cache, block_tables[idx], row_lens, scale, alibi_slopes,
                           sliding_window, logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale,
                           sinks=sinks)
    result[rows_t] = rows_out.to(torch.float32)


def _chunks_into(result, seq_ids, cu, lengths, q, k_cache, v_cache, seq_lens_k, block_tables, scale,
                 sliding_window, chunk_rows) -> None:
    """The chunks of sequences ``seq_ids`` through ``chunk_rows`` in one call (a sub-batch of q's rows).
    Writes their rows of result [total_q, Hq, D] float32."""
    rows = [t for i in seq_ids for t in range(cu[i], cu[i + 1])]
    rows_t = torch.tensor(rows, device=q.device)
    idx = torch.tensor(seq_ids, device=q.device)
    sub_cu = torch.tensor([0, *itertools.accumulate(lengths[i] for i in seq_ids)], dtype=torch.int32)
    chunk_out = chunk_rows(q[rows_t], k_cache, v_cache, sub_cu, seq_lens_k[idx], block_tables[idx], scale,
                           sliding_window)
    result[rows_t] = chunk_out.to(torch.float32)


def _all_rows(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes, sliding_window,
              decode_rows, logit_softcap, k_scale, v_scale, sinks=None):
    """Every token of q as a decode row, in place (no gather or scatter of q): token t of sequence i,
    whose chunk ends at cu[i + 1], sees the keys up to its own position, seq_len_k[i] - (cu[i + 1] - 1 - t)
    of them, through its sequence's block table. -> [total_q, Hq, D]."""
    total = q.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.long)                     # [seqs]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q.device), q_lens,
                                         output_size=total)                            # [total_q]
    ends = cu_seqlens_q.to(torch.long)[1:]
    row_lens = (seq_lens_k.to(torch.long)[seq_of_row] - ends[seq_of_row] + 1
                + torch.arange(total, device=q.device)).to(seq_lens_k.dtype)           # [total_q]
    return decode_rows(q, k_cache, v_cache, block_tables.index_select(0, seq_of_row), row_lens, scale,
                       alibi_slopes, sliding_window, logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale,
                       sinks=sinks)


def paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                              alibi_slopes=None, max_query_len=None, out=None, *, sliding_window=None,
                              logit_softcap=None, k_scale=None, v_scale=None, sinks=None):
    """Mixed batch: the prefill reference already routes length-1 chunks through the decode pass."""
    return paged_prefill_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                                   alibi_slopes=alibi_slopes, out=out, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)


