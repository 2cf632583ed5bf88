"""Public paged-attention entry points: validate, then dispatch to Triton (CUDA) or the torch reference.

Cache layout (everywhere): per layer ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]`` with head_dim contiguous; token position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size`` (slot ``block * block_size + offset``).

Keyword-only extras beyond the fixed interface (all optional, defaults keep the interface's behaviour):
* ``validate_values``: run the checks that read tensor contents (see ``validation``); default on for CPU
  tensors, off for CUDA tensors so the GPU hot path never syncs with the host.
* ``use_triton``: ``None`` = Triton for CUDA tensors, reference for CPU tensors. ``True`` on CPU tensors
  runs the Triton kernels under ``TRITON_INTERPRET=1`` (the kernel tests do this); ``False`` on CUDA
  runs the reference on the GPU (the GPU tests' oracle).
* ``sliding_window`` on prefill / mixed batches, so a sliding-window model sees the same mask in every
  phase (key ``j`` is visible from position ``p`` iff ``p - W < j <= p``).
* ``k_scale`` / ``v_scale``: an 8-bit cache (``torch.int8`` or ``torch.float8_e4m3fn``) comes with one
  float16 scale per cached row, ``[num_blocks, block_size, num_kv_heads]`` each (``kv_quant``): ``store_kv``
  quantizes into them, the attention kernels dequantize as they load. q, key and value keep the compute
  dtype. Required with an 8-bit cache, refused with any other.
"""

from __future__ import annotations

import math
import os

import torch

from . import validation as v
from .cpu import cpu_decode, cpu_fused, cpu_prefill, cpu_twins
from .reference.attention import paged_decode_reference, paged_prefill_reference, store_kv_reference
from .triton.decode_triton import paged_decode_triton
from .triton.prefill_triton import paged_prefill_triton
from .triton.store_kv_triton import store_kv_triton


def _triton_wanted(use_triton: bool | None, device: torch.device) -> bool:
    if use_triton is None:
        return device.type == "cuda"
    if use_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("use_triton: Triton on non-CUDA tensors needs TRITON_INTERPRET=1 set before "
                         "triton is imported")
    return bool(use_triton)


def _check_new_rows(key, value, k_cache, v_cache, k_scale, v_scale) -> None:
    """The caches (and an 8-bit cache's scales) and the key / value rows to store into them."""
    v.check_caches(k_cache, v_cache)
    v.check_kv_scales(k_cache, k_scale, v_scale)
    v.check_heads_tensor("key", key, k_cache, num_kv_heads_match=True)
    v.check_heads_tensor("value", value, k_cache, num_kv_heads_match=True)
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} differs from key {tuple(key.shape)}")


