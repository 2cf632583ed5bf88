"""pagedray.kernels: paged KV-cache attention (Triton on CUDA; on CPU a compiled decode kernel and torch references).

Cache layout: per layer ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``,
head_dim contiguous; slot of position ``p`` = ``block_table[p // block_size] * block_size + p % block_size``.

``store_kv``, ``paged_decode``, ``paged_prefill``, ``paged_attention`` and ``store_kv_and_attend`` (the
first then the fourth; one C call for a CPU decode step) validate their arguments
(``ValueError`` naming the argument) and dispatch; the ``*_reference`` functions take the same arguments,
skip validation and compute in float32 with torch (the test oracle, and the CPU path of prefill chunks).
CPU decode rows (float32 / bfloat16) run ``cpu_decode.c``, built with the machine's C compiler on first
use (``cpu_decode.py``: reads K/V straight from the paged cache; the reference where no compiler is).
``check_step_metadata`` runs the metadata checks once for callers that reuse one step's metadata in
every layer (they then pass ``validate_values=False`` per call); ``check_host_step_metadata`` does
the same on CPU metadata for a cache on any device (the check before the host-to-device copy).
The model's small ops (``fused_ops``): ``rms_norm`` (optional fused residual add, also per head on a
strided q/k view), ``rotary_embedding_`` (in place on q and k), ``apply_rotary`` (CPU: a rotated copy),
``silu_and_mul`` and ``fused_moe`` (mixture-of-experts over the picked experts: ``moe_triton``'s grouped
GEMMs on CUDA, a torch loop over experts elsewhere; optional expert biases, and gpt-oss's ``ClampedSwiglu``
as the activation), dispatched the same way (on CPU, RMSNorm and
``apply_rotary`` are one C call each, ``cpu_fused.c``); their ``*_reference`` twins (``reference.fused``) are
the model layers' exact torch code.
``quant_gemm`` (``quant_gemm``): x @ W^T over GPTQ-packed 4 / 8-bit weights (Triton on CUDA, dequantize and
multiply elsewhere).
``gated_delta_prefill`` / ``gated_delta_decode`` (``gated_delta``): the gated delta rule of linear-attention
layers (Qwen3.5's Gated DeltaNet), chunked for a sequence's prefill, one step for a batch of decodes (torch on
every device; ``reference.gated_delta`` the math).
``seeded_uniform(keys, vocab)`` (``seeded_uniform``): the Sampler's noise for seeded rows, a counter-based
hash of (key, column) for a whole batch in one call; ``noise_keys`` derives the keys from (seed, position).
Rooms (tests/test_layers.py): this surface (``api``, ``fused_ops``, ``quant_gemm``, ``seeded_uniform``,
``gated_delta``) on
top; ``triton/`` (the CUDA kernels), ``cpu/`` (the C sources, their loaders and the timed choices) and
``reference/`` (the torch references) below it, standing only on ``validation`` and ``kv_quant``.
Benchmarks (from a checkout): ``python -m benchmarks.kernels`` (CUDA; ``--dry-run`` checks the plumbing on CPU)
and ``python -m benchmarks.kernel_reference`` (CPU timing of the references against dense SDPA).
"""

import sys

if __name__ == "kernels":
    # Imported as the top-level `kernels` (the checkout's root is on sys.path): Hugging Face's `kernels`,
    # which transformers imports, owns that name; shadowed_name.py hands it over.
    from .shadowed_name import hand_over_to_installed_kernels

    hand_over_to_installed_kernels(__file__)
    del hand_over_to_installed_kernels
    sys.modules.pop("kernels.shadowed_name", None)
else:
    from .api import (
        check_host_step_metadata,
        check_step_metadata,
        paged_attention,
        paged_decode,
        paged_prefill,
        store_kv,
        store_kv_and_attend,
    )
    from .fused_ops import apply_rotary, fused_moe, fused_triton_path, rms_norm, rotary_embedding_, silu_and_mul
    from .quant_gemm import quant_gemm, quant_gemm_reference
    from .reference.attention import (
        paged_attention_reference,
        paged_decode_reference,
        paged_prefill_reference,
        store_kv_reference,
    )
    from .reference.fused import (
        ClampedSwiglu,
        apply_rotary_reference,
        fused_moe_reference,
        rms_norm_reference,
        rotary_cos_sin,
        rotary_embedding_reference_,
        silu_and_mul_reference,
    )
    from .seeded_uniform import noise_keys, seeded_uniform, seeded_uniform_reference

    __all__ = [
        "check_step_metadata",
        "check_host_step_metadata",
        "store_kv",
        "store_kv_and_attend",
        "paged_decode",
        "paged_prefill",
        "paged_attention",
        "store_kv_reference",
        "paged_decode_reference",
        "paged_prefill_reference",
        "paged_attention_reference",
        "fused_triton_path",
        "rms_norm",
        "rotary_embedding_",
        "apply_rotary",
        "silu_and_mul",
        "fused_moe",
        "fused_moe_reference",
        "ClampedSwiglu",
        "rms_norm_reference",
        "rotary_cos_sin",
        "apply_rotary_reference",
        "rotary_embedding_reference_",
        "silu_and_mul_reference",
        "quant_gemm",
        "quant_gemm_reference",
        "noise_keys",
        "seeded_uniform",
        "seeded_uniform_reference",
    ]
