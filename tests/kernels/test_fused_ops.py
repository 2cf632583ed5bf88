"""The model's small fused ops: each Triton kernel (``use_triton=True``: the interpreter on CPU) against its
torch reference, the argument checks, the layers' CPU path against their original formulas (bit for
bit), and a tiny decoder run through the fused path against the torch path.

Tolerances: float32 1e-5 (the kernels' sum of squares, ``rsqrt``, ``cos``/``sin`` and ``exp`` come from
another math library or order than torch's: last-bit differences); float16 about one ulp
(rtol 2e-3), though the interpreter usually matches exactly. The interpreter rounds float32 ->
bfloat16 by truncation (the GPU rounds to nearest), so bfloat16 is checked only on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.paged_kv_cases import kernel_device, seed_of
from pagedray import kernels
from pagedray.kernels import fused_ops
from pagedray.workers.kv_cache import KVCache
from pagedray.workers.layers.activation import silu_and_mul as layer_silu_and_mul
from pagedray.workers.layers.norm import RMSNorm
from pagedray.workers.layers.rotary import RotaryEmbedding

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0},
         "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
         "llama3": LLAMA3,
         "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                      "max_position_embeddings": 131072, "short_factor": [1.0 + 0.02 * i for i in range(64)],
                      "long_factor": [1.5 + 0.3 * i for i in range(64)]}}


def _randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _assert_close(got, expected, dtype):
    assert got.dtype == expected.dtype == dtype
    torch.testing.assert_close(got, expected, **TOL[dtype])


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("tokens,size,dtype,with_residual", [
    (1, 72, torch.float32, False), (7, 200, torch.float16, True), (13, 72, torch.float32, True),
    (7, 200, torch.float32, False), (13, 72, torch.float16, False)])
def test_rms_norm_hidden_matches_reference(tokens, size, dtype, with_residual):
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("norm", tokens, size, dtype, with_residual))
    # x as a column slice of a wider buffer: token stride > size
    x = _randn(gen, (tokens, size + 8), dtype, device, 3.0)[:, :size]
    weight = _randn(gen, (size,), dtype, device)
    residual = _randn(gen, (tokens, size), dtype, device, 3.0) if with_residual else None
    x_before = x.clone()
    got = kernels.rms_norm(x, weight, 1e-6, residual, use_triton=True)
    expected = kernels.rms_norm_reference(x, weight, 1e-6, residual)
    if with_residual:
        _assert_close(got[0], expected[0], dtype)
        assert torch.equal(got[1], expected[1])          # one rounded add: exact
    else:
        _assert_close(got, expected, dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("tokens,q_heads,k_heads,head_dim,dtype", [
    (7, 3, 1, 64, torch.float32), (13, 3, 2, 96, torch.float16), (1, 4, 1, 128, torch.float32),
    (7, 3, 1, 128, torch.float16)])
def test_rms_norm_per_head_in_place_on_qkv(tokens, q_heads, k_heads, head_dim, dtype):
    """Qwen3's q/k norm: strided head slices of qkv normalised in place; v and the other slice untouched."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("qknorm", tokens, q_heads, head_dim, dtype))
    qkv = _randn(gen, (tokens, q_heads + 2 * k_heads, head_dim), dtype, device, 2.0)
    q_weight, k_weight = _randn(gen, (head_dim,), dtype, device), _randn(gen, (head_dim,), dtype, device)
    before = qkv.clone()
    q, k = qkv[:, :q_heads], qkv[:, q_heads:q_heads + k_heads]
    assert kernels.rms_norm(q, q_weight, 1e-6, out=q, use_triton=True) is q
    _assert_close(q, kernels.rms_norm_reference(before[:, :q_heads], q_weight, 1e-6), dtype)
    assert torch.equal(qkv[:, q_heads:], before[:, q_heads:])
    kernels.rms_norm(k, k_weight, 1e-6, out=k, use_triton=True)
    _assert_close(k, kernels.rms_norm_reference(before[:, q_heads:q_heads + k_heads], k_weight, 1e-6), dtype)
    assert torch.equal(qkv[:, q_heads + k_heads:], before[:, q_heads + k_heads:])