def store_kv(key, value, k_cache, v_cache, slot_mapping, *, validate_values=None, use_triton=None,
             k_scale=None, v_scale=None, static_scales=None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into cache slots; slot < 0 is skipped.
    ``static_scales`` (k, v): a checkpoint's scales for a float8 cache's rows (``kv_quant``)."""
    _check_new_rows(key, value, k_cache, v_cache, k_scale, v_scale)
    v.check_static_scales(static_scales, k_cache)
    check = v.values_checked(validate_values, k_cache.device)
    v.check_slot_mapping(slot_mapping, key.shape[0], k_cache, check)
    if _triton_wanted(use_triton, k_cache.device):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, static_scales)
    elif k_scale is None and cpu_fused.supports_store_kv(key, value, k_cache, v_cache, slot_mapping):
        cpu_fused.store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, static_scales)


def _check_softcap(logit_softcap) -> None:
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                                      or not math.isfinite(logit_softcap) or logit_softcap <= 0):
        raise ValueError(f"logit_softcap: expected None or a positive finite float, got {logit_softcap!r}")


def _check_common(q, k_cache, v_cache, scale, alibi_slopes, sliding_window, out, logit_softcap=None,
                  k_scale=None, v_scale=None, sinks=None) -> None:
    _check_softcap(logit_softcap)
    v.check_sinks(sinks, q)
    v.check_caches(k_cache, v_cache)
    v.check_kv_scales(k_cache, k_scale, v_scale)
    v.check_heads_tensor("q", q, k_cache, num_kv_heads_match=False)
    v.check_scale(scale)
    v.check_alibi(alibi_slopes, q)
    v.check_sliding_window(sliding_window)
    v.check_out(out, q)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes=None, sliding_window=None,
                 out=None, *, validate_values=None, use_triton=None, logit_softcap=None, k_scale=None, v_scale=None,
                 sinks=None):
    """One query token per sequence at position seq_len - 1.

    q [num_seqs, num_q_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
    seq_lens [num_seqs] int32 -> out [num_seqs, num_q_heads, head_dim] (q.dtype).
    ``logit_softcap`` (Gemma 2): the scaled scores become ``softcap * tanh(score / softcap)``. ``sinks``
    (gpt-oss; float32 [num_q_heads]): one more logit per head in each softmax, with no value row.
    """
    _check_common(q, k_cache, v_cache, scale, alibi_slopes, sliding_window, out, logit_softcap, k_scale, v_scale,
                  sinks)
    v.check_block_tables(block_tables, seq_lens, q.shape[0], q.device)
    if v.values_checked(validate_values, q.device):
        v.check_seq_len_values("seq_lens", seq_lens, block_tables, k_cache)
    run = _decode_kernel(_triton_wanted(use_triton, q.device), q, k_cache)
    return run(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes, sliding_window, out,
               **_extras_kw(logit_softcap, k_scale, v_scale, sinks))


def _extras_kw(logit_softcap, k_scale=None, v_scale=None, sinks=None) -> dict:
    """The optional keywords a kernel takes: only those in use, so that every kernel keeps its defaults."""
    extras = {} if logit_softcap is None else {"logit_softcap": float(logit_softcap)}
    if k_scale is not None:
        extras.update(k_scale=k_scale, v_scale=v_scale)
    if sinks is not None:
        extras["sinks"] = sinks
    return extras


def _decode_kernel(triton_path: bool, q, k_cache):
    """Triton on CUDA, the compiled CPU kernel on CPU where it is built and takes the shapes, else the
    torch reference."""
    if triton_path:
        return paged_decode_triton
    return cpu_decode.paged_decode_cpu if cpu_decode.supports(q, k_cache) else paged_decode_reference


def _check_varlen(total_q: int, device, k_cache, cu_seqlens_q, seq_lens_k, block_tables, validate: bool) -> None:
    v.check_tensor("seq_lens_k", seq_lens_k, 1, device)
    v.check_block_tables(block_tables, seq_lens_k, seq_lens_k.shape[0], device, lens_name="seq_lens_k")
    v.check_cu_seqlens(cu_seqlens_q, seq_lens_k, total_q, validate)
    if validate:
        v.check_seq_len_values("seq_lens_k", seq_lens_k, block_tables, k_cache)


def _check_max_query_len(max_query_len, cu_seqlens_q, seq_lens_k, validate: bool) -> None:
    if max_query_len is not None and (isinstance(max_query_len, bool) or not isinstance(max_query_len, int)
                                      or max_query_len < 0):
        raise ValueError(f"max_query_len: expected None or a non-negative int, got {max_query_len!r}")
    if validate and max_query_len is not None and seq_lens_k.shape[0] > 0:
        cu = v.host_values(cu_seqlens_q)
        longest = int((cu[1:] - cu[:-1]).max())
        if longest != max_query_len:
            raise ValueError(f"max_query_len: {max_query_len} but the longest chunk in cu_seqlens_q "
                             f"has {longest} tokens")


def check_step_metadata(k_cache, v_cache, num_tokens: int, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables,
                        max_query_len=None, *, validate_values=None) -> None:
    """The checks of ``store_kv`` + ``paged_attention`` on the metadata one step shares by all its layers.

    For callers that run many layers over the same metadata (the model runner): check once per step
    here, then pass ``validate_values=False`` to each layer's ``store_kv`` / ``paged_attention`` (their
    structural checks on q/k/v still run per call). ``validate_values`` has the usual default.
    """
    v.check_caches(k_cache, v_cache)
    validate = v.values_checked(validate_values, k_cache.device)
    v.check_slot_mapping(slot_mapping, num_tokens, k_cache, validate)
    _check_varlen(num_tokens, k_cache.device, k_cache, cu_seqlens_q, seq_lens_k, block_tables, validate)
    _check_max_query_len(max_query_len, cu_seqlens_q, seq_lens_k, validate)


def check_host_step_metadata(cache_shape, cache_dtype: torch.dtype, num_tokens: int, slot_mapping, cu_seqlens_q,
                             seq_lens_k, block_tables, max_query_len=None) -> None:
    """``check_step_metadata`` with every value check, on CPU metadata, for a cache on any device.

    ``cache_shape`` is one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``. The model
    runner checks a step's metadata here before copying it to the GPU, so the checks read host memory
    and the device never syncs. The checks only need the cache's shape and dtype: they run against a
    zero-stride CPU stand-in of that shape (``head_dim`` elements of storage).
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    stand_in = torch.empty(head_dim, dtype=cache_dtype).as_strided(tuple(cache_shape), (0, 0, 0, 1))
    check_step_metadata(stand_in, stand_in, num_tokens, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables,
                        max_query_len, validate_values=True)


def paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes=None,
                  out=None, *, sliding_window=None, validate_values=None, use_triton=None, logit_softcap=None,
                  k_scale=None, v_scale=None, sinks=None):
    """Causal varlen chunks over cached history.

    q [total_q, num_q_heads, head_dim]; cu_seqlens_q [num_seqs + 1] int32; seq_lens_k [num_seqs] int32
    (history + chunk; the chunk's keys are already stored); block_tables [num_seqs, max_blocks] int32
    -> out [total_q, num_q_heads, head_dim] (q.dtype). Query i of a chunk sees keys
    [0, seq_len_k - q_len + i]. ``logit_softcap`` and ``sinks`` as ``paged_decode``'s.
    """
    _check_common(q, k_cache, v_cache, scale, alibi_slopes, sliding_window, out, logit_softcap, k_scale, v_scale,
                  sinks)
    _check_varlen(q.shape[0], q.device, k_cache, cu_seqlens_q, seq_lens_k, block_tables,
                  v.values_checked(validate_values, q.device))
    return _prefill(_triton_wanted(use_triton, q.device), q, k_cache, v_cache, cu_seqlens_q, seq_lens_k,
                    block_tables, scale, alibi_slopes, out, sliding_window, logit_softcap, k_scale, v_scale, sinks)


