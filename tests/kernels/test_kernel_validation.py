"""The public wrappers reject bad arguments with a ValueError that starts with the argument's name,
before launching anything (and, for store_kv, before touching the cache)."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels import check_step_metadata, paged_attention, paged_decode, paged_prefill, store_kv

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, Q_HEADS = 8, 16, 2, 64, 4


def _decode_args() -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn((2, Q_HEADS, HEAD_DIM), generator=gen),
        k_cache=torch.randn((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen),
        v_cache=torch.randn((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen),
        block_tables=torch.tensor([[3, 1], [0, 5]], dtype=torch.int32),
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        scale=0.125,
    )


def _prefill_args() -> dict:
    args = _decode_args()
    args["q"] = torch.randn((5, Q_HEADS, HEAD_DIM))
    args["seq_lens_k"] = args.pop("seq_lens")
    args["cu_seqlens_q"] = torch.tensor([0, 3, 5], dtype=torch.int32)
    return args


def _noncontiguous_head_dim(shape) -> torch.Tensor:
    return torch.randn(shape[:-1] + (2 * shape[-1],))[..., ::2]


DECODE_CASES = {
    "q rank": ("q", lambda a: a["q"][0]),
    "q dtype": ("q", lambda a: a["q"].half()),
    "q device": ("q", lambda a: a["q"].to("meta")),
    "q heads not divisible": ("q", lambda a: a["q"][:, :3]),
    "q head_dim": ("q", lambda a: a["q"][:, :, :32]),
    "q strided head_dim": ("q", lambda a: _noncontiguous_head_dim(tuple(a["q"].shape))),
    "k_cache rank": ("k_cache", lambda a: a["k_cache"][0]),
    "k_cache float64": ("k_cache", lambda a: a["k_cache"].double()),
    "k_cache strided head_dim": ("k_cache", lambda a: _noncontiguous_head_dim(tuple(a["k_cache"].shape))),
    "v_cache shape": ("v_cache", lambda a: a["v_cache"][:4]),
    "v_cache dtype": ("v_cache", lambda a: a["v_cache"].half()),
    "block_tables int64": ("block_tables", lambda a: a["block_tables"].long()),
    "block_tables rows": ("block_tables", lambda a: a["block_tables"][:1]),
    "block_tables rank": ("block_tables", lambda a: a["block_tables"][0]),
    "block_tables id out of cache": ("block_tables", lambda a: torch.tensor([[3, NUM_BLOCKS], [0, 5]],
                                                                           dtype=torch.int32)),
    "seq_lens int64": ("seq_lens", lambda a: a["seq_lens"].long()),
    "seq_lens shape": ("seq_lens", lambda a: a["seq_lens"][:1]),
    "seq_lens beyond capacity": ("seq_lens", lambda a: torch.tensor([33, 9], dtype=torch.int32)),
    "seq_lens negative": ("seq_lens", lambda a: torch.tensor([-1, 9], dtype=torch.int32)),
    "scale zero": ("scale", lambda a: 0.0),
    "scale nan": ("scale", lambda a: float("nan")),
    "scale tensor": ("scale", lambda a: torch.tensor(0.1)),
    "alibi shape": ("alibi_slopes", lambda a: torch.ones(KV_HEADS)),
    "alibi dtype": ("alibi_slopes", lambda a: torch.ones(Q_HEADS, dtype=torch.float64)),
    "sliding_window zero": ("sliding_window", lambda a: 0),
    "out shape": ("out", lambda a: torch.empty((2, Q_HEADS, 32))),
    "out dtype": ("out", lambda a: torch.empty((2, Q_HEADS, HEAD_DIM), dtype=torch.float16)),
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_rejects(case):
    name, make_bad = DECODE_CASES[case]
    args = _decode_args()
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=f"^{name}: "):
        paged_decode(**args)


def test_unsupported_head_dims_rejected():
    for head_dim in (20, 8, 520, 1024):
        cache = torch.randn((2, 16, 1, head_dim))
        q = torch.randn((1, 1, head_dim))
        with pytest.raises(ValueError, match="^k_cache: unsupported head_dim"):
            paged_decode(q, cache, cache.clone(), torch.zeros((1, 1), dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), 1.0)


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# case -> (argument named in the error, replacements for the valid prefill arguments)
PREFILL_CASES = {
    "cu int64": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}),
    "cu length": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][:2]}),
    "cu start": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": _i32(1, 3, 5)}),
    "cu end": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": _i32(0, 3, 4)}),
    "cu decreasing": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": _i32(0, 6, 5)}),
    "chunk longer than keys": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": _i32(0, 1, 5),
                                                          "seq_lens_k": _i32(20, 3)}),
    "seq_lens_k int64": ("seq_lens_k", lambda a: {"seq_lens_k": a["seq_lens_k"].long()}),
    "seq_lens_k beyond capacity": ("seq_lens_k", lambda a: {"seq_lens_k": _i32(20, 40)}),
    "q rank": ("q", lambda a: {"q": a["q"][None]}),
}


@pytest.mark.parametrize("entry", [paged_prefill, paged_attention], ids=["prefill", "attention"])
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=list(PREFILL_CASES))
def test_varlen_entries_reject(case, entry):
    name, replacements = PREFILL_CASES[case]
    args = _prefill_args()
    args.update(replacements(args))
    with pytest.raises(ValueError, match=f"^{name}: "):
        entry(**args)


def test_attention_rejects_wrong_max_query_len():
    with pytest.raises(ValueError, match="^max_query_len: "):
        paged_attention(**_prefill_args(), max_query_len=1)
    with pytest.raises(ValueError, match="^max_query_len: "):
        paged_attention(**_prefill_args(), max_query_len=-2)


STORE_CASES = {
    "key heads": ("key", lambda a: a["key"][:, :1]),
    "key dtype": ("key", lambda a: a["key"].half()),
    "value shape": ("value", lambda a: a["value"][:2]),
    "slot float": ("slot_mapping", lambda a: a["slot_mapping"].float()),
    "slot length": ("slot_mapping", lambda a: a["slot_mapping"][:2]),
    "slot outside cache": ("slot_mapping", lambda a: torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE, 1])),
}


@pytest.mark.parametrize("case", list(STORE_CASES), ids=list(STORE_CASES))
def test_store_kv_rejects_without_writing(case):
    name, make_bad = STORE_CASES[case]
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen)
    v_cache = torch.randn((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen)
    args = dict(key=torch.randn((3, KV_HEADS, HEAD_DIM), generator=gen),
                value=torch.randn((3, KV_HEADS, HEAD_DIM), generator=gen),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.tensor([0, 5, 17]))
    args[name] = make_bad(args)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=f"^{name}: "):
        store_kv(**args)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_value_checks_can_be_skipped_explicitly():
    """validate_values=False skips the content checks (what CUDA does by default to avoid a sync);
    the structural checks still run."""
    args = _decode_args()
    args["seq_lens"] = torch.tensor([33, 9], dtype=torch.int32)      # beyond capacity: content check
    paged_decode(**args, validate_values=False)                       # not detected: documented
    args["seq_lens"] = args["seq_lens"].long()                        # structural: always checked
    with pytest.raises(ValueError, match="^seq_lens: "):
        paged_decode(**args, validate_values=False)


def test_valid_arguments_are_accepted():
    """The base arguments the rejection tests mutate are themselves valid (so each rejection is caused
    by its one mutation)."""
    args = _decode_args()
    assert paged_decode(**args).shape == args["q"].shape
    args = _prefill_args()
    assert paged_prefill(**args).shape == args["q"].shape
    assert paged_attention(**_prefill_args(), max_query_len=3).shape == args["q"].shape
    cache = torch.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    key = torch.randn((3, KV_HEADS, HEAD_DIM))
    store_kv(key, key, cache, cache.clone(), torch.tensor([0, 5, 17]))
    assert torch.equal(cache[1, 1], key[2])


def _step_metadata_args() -> dict:
    """A valid step: chunks of 3 and 2 tokens ending at lengths 20 and 9 (tables [3, 1] and [0, 5]):
    positions 17-19 live in block 1 (slots 17-19), positions 7-8 in block 0 (slots 7-8)."""
    args = _prefill_args()
    return dict(k_cache=args["k_cache"], v_cache=args["v_cache"], num_tokens=5,
                slot_mapping=torch.tensor([17, 18, 19, 7, 8]),
                cu_seqlens_q=args["cu_seqlens_q"], seq_lens_k=args["seq_lens_k"],
                block_tables=args["block_tables"], max_query_len=3)


# case -> (argument named in the error, replacements for the valid step metadata)
STEP_METADATA_CASES = {
    "slot outside cache": ("slot_mapping", lambda a: {"slot_mapping": torch.tensor([0, 1, 2, 3, 8 * 16])}),
    "slot count": ("slot_mapping", lambda a: {"num_tokens": 4}),
    "cu end": ("cu_seqlens_q", lambda a: {"cu_seqlens_q": _i32(0, 3, 4)}),
    "seq_lens_k beyond capacity": ("seq_lens_k", lambda a: {"seq_lens_k": _i32(20, 40)}),
    "block id out of cache": ("block_tables", lambda a: {"block_tables": _i32(3, NUM_BLOCKS, 0, 5).view(2, 2)}),
    "max_query_len wrong": ("max_query_len", lambda a: {"max_query_len": 2}),
    "v_cache shape": ("v_cache", lambda a: {"v_cache": a["v_cache"][:4]}),
}


@pytest.mark.parametrize("case", list(STEP_METADATA_CASES), ids=list(STEP_METADATA_CASES))
def test_step_metadata_checked_once_rejects(case):
    """check_step_metadata makes the metadata checks of store_kv + paged_attention in one call."""
    name, replacements = STEP_METADATA_CASES[case]
    args = _step_metadata_args()
    check_step_metadata(**args)                                       # the base step is valid
    args.update(replacements(args))
    with pytest.raises(ValueError, match=f"^{name}: "):
        check_step_metadata(**args)


def test_step_metadata_value_checks_can_be_skipped():
    args = _step_metadata_args()
    args["seq_lens_k"] = _i32(20, 40)                                 # content check only
    check_step_metadata(**args, validate_values=False)
    args["seq_lens_k"] = args["seq_lens_k"].long()                    # structural: always checked
    with pytest.raises(ValueError, match="^seq_lens_k: "):
        check_step_metadata(**args, validate_values=False)