def test_rms_norm_per_head_new_output_and_empty_batch():
    device = kernel_device()
    gen = torch.Generator().manual_seed(11)
    qkv = _randn(gen, (5, 7, 64), torch.float32, device)
    weight = _randn(gen, (64,), torch.float32, device)
    got = kernels.rms_norm(qkv[:, 1:4], weight, 1e-5, use_triton=True)
    assert got.is_contiguous() and got.shape == (5, 3, 64)
    _assert_close(got, kernels.rms_norm_reference(qkv[:, 1:4], weight, 1e-5), torch.float32)
    empty = torch.empty((0, 64), device=device)
    normed, new_residual = kernels.rms_norm(empty, weight, 1e-5, empty, use_triton=True)
    assert normed.shape == new_residual.shape == (0, 64)


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("tokens,q_heads,k_heads,head_dim,dtype,rope,pos_dtype", [
    (7, 3, 1, 64, torch.float32, "default", torch.int64), (13, 3, 3, 96, torch.float16, "llama3", torch.int32),
    (1, 4, 2, 128, torch.float32, "llama3", torch.int64), (7, 3, 1, 128, torch.float16, "linear", torch.int64),
    (13, 2, 1, 96, torch.float32, "linear", torch.int32), (7, 3, 1, 128, torch.float32, "longrope", torch.int64),
    (5, 2, 2, 128, torch.float16, "longrope", torch.int32)])
def test_rotary_in_place_on_qkv_matches_reference(tokens, q_heads, k_heads, head_dim, dtype, rope, pos_dtype):
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("rope", tokens, q_heads, head_dim, dtype, rope))
    qkv = _randn(gen, (tokens, q_heads + 2 * k_heads, head_dim), dtype, device)
    positions = torch.randint(0, 5000, (tokens,), generator=gen, dtype=pos_dtype).to(device)
    rotary = RotaryEmbedding(head_dim, ROPES[rope], device, max_model_len=8192)   # longrope (D 128): long factors
    inv_freq, scale = rotary.inv_freq, rotary.scale
    assert (scale > 1.0) == (rope == "longrope")
    expected = qkv.clone()
    k_end = q_heads + k_heads
    kernels.rotary_embedding_reference_(expected[:, :q_heads], expected[:, q_heads:k_end], positions, inv_freq, scale)
    v_before = qkv[:, k_end:].clone()
    kernels.rotary_embedding_(qkv[:, :q_heads], qkv[:, q_heads:k_end], positions, inv_freq, scale=scale,
                              use_triton=True)
    _assert_close(qkv[:, :k_end], expected[:, :k_end], dtype)
    assert torch.equal(qkv[:, k_end:], v_before)


