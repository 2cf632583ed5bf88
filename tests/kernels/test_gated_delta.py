"""The gated delta rule (kernels.gated_delta): the chunked form a prefill uses against the token-by-token
recurrence on random inputs (several block lengths, a non-zero starting state, a length that ends mid-block),
both against a float64 loop, the batched one-step decode against the loop run per sequence, transformers'
own chunked function as an independent check, and argument checks."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels.gated_delta import gated_delta_decode, gated_delta_prefill
from pagedray.kernels.reference.gated_delta import chunked_reference, recurrent_reference

H, DK, DV = 3, 16, 8


def _inputs(gen, tokens: int, dtype=torch.float32):
    q = torch.randn(tokens, H, DK, generator=gen).to(dtype)
    k = torch.randn(tokens, H, DK, generator=gen).to(dtype)
    v = torch.randn(tokens, H, DV, generator=gen).to(dtype)
    g = -torch.rand(tokens, H, generator=gen) * 0.5            # log decays in (-0.5, 0]
    beta = torch.rand(tokens, H, generator=gen)
    return q, k, v, g, beta


def _float64_loop(q, k, v, g, beta, state):
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / DK ** 0.5
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        d = (v[t] - (k[t][:, :, None] * s).sum(1)) * beta[t][:, None]
        s = s + k[t][:, :, None] * d[:, None, :]
        out.append((q[t][:, :, None] * s).sum(1))
    return torch.stack(out), s


@pytest.mark.parametrize("tokens, chunk", [(1, 64), (7, 4), (64, 64), (100, 64), (37, 16)])
def test_chunked_equals_the_recurrence(tokens, chunk):
    gen = torch.Generator().manual_seed(tokens * 100 + chunk)
    inputs = _inputs(gen, tokens)
    start = torch.randn(H, DK, DV, generator=gen)
    want_out, want_state = _float64_loop(*inputs, start)
    s_loop, s_chunk = start.clone(), start.clone()
    loop = recurrent_reference(*inputs, s_loop)
    chunked = chunked_reference(*inputs, s_chunk, chunk)
    for got, state in ((loop, s_loop), (chunked, s_chunk)):
        torch.testing.assert_close(got.double(), want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), want_state, rtol=1e-4, atol=1e-4)
    assert (want_state - start.double()).abs().max() > 0.1            # the state moved: the check can fail


def test_a_prefill_in_pieces_equals_one_prefill():
    gen = torch.Generator().manual_seed(5)
    inputs = _inputs(gen, 50)
    whole_state, parts_state = torch.zeros(H, DK, DV), torch.zeros(H, DK, DV)
    whole = gated_delta_prefill(*inputs, whole_state)
    parts = torch.cat([gated_delta_prefill(*(x[a:b] for x in inputs), parts_state) for a, b in
                       ((0, 13), (13, 14), (14, 50))])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts_state, whole_state, rtol=1e-5, atol=1e-5)


def test_the_batched_decode_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = _inputs(gen, 4)                       # 4 sequences, one token each
    states = torch.randn(4, H, DK, DV, generator=gen)
    alone = [recurrent_reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], states[i].clone())
             for i in range(4)]
    after = [states[i].clone() for i in range(4)]
    for i in range(4):
        recurrent_reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], after[i])
    out = gated_delta_decode(q, k, v, g, beta, states)
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states, torch.stack(after), rtol=1e-6, atol=1e-6)


def test_matches_transformers_chunked_function():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = _inputs(gen, 70)
    start = torch.randn(H, DK, DV, generator=gen)
    want, want_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                    initial_state=start[None].clone(), output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    state = start.clone()
    torch.testing.assert_close(gated_delta_prefill(q, k, v, g, beta, state), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "k": a["k"][:, :, :8]}, "k / v"),
    (lambda a: {**a, "v": a["v"].double()}, "v: expected"),
    (lambda a: {**a, "g": a["g"].double()}, "g: expected float32"),
    (lambda a: {**a, "beta": a["beta"][:2]}, "beta"),
    (lambda a: {**a, "state": torch.zeros(H, DK, DV + 1)}, "state"),
    (lambda a: {**a, "q": a["q"][0]}, "q: expected a 3-d"),
])
def test_bad_arguments_are_value_errors_naming_them(change, match):
    gen = torch.Generator().manual_seed(1)
    args = dict(zip("q k v g beta".split(), _inputs(gen, 3)), state=torch.zeros(H, DK, DV))
    args = change(args)
    before = args["state"].clone()
    with pytest.raises(ValueError, match=match):
        gated_delta_prefill(args["q"], args["k"], args["v"], args["g"], args["beta"], args["state"])
    assert torch.equal(args["state"], before)


@pytest.mark.parametrize("use_triton, chunked", [(False, False), (True, False), (True, True)])
def test_a_steps_sequences_from_their_pool_slots_in_place(use_triton, chunked):
    """gated_delta_varlen (the Triton kernels under the interpreter: recurrent and chunked; and the per-sequence
    references): a prefill chunk continuing a state over two of the chunked kernel's blocks and a part, a fresh
    sequence whose slot holds garbage, two one-token decodes, a padding row of no tokens; the slots not in the
    step are untouched."""
    from pagedray.kernels.gated_delta import gated_delta_varlen
    from pagedray.kernels.triton.gated_delta_triton import CHUNK

    gen = torch.Generator().manual_seed(21 + use_triton + 2 * chunked)
    lengths, slots, fresh = [2 * CHUNK + 5, 3, 1, 0, 1], [4, 0, 2, 3, 5], [False, True, False, False, False]
    q, k, v, g, beta = _inputs(gen, sum(lengths))
    pool = torch.randn(7, H, DK, DV, generator=gen)
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = gated_delta_varlen(q, k, v, g, beta, pool, torch.tensor(slots), cu, torch.tensor(fresh),
                             use_triton=use_triton, chunked=chunked)
    for i, (slot, is_fresh) in enumerate(zip(slots, fresh)):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:
            continue
        start = torch.zeros(H, DK, DV) if is_fresh else before[slot].clone()
        want_out, want_state = _float64_loop(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], start)
        torch.testing.assert_close(out[a:b].double(), want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot].double(), want_state, rtol=1e-4, atol=1e-4)
    for slot in (1, 3, 6):
        assert torch.equal(pool[slot], before[slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_chunked_kernel_on_keys_from_few_directions_and_strong_decays(dtype):
    """The chunked Triton kernel (interpreter) where its triangular inverse is hardest: keys drawn around three
    directions (k_i . k_j near +-1), beta near 1, decays down to -4, head dims not powers of two (padded blocks),
    inputs in ``dtype``: outputs and state against the float64 loop on the same (rounded) inputs."""
    from pagedray.kernels.gated_delta import gated_delta_varlen

    gen = torch.Generator().manual_seed(5 if dtype == torch.float32 else 6)
    tokens, heads, dk, dv = 70, 2, 24, 20
    directions = torch.randn(3, heads, dk, generator=gen)
    k = (directions[torch.randint(0, 3, (tokens,), generator=gen)]
         + 0.05 * torch.randn(tokens, heads, dk, generator=gen)).to(dtype)
    q = torch.randn(tokens, heads, dk, generator=gen).to(dtype)
    v = torch.randn(tokens, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(tokens, heads, generator=gen) * 4
    beta = 0.9 + 0.1 * torch.rand(tokens, heads, generator=gen)
    pool = torch.randn(2, heads, dk, dv, generator=gen)
    start = pool[1].clone()
    out = gated_delta_varlen(q, k, v, g, beta, pool, torch.tensor([1]), torch.tensor([0, tokens], dtype=torch.int32),
                             torch.tensor([False]), use_triton=True, chunked=True)
    qd, kd = (x.double() for x in (q, k))
    qd = qd / (qd.square().sum(-1, keepdim=True) + 1e-6).sqrt() / dk ** 0.5
    kd = kd / (kd.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    s, want = start.double(), []
    for t in range(tokens):
        s = s * g[t].double().exp()[:, None, None]
        d = (v[t].double() - (kd[t][:, :, None] * s).sum(1)) * beta[t].double()[:, None]
        s = s + kd[t][:, :, None] * d[:, None, :]
        want.append((qd[t][:, :, None] * s).sum(1))
    torch.testing.assert_close(out.double(), torch.stack(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[1].double(), s, rtol=1e-4, atol=1e-4)
    assert (s - start.double()).abs().max() > 0.1


def test_varlen_refuses_a_bad_slot_tensor_naming_it():
    from pagedray.kernels.gated_delta import gated_delta_varlen

    q, k, v, g, beta = _inputs(torch.Generator().manual_seed(1), 2)
    with pytest.raises(ValueError, match="slots"):
        gated_delta_varlen(q, k, v, g, beta, torch.zeros(3, H, DK, DV), torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([False, False]))


@pytest.mark.parametrize("use_triton", [False, True])
def test_spans_with_cuts_snapshot_the_state_partway_and_finish_like_varlen(use_triton):
    """gated_delta_spans (Triton under the interpreter, and the references): a sequence cut twice (a snapshot
    mid-chunk and one at its last token), a fresh one cut once over a garbage slot, one without cuts; each cut's
    slot holds the float64 loop's state after that many tokens, outputs and final states are the uncut run's, and
    slots nobody names are untouched."""
    from pagedray.kernels.gated_delta import gated_delta_spans

    gen = torch.Generator().manual_seed(33 + use_triton)
    q, k, v, g, beta = _inputs(gen, 20)
    pool = torch.randn(9, H, DK, DV, generator=gen)
    before = pool.clone()
    spans = [(0, 9, 1, False, ((4, 6), (9, 7))), (9, 16, 0, True, ((3, 8),)), (16, 20, 2, False, ())]
    out = gated_delta_spans(q, k, v, g, beta, pool, spans, use_triton=use_triton)
    for start, end, slot, fresh, cuts in spans:
        first = torch.zeros(H, DK, DV) if fresh else before[slot].clone()
        want_out, want_state = _float64_loop(*(x[start:end] for x in (q, k, v, g, beta)), first)
        torch.testing.assert_close(out[start:end].double(), want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot].double(), want_state, rtol=1e-4, atol=1e-4)
        for offset, target in cuts:
            _, at_cut = _float64_loop(*(x[start:start + offset] for x in (q, k, v, g, beta)), first)
            torch.testing.assert_close(pool[target].double(), at_cut, rtol=1e-4, atol=1e-4)
            assert (at_cut - want_state).abs().max() > 1e-2 or offset == end - start   # a wrong cut would show
    for slot in (3, 4, 5):
        assert torch.equal(pool[slot], before[slot])


def test_spans_refuse_cuts_out_of_order_or_outside_the_tokens():
    from pagedray.kernels.gated_delta import gated_delta_spans

    q, k, v, g, beta = _inputs(torch.Generator().manual_seed(2), 6)
    for cuts in (((4, 3), (2, 4)), ((0, 3),), ((7, 3),)):
        with pytest.raises(ValueError, match="spans: cuts"):
            gated_delta_spans(q, k, v, g, beta, torch.zeros(5, H, DK, DV), [(0, 6, 0, True, cuts)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_the_chunked_kernel_on_cuda_matches_a_float64_loop(dtype, tolerance):
    """Qwen3.5's head dims (128) on CUDA: IEEE products for float32 inputs, TF32 tensor cores for bfloat16 ones
    (``chunked_config``); three sequences of several blocks from random states, outputs and states."""
    from pagedray.kernels.gated_delta import gated_delta_varlen

    gen = torch.Generator().manual_seed(77)
    lengths, heads, dim = [150, 37, 113], 4, 128
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, heads, dim, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    g = -torch.rand(tokens, heads, generator=gen)
    beta = torch.rand(tokens, heads, generator=gen)
    pool = torch.randn(4, heads, dim, dim, generator=gen) * 0.1
    start = pool.clone()
    cu = torch.tensor([0, 150, 187, 300], dtype=torch.int32)
    slots, fresh = torch.tensor([2, 0, 3]), torch.tensor([False, False, False])
    out = gated_delta_varlen(*(x.cuda() for x in (q, k, v, g, beta)), pool_cuda := pool.cuda(), slots.cuda(),
                             cu.cuda(), fresh.cuda(), use_triton=True, chunked=True).cpu()
    for i, slot in enumerate(slots.tolist()):
        a, b = int(cu[i]), int(cu[i + 1])
        qd, kd = (x[a:b].double() for x in (q, k))
        qd = qd / (qd.square().sum(-1, keepdim=True) + 1e-6).sqrt() / dim ** 0.5
        kd = kd / (kd.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        s, want = start[slot].double(), []
        for t in range(b - a):
            s = s * g[a + t].double().exp()[:, None, None]
            d = (v[a + t].double() - (kd[t][:, :, None] * s).sum(1)) * beta[a + t].double()[:, None]
            s = s + kd[t][:, :, None] * d[:, None, :]
            want.append((qd[t][:, :, None] * s).sum(1))
        want = torch.stack(want)
        torch.testing.assert_close(out[a:b].double(), want, rtol=0, atol=tolerance * float(want.abs().max()))
        torch.testing.assert_close(pool_cuda[slot].cpu().double(), s, rtol=0, atol=tolerance * float(s.abs().max()))


@pytest.mark.parametrize("case", ["one key", "underflowing decays"])
def test_the_chunked_kernel_at_the_extremes_of_its_inverse_and_decays(case):
    """The chunked Triton kernel (interpreter) where its triangular inverse is at its worst (every key the same,
    beta 1, no decay: every entry of A is 1 below the diagonal) and where every decay underflows (g = -60): finite,
    and the float64 loop's outputs and state."""
    from pagedray.kernels.gated_delta import gated_delta_varlen

    gen = torch.Generator().manual_seed(3)
    tokens = 70
    q, k, v, g, beta = _inputs(gen, tokens)
    if case == "one key":
        k, g, beta = k[:1].expand(tokens, H, DK).contiguous(), torch.zeros(tokens, H), torch.ones(tokens, H)
    else:
        g = torch.full((tokens, H), -60.0)
    pool = torch.randn(2, H, DK, DV, generator=gen)
    start = pool[0].clone()
    out = gated_delta_varlen(q, k, v, g, beta, pool, torch.tensor([0]), torch.tensor([0, tokens], dtype=torch.int32),
                             torch.tensor([False]), use_triton=True, chunked=True)
    want_out, want_state = _float64_loop(q, k, v, g, beta, start)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[0].double(), want_state, rtol=1e-4, atol=1e-4)
