"""Compile the Triton kernels for a CUDA target (sm_90) without a GPU: the interpreter accepts code that
the real compiler rejects (types, constexpr use, loop-carried values), so this catches GPU-only
front-end and code-generation errors on CPU CI. Uses Triton's ahead-of-time ``triton.compile``.

Run by ``test_cuda_compile.py`` in a subprocess without ``TRITON_INTERPRET`` (under the interpreter the
kernels are not compilable objects). Prints one line per variant: ``OK name`` or ``FAIL name: error``.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
from pagedray.kernels import decode_triton, prefill_triton, store_kv_triton  # noqa: E402
from triton import compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)

INT_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_q_ptr"}
FP32_POINTERS = {"alibi_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr"}


def _compile(kernel, data_type: str, constexprs: dict, **options):
    """Signature: pointers to ``data_type`` except index/fp32 work pointers, fp32 scale, i32 ints."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name == "slot_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*" + data_type
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    source = compiler.ASTSource(kernel, signature, constexprs)
    return compiler.compile(source, target=TARGET, options=options)



def variants():
    """name -> zero-argument callable returning the compiled kernel."""
    out = {}
    for data_type, split, alibi, window in (("bf16", True, True, True), ("fp16", False, False, False),
                                            ("fp32", True, False, True)):
        consts = dict(BLOCK_SIZE=16, HAS_ALIBI=alibi, HAS_WINDOW=window, SPLIT=split,
                      IEEE=data_type == "fp32", BLOCK_G=16, BLOCK_N=64, BLOCK_D=128)
        out[f"decode-{data_type}-split{split}-alibi{alibi}-window{window}"] = (
            lambda d=data_type, c=consts: _compile(decode_triton._decode_kernel, d, c, num_warps=4))
    out["reduce-bf16"] = lambda: _compile(decode_triton._reduce_splits_kernel, "bf16",
                                          dict(BLOCK_S=32, BLOCK_D=128))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for data_type, alibi, window, group in (("bf16", True, False, 4), ("fp16", False, True, 1),
                                            ("fp32", True, True, 3)):
        cfg = prefill_triton.prefill_config(128, group, dtypes[data_type], on_gpu=True)
        options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        consts = dict(BLOCK_SIZE=16, HAS_ALIBI=alibi, HAS_WINDOW=window, IEEE=data_type == "fp32", **cfg)
        out[f"prefill-{data_type}-alibi{alibi}-window{window}-group{group}"] = (
            lambda d=data_type, c=consts, o=options: _compile(prefill_triton._prefill_kernel, d, c, **o))
    out["store_kv-bf16"] = lambda: _compile(store_kv_triton._store_kv_kernel, "bf16", dict(BLOCK_D=128))
    return out


def main() -> int:
    failed = 0
    for name, build in variants().items():
        try:
            kernel = build()
            ok = bool(kernel.asm.get("cubin"))
            print(f"{'OK' if ok else 'FAIL'} {name}" + ("" if ok else ": empty cubin"))
            failed += not ok
        except Exception as exc:  # report every variant, not just the first failure
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