def test_rotary_separate_tensors_and_the_reference_is_the_layer_formula():
    """q and k as separate tensors; the reference equals cos_sin + apply_rotary of the torch path."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(21)
    q, k = _randn(gen, (7, 3, 64), torch.float32, device), _randn(gen, (7, 1, 64), torch.float32, device)
    positions = torch.randint(0, 100000, (7,), generator=gen).to(device)
    rotary = RotaryEmbedding(64, LLAMA3, device)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    rotated = kernels.apply_rotary_reference(torch.cat([q, k], dim=1), cos, sin)
    q_ref, k_ref = q.clone(), k.clone()
    kernels.rotary_embedding_reference_(q_ref, k_ref, positions, rotary.inv_freq)
    assert torch.equal(q_ref, rotated[:, :3]) and torch.equal(k_ref, rotated[:, 3:])
    kernels.rotary_embedding_(q, k, positions, rotary.inv_freq, use_triton=True)
    _assert_close(q, q_ref, torch.float32)
    _assert_close(k, k_ref, torch.float32)


# ---------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("tokens,inter,dtype", [(1, 72, torch.float32), (7, 200, torch.float16),
                                                (13, 1100, torch.float32), (7, 1100, torch.float16)])
def test_silu_and_mul_matches_reference(tokens, inter, dtype):
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of("silu", tokens, inter, dtype))
    gate_up = _randn(gen, (tokens, 2 * inter + 6), dtype, device, 4.0)[:, :2 * inter]   # token stride > 2 inter
    got = kernels.silu_and_mul(gate_up, use_triton=True)
    assert got.shape == (tokens, inter)
    _assert_close(got, kernels.silu_and_mul_reference(gate_up), dtype)


# ---------------------------------------------------------------- argument checks

_G = torch.Generator().manual_seed(0)
X = torch.randn((4, 64), generator=_G)
W = torch.randn((64,), generator=_G)
QKV = torch.randn((4, 6, 64), generator=_G)
Q, K = QKV[:, :3], QKV[:, 3:4]
POS = torch.arange(4)
INV = torch.rand((32,), generator=_G)


@pytest.mark.parametrize("call,name", [
    (lambda: kernels.rms_norm(X[0], W, 1e-6), "x"),
    (lambda: kernels.rms_norm(X.int(), W, 1e-6), "x"),
    (lambda: kernels.rms_norm(X.t(), W[:4], 1e-6), "x"),
    (lambda: kernels.rms_norm(X, W.half(), 1e-6), "weight"),
    (lambda: kernels.rms_norm(X, W[:32], 1e-6), "weight"),
    (lambda: kernels.rms_norm(X, W, 0.0), "eps"),
    (lambda: kernels.rms_norm(X, W, float("nan")), "eps"),
    (lambda: kernels.rms_norm(X, W, 1e-6, X[:3]), "residual"),
    (lambda: kernels.rms_norm(X, W, 1e-6, X.half()), "residual"),
    (lambda: kernels.rms_norm(X, W, 1e-6, out=X[:, :32]), "out"),
    (lambda: kernels.rotary_embedding_(Q[0], K, POS, INV), "q"),
    (lambda: kernels.rotary_embedding_(Q[..., :63], K[..., :63], POS, INV), "q"),
    (lambda: kernels.rotary_embedding_(Q, K.half(), POS, INV), "k"),
    (lambda: kernels.rotary_embedding_(Q, K[:3], POS, INV), "k"),
    (lambda: kernels.rotary_embedding_(Q, K[..., :32], POS, INV), "k"),
    (lambda: kernels.rotary_embedding_(Q, K.transpose(0, 2), POS, INV), "k"),
    (lambda: kernels.rotary_embedding_(Q, K, POS.float(), INV), "positions"),
    (lambda: kernels.rotary_embedding_(Q, K, POS[:3], INV), "positions"),
    (lambda: kernels.rotary_embedding_(Q, K, POS, INV.double()), "inv_freq"),
    (lambda: kernels.rotary_embedding_(Q, K, POS, INV[:16]), "inv_freq"),
    (lambda: kernels.silu_and_mul(X[:, :63]), "gate_up"),
    (lambda: kernels.silu_and_mul(QKV), "gate_up"),
    (lambda: kernels.silu_and_mul(X.t()), "gate_up"),
    (lambda: kernels.silu_and_mul(X.long()), "gate_up"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()


# ---------------------------------------------------------------- the layers' CPU path is the old code (op for op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_layers_equal_their_original_formulas(dtype):
    gen = torch.Generator().manual_seed(seed_of("layers", dtype))
    eps = 1e-6
    norm = RMSNorm(72, eps, dtype, torch.device("cpu"))
    norm.weight.copy_(torch.randn((72,), generator=gen))
    x, residual = torch.randn((7, 72), generator=gen).to(dtype), torch.randn((7, 72), generator=gen).to(dtype)

    def old_norm(t, weight):
        t32 = t.float()
        t32 = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * t32.to(t.dtype)

    # the hidden-size norm runs cpu_fused.c: bit for bit in bf16 (and fp16, the reference); in fp32 its
    # sum of squares goes in another order (last bit; test_cpu_fused.py)
    same = torch.equal if dtype != torch.float32 else (lambda a, b: torch.testing.assert_close(a, b, rtol=2 ** -21,
                                                                                                 atol=0) is None)
    assert same(norm(x), old_norm(x, norm.weight))
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual) and same(normed, old_norm(x + residual, norm.weight))
    qkv = torch.randn((7, 5, 24), generator=gen).to(dtype)
    head_norm = RMSNorm(24, eps, dtype, torch.device("cpu"))
    head_norm.weight.copy_(torch.randn((24,), generator=gen))
    assert torch.equal(head_norm(qkv[:, :3]), old_norm(qkv[:, :3], head_norm.weight))

    gate_up = torch.randn((7, 400), generator=gen).to(dtype)
    silu_up = F.silu(gate_up[:, :200]) * gate_up[:, 200:]
    if dtype == torch.float16:   # the torch reference, bit for bit
        assert torch.equal(layer_silu_and_mul(gate_up), silu_up)
    else:                        # cpu_fused.c: its own exp (test_cpu_fused.py)
        torch.testing.assert_close(layer_silu_and_mul(gate_up), silu_up, rtol=2 ** -7 if dtype != torch.float32
                                   else 2 ** -20, atol=1e-30)

    rotary = RotaryEmbedding(24, LLAMA3, torch.device("cpu"))
    positions = torch.randint(0, 3000, (7,), generator=gen, dtype=torch.int32)
    step = rotary.for_step(positions, dtype)
    assert not step.fused
    angles = (positions.float().unsqueeze(-1) * rotary.inv_freq).unsqueeze(1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    x1, x2 = qkv[..., :12], qkv[..., 12:]
    rotate_half = torch.cat((-x2, x1), dim=-1)
    assert torch.equal(step.apply(qkv), qkv * cos + rotate_half * sin)


# ---------------------------------------------------------------- the decoder's fused path


def _tiny_decoder(kind: str):
    from pagedray.workers.models.llama import LlamaForCausalLM
    from pagedray.workers.models.qwen3 import Qwen3ForCausalLM
    from pagedray.workers.tp_group import TPGroup
    from transformers import LlamaConfig, Qwen3Config

    common = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, vocab_size=97,
                  max_position_embeddings=256, rms_norm_eps=1e-6, num_attention_heads=3)
    if kind == "qwen3":   # q/k norm, head_dim 32 != hidden / heads
        config, cls = Qwen3Config(**common, num_key_value_heads=1, head_dim=32), Qwen3ForCausalLM
    else:                 # llama3 rope scaling
        config = LlamaConfig(**common, num_key_value_heads=1, rope_scaling=dict(LLAMA3, rope_theta=10000.0))
        cls = LlamaForCausalLM
    from pagedray.workers.layers.linear import ColumnParallelLinear, RowParallelLinear, allocate_dense

    cpu = torch.device("cpu")
    model = cls(config, TPGroup.single(cpu), torch.float32, cpu, max_model_len=64)
    for layer in model.modules():    # linear weights are allocated by their load, which this model skips
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            allocate_dense(layer)
    gen = torch.Generator().manual_seed(seed_of("decoder", kind))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _counting(launches: dict, name: str, run):
    def counted(*args):
        launches[name] = launches.get(name, 0) + 1
        return run(*args)
    return counted


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_decoder_fused_path_matches_torch_path(kind, monkeypatch):
    """The CUDA code path of the decoder (q/k norm and rotary in place in qkv, fused norms and SiLU), run
    on CPU through the interpreter, against the default torch path."""
    from pagedray.workers.layers.attention import AttentionMetadata

    if kernel_device().type == "cuda":
        pytest.skip("on a GPU the default path is already the fused one")
    model = _tiny_decoder(kind)
    tokens, block_size = 9, 8
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 97, (tokens,), generator=gen, dtype=torch.int32)
    positions = torch.arange(tokens, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens),
                             cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
                             seq_lens_k=torch.tensor([tokens], dtype=torch.int32),
                             block_tables=torch.tensor([[0, 1]], dtype=torch.int32), max_query_len=tokens)
    head_dim = model.layers[0].self_attn.head_dim
    kv_shape = (2, 2, 3, block_size, 1, head_dim)
    with torch.inference_mode():
        expected = model(input_ids, positions, KVCache(torch.zeros(kv_shape)), meta)
        monkeypatch.setattr(fused_ops, "_triton_wanted", lambda use_triton, device: use_triton is not False)
        launches = {}
        for name in ("rms_norm_triton", "rotary_embedding_triton", "silu_and_mul_triton"):
            monkeypatch.setattr(fused_ops, name, _counting(launches, name, getattr(fused_ops, name)))
        assert model.rotary.for_step(positions, torch.float32).fused
        got = model(input_ids, positions, KVCache(torch.zeros(kv_shape)), meta)
    # per layer: two hidden norms (+ q and k norms for Qwen3), one rotary, one SiLU; plus the final norm
    layers = len(model.layers)
    assert launches == {"rms_norm_triton": layers * (4 if kind == "qwen3" else 2) + 1,
                        "rotary_embedding_triton": layers, "silu_and_mul_triton": layers}
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_ops_large_gpu(dtype):
    gen = torch.Generator().manual_seed(17)
    tokens, hidden, q_heads, k_heads, head_dim, inter = 300, 4096, 32, 8, 128, 3000
    x, residual = _randn(gen, (tokens, hidden), dtype, "cuda"), _randn(gen, (tokens, hidden), dtype, "cuda")
    weight = _randn(gen, (hidden,), dtype, "cuda")
    got, got_res = kernels.rms_norm(x, weight, 1e-5, residual)
    want, want_res = kernels.rms_norm(x, weight, 1e-5, residual, use_triton=False)
    _assert_close(got, want, dtype)
    assert torch.equal(got_res, want_res)
    qkv = _randn(gen, (tokens, q_heads + 2 * k_heads, head_dim), dtype, "cuda")
    expected = qkv.clone()
    positions = torch.randint(0, 131072, (tokens,), generator=gen).cuda()
    inv_freq = RotaryEmbedding(head_dim, LLAMA3, torch.device("cuda")).inv_freq
    k_end = q_heads + k_heads
    kernels.rotary_embedding_(expected[:, :q_heads], expected[:, q_heads:k_end], positions, inv_freq, use_triton=False)
    kernels.rotary_embedding_(qkv[:, :q_heads], qkv[:, q_heads:k_end], positions, inv_freq)
    _assert_close(qkv, expected, dtype)
    gate_up = _randn(gen, (tokens, 2 * inter), dtype, "cuda", 4.0)
    _assert_close(kernels.silu_and_mul(gate_up), kernels.silu_and_mul(gate_up, use_triton=False), dtype)