def _prefill(triton_path: bool, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes,
             out, sliding_window, logit_softcap=None, k_scale=None, v_scale=None, sinks=None):
    """Triton on CUDA; on CPU the torch prefill reference, whose short chunks go to the C kernels (length 1: the
    decode kernel; longer: the prefill kernel where it takes the layout, else decode rows)."""
    if triton_path:
        return paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                                    alibi_slopes, out, sliding_window=sliding_window,
                                    **_extras_kw(logit_softcap, k_scale, v_scale, sinks))
    rows = {}
    if cpu_decode.supports(q, k_cache):   # chunks up to the length timed on this CPU run in C (cpu_twins)
        by_chunks = k_scale is None and sinks is None and cpu_prefill.supports(q, k_cache, alibi_slopes, logit_softcap)
        rows = {"decode_rows": cpu_decode.paged_decode_cpu,
                "chunk_rows": cpu_prefill.paged_prefill_cpu if by_chunks else None,
                "row_chunk_max": cpu_twins.prefill_c_max(q.dtype, q.shape[1], k_cache.shape[2], q.shape[2],
                                                            by_chunks)}
    return paged_prefill_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                                   alibi_slopes, out, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks, **rows)


def _is_all_decode(q, cu_seqlens_q, num_seqs: int, max_query_len, values_known: bool) -> bool:
    """True when every chunk has exactly one token. Without value checks (CUDA default) a batch with
    ``total_q == num_seqs`` is taken as all-decode unless ``max_query_len`` says otherwise, so callers
    that send zero-length chunks must pass ``max_query_len``."""
    if q.shape[0] != num_seqs:
        return False
    if max_query_len is not None:
        return max_query_len == 1
    if values_known:
        return bool(((cu_seqlens_q[1:] - cu_seqlens_q[:-1]) == 1).all())
    return True


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes=None,
                    max_query_len=None, out=None, *, sliding_window=None, validate_values=None,
                    use_triton=None, logit_softcap=None, k_scale=None, v_scale=None, sinks=None):
    """Mixed batch (decode rows and prefill chunks, shapes as ``paged_prefill``): the decode kernel when
    every chunk is one token, else the prefill kernel. ``max_query_len`` (optional host int) is a hint."""
    _check_common(q, k_cache, v_cache, scale, alibi_slopes, sliding_window, out, logit_softcap, k_scale, v_scale,
                  sinks)
    validate = v.values_checked(validate_values, q.device)
    _check_varlen(q.shape[0], q.device, k_cache, cu_seqlens_q, seq_lens_k, block_tables, validate)
    _check_max_query_len(max_query_len, cu_seqlens_q, seq_lens_k, validate)
    triton_path = _triton_wanted(use_triton, q.device)
    if _is_all_decode(q, cu_seqlens_q, seq_lens_k.shape[0], max_query_len, validate):
        run = _decode_kernel(triton_path, q, k_cache)
        return run(q, k_cache, v_cache, block_tables, seq_lens_k, scale, alibi_slopes, sliding_window, out,
                   **_extras_kw(logit_softcap, k_scale, v_scale, sinks))
    return _prefill(triton_path, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, alibi_slopes,
                    out, sliding_window, logit_softcap, k_scale, v_scale, sinks)


def store_kv_and_attend(q, key, value, k_cache, v_cache, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables,
                        scale, *, max_query_len=None, sliding_window=None, validate_values=None, use_triton=None,
                        logit_softcap=None, k_scale=None, v_scale=None, static_scales=None, sinks=None):
    """``store_kv(key, value, ...)`` then ``paged_attention(q, ...)`` (no ALiBi): one call where one kernel
    does both (a decode step on CPU into a cache in q's dtype or of 8-bit rows: the C decode kernel stores each
    sequence's new key / value, quantized for an 8-bit cache, then reads them), else the two calls. Shapes and checks as
    those two functions' (``static_scales``: ``store_kv``'s)."""
    _check_new_rows(key, value, k_cache, v_cache, k_scale, v_scale)
    v.check_static_scales(static_scales, k_cache)
    triton_path = _triton_wanted(use_triton, q.device)
    validate = v.values_checked(validate_values, q.device)
    one_call = (not triton_path and key.shape[0] == q.shape[0] and key.dtype == q.dtype
                and cpu_decode.supports(q, k_cache) and cpu_decode.stores_rows_into(k_cache)
                and _is_all_decode(q, cu_seqlens_q, seq_lens_k.shape[0], max_query_len, validate))
    if not one_call:
        store_kv(key, value, k_cache, v_cache, slot_mapping, validate_values=validate, use_triton=use_triton,
                 k_scale=k_scale, v_scale=v_scale, static_scales=static_scales)
        return paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                               max_query_len=max_query_len, sliding_window=sliding_window,
                               validate_values=validate, use_triton=use_triton, logit_softcap=logit_softcap,
                               k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    v.check_slot_mapping(slot_mapping, key.shape[0], k_cache, validate)
    _check_common(q, k_cache, v_cache, scale, None, sliding_window, None, logit_softcap, k_scale, v_scale, sinks)
    _check_varlen(q.shape[0], q.device, k_cache, cu_seqlens_q, seq_lens_k, block_tables, validate)
    _check_max_query_len(max_query_len, cu_seqlens_q, seq_lens_k, validate)
    slots = slot_mapping if slot_mapping.dtype == torch.int32 else slot_mapping.to(torch.int32)   # held by the call
    return cpu_decode.paged_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens_k, scale, None, sliding_window,
                                       new_kv=(key, value, slots.contiguous()), logit_softcap=logit_softcap,
                                       k_scale=k_scale, v_scale=v_scale, static_scales=static_scales, sinks=sinks)

