"""What an H100/H200 would run: compile the Triton kernels for sm_90 on any machine and read the result.

``python -m benchmarks.sm90_report [--json PATH]`` (run without ``TRITON_INTERPRET``; under the
interpreter the kernels are not compilable objects). No GPU is needed: Triton's ahead-of-time compiler and the
``ptxas``/``cuobjdump`` shipped in its wheel give, per kernel variant, the registers per thread, the bytes
spilled (``spill B``: the stack frame plus local memory, where registers spill under a ``maxnreg`` cap;
libdevice's sin / cos also keep a small local array there), the shared memory, the programs per SM those allow,
and a census of the SASS: which tensor-core instruction does the products (``HGMMA`` = Hopper wgmma, ``HMMA`` =
mma.sync) and how many global loads are 128-bit wide (``LDGSTS...128`` = pipelined cp.async, ``LDG.E.128``).
``loop``: the instructions of the kernel's longest loop (one trip, one warp); for decode ``per key``: that times
the warps over the keys a trip covers, the warp instructions a program issues per key. A compile fact, not a
speed: on an H200 (docs/gpu.md, batch 64, 8k) the 128-key 8-bit decodes took 1.28x (int8) and 1.12x (fp8) the
bf16 decode's time where this count was 1.20x and 1.14x bf16's, but 32-key 8-bit tiles, at 1.5x the count of the
128-key ones and 5 programs per SM instead of 3, ran about as fast as them, and 64-key tiles slower than both.

Arguments are specialised as the JIT specialises them at launch for the benchmark shapes: every pointer
16-byte aligned, strides and ``head_dim`` divisible by 16 (not ``group_size``, the table stride or the
lengths). The launch constants come from ``decode_config``/``prefill_config``, so this reports the code
the wrappers launch. These are compiler facts, not timings: ``benchmarks.kernels`` measures.

Occupancy model (sm_90, ``kernels.occupancy.programs_per_sm``, which the decode launcher also uses on a GPU): 64
warps, 65,536 registers (allocated per warp in units of 256) and 228 KiB of shared memory per SM, of which each
program reserves 1 KiB beyond its own; at most 32 programs.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import triton
from pagedray.kernels.triton import (
    activation_triton,
    decode_triton,
    gated_delta_triton,
    moe_triton,
    norm_triton,
    prefill_triton,
    quant_gemm_triton,
    rotary_triton,
    seeded_uniform_triton,
    store_kv_triton,
)
from pagedray.kernels.triton.occupancy import programs_per_sm
from triton import compiler
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
INT_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_q_ptr", "rows_ptr", "experts_ptr"}
FP32_POINTERS = {"alibi_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr", "inv_freq_ptr", "sinks_ptr"}
INT64_POINTERS = {"slot_ptr", "keys_ptr", "pos_ptr"}
FP32_SCALARS = {"scale_log2", "eps", "scale", "softcap", "k_static", "v_static"}
NOT_DIVISIBLE = {"group_size", "stride_bt", "sliding_window", "num_splits", "num_seqs", "block_size", "num_heads",
                 "top_k", "num_rows", "stride_ss", "M"}
KV8 = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16"}   # 8-bit KV
DATA_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bin_dir() -> pathlib.Path:
    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sm90(kernel, data_type: str, constexprs: dict, pointers: dict | None = None, **options):
    """AOT-compile ``kernel`` for sm_90 with JIT-like specialisation -> triton ``CompiledKernel``; ``pointers``
    names pointer arguments of another type than the name rules give; constexprs not given take their
    defaults."""
    signature, attrs = {}, {}
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in (pointers or {}):
            signature[name] = pointers[name]
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in INT64_POINTERS:
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*" + data_type
        else:
            signature[name] = "fp32" if name in FP32_SCALARS else "i32"
        if name.endswith("_ptr") or (signature[name] == "i32" and name not in NOT_DIVISIBLE):
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = compiler.ASTSource(kernel, signature, constexprs, attrs)
    return compiler.compile(source, target=TARGET, options=options)


def inspect_cubin(cubin: bytes) -> dict:
    """Registers, spilled bytes (stack frame + local memory), the local-memory loads and stores in the code, and
    an opcode census of one cubin via ``cuobjdump``."""
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = str(_bin_dir() / "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage[:500]}")
    opcodes = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    return dict(registers=int(found.group(1)), spill_bytes=int(found.group(2)) + int(found.group(3)),
                spill_ops=sum(n for op, n in opcodes.items() if op.startswith(("LDL", "STL"))), opcodes=opcodes,
                loop_instructions=loop_instructions(sass))


def loop_instructions(sass: str) -> int:
    """Instructions in the longest loop of a SASS listing (from a backward branch's target to the branch), 0
    without one: per warp and per trip, the count the main loop issues (a branch inside it may skip some)."""
    addresses = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,})\*/\s+\S", sass)]
    spans = [(int(target, 16), int(at, 16))
             for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\S*\s+0x([0-9a-f]+)", sass)
             if int(target, 16) < int(at, 16)]
    if not spans:
        return 0
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return sum(start <= a <= end for a in addresses)


def _launch_options(cfg: dict) -> tuple[dict, dict]:
    """A launcher's config -> (constexprs, compile options ``num_warps``/``num_stages``/``maxnreg``)."""
    options = {key: cfg[key] for key in ("num_warps", "num_stages", "maxnreg") if key in cfg}
    constants = {key: value for key, value in cfg.items() if key not in options}
    return constants, {key: value for key, value in options.items() if value is not None}   # None: no cap


def variants() -> dict[str, tuple]:
    """name -> (kernel, data type, constexprs, options): the launches of the benchmark (head_dim 128,
    block size 16, 32 q / 8 KV heads) plus the other code paths (split, ALiBi, window, fp32, MQA)."""
    out = {}
    for data_type, split, alibi, window in (("bf16", False, False, False), ("fp16", False, False, False),
                                            ("bf16", True, True, True), ("fp32", True, False, True)):
        cfg, options = _launch_options(decode_triton.decode_config(128, 4))
        consts = dict(BLOCK_SIZE=16, HAS_ALIBI=alibi, HAS_WINDOW=window, SPLIT=split,
                      IEEE=data_type == "fp32", HAS_SOFTCAP=split, QUANT=False, **cfg)   # split also soft-caps
        name = f"decode {data_type}" + (" split+alibi+window" if split else "")
        out[name] = (decode_triton._decode_kernel, data_type, consts, options)
    cfg, options = _launch_options(decode_triton.decode_config(128, 32))     # 32 query heads on one KV head
    out["decode bf16 group 32 split"] = (decode_triton._decode_kernel, "bf16",
                                         dict(BLOCK_SIZE=16, HAS_ALIBI=False, HAS_WINDOW=False, SPLIT=True, IEEE=False,
                                              HAS_SOFTCAP=False, QUANT=False, **cfg), options)
    cfg, options = _launch_options(decode_triton.decode_config(128, 4, quantized=True, fast_codes=True))
    consts = dict(BLOCK_SIZE=16, HAS_ALIBI=False, HAS_WINDOW=False, SPLIT=False, IEEE=False, HAS_SOFTCAP=False,
                  QUANT=True, **cfg)
    out["decode bf16 over int8 KV"] = (decode_triton._decode_kernel, "bf16", consts, options, KV8)
    out["decode bf16 over fp8 KV"] = (decode_triton._decode_kernel, "bf16", consts, options,
                                      {**KV8, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"})
    fp8 = {**KV8, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    out["decode bf16 over int8 KV, f16 math"] = (decode_triton._decode_kernel, "bf16", {**consts, "F16_MATH": True},
                                                 options, KV8)
    out["decode bf16 over fp8 KV, f16 math"] = (decode_triton._decode_kernel, "bf16", {**consts, "F16_MATH": True},
                                                options, fp8)
    out["split reduce bf16"] = (decode_triton._reduce_splits_kernel, "bf16", dict(BLOCK_S=32, BLOCK_D=128),
                                dict(num_warps=4))
    for data_type, group, alibi, window in (("bf16", 4, False, False), ("fp16", 4, False, False),
                                            ("bf16", 1, True, True), ("fp32", 3, True, False)):
        cfg, options = _launch_options(prefill_triton.prefill_config(128, group, DATA_TYPES[data_type], on_gpu=True))
        consts = dict(BLOCK_SIZE=16, HAS_ALIBI=alibi, HAS_WINDOW=window, IEEE=data_type == "fp32",
                      HAS_SOFTCAP=alibi, QUANT=False, **cfg)   # the ALiBi variants also soft-cap
        name = f"prefill {data_type} group {group}" + (" alibi+window" if alibi else "")
        out[name] = (prefill_triton._prefill_kernel, data_type, consts, options)
    cfg, options = _launch_options(prefill_triton.prefill_config(128, 4, torch.bfloat16, on_gpu=True))
    consts = dict(BLOCK_SIZE=16, HAS_ALIBI=False, HAS_WINDOW=False, IEEE=False, HAS_SOFTCAP=False, QUANT=True,
                  SCALE_ROWS=True, **cfg)                        # bf16 queries: rows dequantized before the products
    out["prefill bf16 group 4 over int8 KV"] = (prefill_triton._prefill_kernel, "bf16", consts, options, KV8)
    store_cfg, store_options = _launch_options(store_kv_triton.store_kv_config(8, 128))
    limits = dict(SMIN=store_kv_triton.SCALE_MIN, SMAX=store_kv_triton.SCALE_MAX)
    out["store_kv bf16"] = (store_kv_triton._store_kv_kernel, "bf16",
                            dict(QUANT=0, QMAX_=1.0, STATIC=False, **limits, **store_cfg), store_options)
    for name, quant, qmax, code in (("store_kv bf16 -> int8", 1, 127.0, "*i8"),
                                    ("store_kv bf16 -> fp8", 2, 448.0, "*fp8e4nv")):
        out[name] = (store_kv_triton._store_kv_kernel, "bf16",
                     dict(QUANT=quant, QMAX_=qmax, STATIC=False, **limits, **store_cfg),
                     store_options, {**KV8, "k_cache_ptr": code, "v_cache_ptr": code})
    packed = {"qw_ptr": "*i32", "zeros_ptr": "*i32", "scales_ptr": "*fp16", "gidx_ptr": "*i32"}
    for rows, float8 in ((1, False), (64, False), (1, True)):   # tiled at decode sizes, dequantizing above
        cfg = quant_gemm_triton.quant_gemm_config(rows, 4096, 4096, 128, 8 if float8 else 4, torch.device("cpu"))
        dense = cfg.pop("dense")
        cfg.pop("SPLIT_K", None)
        cfg, options = _launch_options(cfg)
        if dense:
            out["quant gemm 4-bit dequantize bf16"] = (quant_gemm_triton._dequant_kernel, "bf16",
                                                       dict(BITS=4, FLOAT8=False, **cfg), options, packed)
        else:
            name = "quant gemm fp8 bf16 decode" if float8 else "quant gemm 4-bit bf16 decode"
            out[name] = (quant_gemm_triton._quant_gemm_kernel, "bf16",
                         dict(BITS=8 if float8 else 4, IEEE=False, HAS_PERM=not float8, FLOAT8=float8, **cfg),
                         options, {**packed, "perm_ptr": "*i32", "scales_ptr": "*fp32" if float8 else "*fp16"})
    # the element-wise kernels of the model and the sampler: the same wrapper configs at Qwen3-0.6B sizes
    for name, kernel, data_type, cfg in (
            ("silu_and_mul bf16", activation_triton._silu_and_mul_kernel, "bf16",
             activation_triton.silu_and_mul_config(3072)),
            ("rms_norm bf16", norm_triton._rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True,
                                                                          **norm_triton.norm_config(1, 1024))),
            ("rotary bf16", rotary_triton._rotary_kernel, "bf16", rotary_triton.rotary_config(16, 128)),
            ("seeded uniform", seeded_uniform_triton._seeded_uniform_kernel, "fp32", dict(BLOCK=1024,
                                                                                          num_warps=4))):
        consts, options = _launch_options(cfg)
        out[name] = (kernel, data_type, consts, options)
    out["rotary bf16"][3]["enable_fp_fusion"] = False      # as rotary_embedding_triton launches it
    for name, by_token, mul in (("fused moe gate_up bf16", True, False), ("fused moe down bf16", False, True)):
        consts, options = _launch_options(dict(A_BY_TOKEN=by_token, MUL_WEIGHT=mul, IEEE=False,
                                               **moe_triton.moe_config(256)))
        out[name] = (moe_triton._grouped_gemm_kernel, "bf16", consts, options)
    for tokens in (1, 256, 4096):             # the packed experts' three launch forms (moe_config)
        cfg = moe_triton.moe_config(tokens, packed=True)
        consts = dict(BITS=4, FLOAT8=False, GROUPED=True, A_BY_TOKEN=True, MUL_WEIGHT=False, IEEE=False,
                      WIDE=cfg["WIDE"], LOG2_PER_WORD=3, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=16)
        out[f"fused moe packed 4-bit bf16, {tokens} tok"] = (
            moe_triton._grouped_packed_gemm_kernel, "bf16", consts, dict(num_warps=cfg["num_warps"]), packed)
        out[f"fused moe packed mxfp4 bf16, {tokens} tok"] = (      # gpt-oss: e2m1 codes, float32 scales
            moe_triton._grouped_packed_gemm_kernel, "bf16", {**consts, "FLOAT8": 2}, dict(num_warps=cfg["num_warps"]),
            {**packed, "scales_ptr": "*fp32"})
    delta = {"g_ptr": "*fp32", "beta_ptr": "*fp32", "out_ptr": "*fp32", "pool_ptr": "*fp32", "slots_ptr": "*i64",
             "cu_ptr": "*i32", "fresh_ptr": "*i8"}           # Qwen3.5's head dims (128), as the launcher sets them
    out["gated delta recurrent bf16"] = (gated_delta_triton._gated_delta_kernel, "bf16",
                                         dict(BLOCK_K=128, BLOCK_V=32), dict(num_warps=4), delta)
    for data_type in ("bf16", "fp32"):                        # TF32 tensor cores, and IEEE products for fp32
        cfg, options = _launch_options(gated_delta_triton.chunked_config(128, DATA_TYPES[data_type]))
        out[f"gated delta chunked {data_type}"] = (gated_delta_triton._gated_delta_chunked_kernel, data_type,
                                                   dict(CHUNK_T=gated_delta_triton.CHUNK, BLOCK_K=128, **cfg),
                                                   options, delta)
    return out


class _Probed(Exception):
    """Raised by the stand-in split choice: the launcher's probe is done, its launch is not to be made."""


def launcher_split_probe(batch: int = 64, context: int = 8192, num_sms: int = 132) -> dict:
    """What ``paged_decode_triton`` computes for an 8-bit (fp8) cache on an H100 / H200 at ``batch`` x ``context``
    (head_dim 128, 32 query / 8 KV heads, its CUDA bf16 configuration): its own probe compiles the split kernel
    (``_decode_kernel.warmup``) and counts the programs an SM holds, then ``choose_num_splits`` picks the split
    count. Run here through a stand-in driver for an sm_90 device, with the registers read from the cubin
    (a GPU reports them when it loads the binary); the launch itself is not made."""
    from pagedray.kernels.triton import decode_triton as dt

    fake_driver = type("Sm90Driver", (), dict(get_current_device=lambda self: 0,
                                                get_current_stream=lambda self, device: 0,
                                                get_current_target=lambda self: TARGET))()
    seen = {}

    def count(compiled, num_warps, device):
        seen["registers"] = inspect_cubin(compiled.asm["cubin"])["registers"]
        seen["shared_bytes"] = compiled.metadata.shared
        return programs_per_sm(seen["registers"], seen["shared_bytes"], num_warps)

    def choose(num_seqs, num_kv_heads, max_context, sms, per_sm=None):
        seen["programs_per_sm"] = per_sm
        seen["num_splits"] = choose_num_splits(num_seqs, num_kv_heads, max_context, sms, per_sm)
        raise _Probed

    choose_num_splits = dt.choose_num_splits
    patches = dict(_fills_waves=lambda q, k_scale: True, sm_count=lambda device: num_sms, resident_programs=count,
                   choose_num_splits=choose, _PROGRAMS_PER_SM={})
    saved = {name: getattr(dt, name) for name in patches}
    saved_driver = triton.runtime.driver._active
    q = torch.zeros(batch, 32, 128, dtype=torch.bfloat16)
    codes = torch.zeros(1, 16, 8, 128, dtype=torch.float8_e4m3fn)
    scales = torch.ones(1, 16, 8, dtype=torch.float16)
    tables = torch.zeros(batch, context // 16, dtype=torch.int32)
    try:
        triton.runtime.driver._active = fake_driver
        for name, value in patches.items():
            setattr(dt, name, value)
        dt.paged_decode_triton(q, codes, codes, tables, torch.full((batch,), context, dtype=torch.int32), 0.088,
                               config=dt.decode_config(128, 4, quantized=True, fast_codes=True), k_scale=scales,
                               v_scale=scales)
    except _Probed:
        pass
    finally:
        triton.runtime.driver._active = saved_driver
        for name, value in saved.items():
            setattr(dt, name, value)
    return dict(batch=batch, context=context, num_sms=num_sms, **seen)


def kv8_candidate_variants() -> dict[str, tuple]:
    """name -> variant for each of ``benchmarks.kv8_goal``'s 8-bit decode candidates over an int8 and an fp8
    cache: the launcher's CUDA bf16 configuration with the candidate's overrides, split as it would launch at
    the goal shape (a forced single split compiles the kernel without the split path)."""
    from benchmarks.kv8_goal import CANDIDATES

    out = {}
    for code in ("int8", "fp8"):
        pointers = KV8 if code == "int8" else {**KV8, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
        for name, overrides, splits in CANDIDATES:
            cfg, options = _launch_options({**decode_triton.decode_config(128, 4, quantized=True, fast_codes=True),
                                            **(overrides or {})})
            consts = dict(BLOCK_SIZE=16, HAS_ALIBI=False, HAS_WINDOW=False, SPLIT=splits != 1, IEEE=False,
                          HAS_SOFTCAP=False, QUANT=True, **cfg)
            out[f"{code}: {name}"] = (decode_triton._decode_kernel, "bf16", consts, options, pointers)
    return out


def report_row(name: str, kernel, data_type: str, constexprs: dict, options: dict,
               pointers: dict | None = None) -> dict:
    compiled = compile_sm90(kernel, data_type, constexprs, pointers, **options)
    facts = inspect_cubin(compiled.asm["cubin"])
    ops = facts.pop("opcodes")
    num_warps = options.get("num_warps", 4)
    return dict(
        name=name, num_warps=num_warps, num_stages=options.get("num_stages"), shared_bytes=compiled.metadata.shared,
        **facts, programs_per_sm=programs_per_sm(facts["registers"], compiled.metadata.shared, num_warps),
        hgmma=sum(n for op, n in ops.items() if op.startswith("HGMMA")),
        hmma=sum(n for op, n in ops.items() if op.startswith("HMMA")),
        wide_loads=sum(n for op, n in ops.items() if op.startswith(("LDG", "LDGSTS")) and op.endswith(".128")),
        narrow_loads=sum(n for op, n in ops.items() if op.startswith(("LDG.", "LDGSTS.")) and not op.endswith(".128")),
        wide_stores=sum(n for op, n in ops.items() if op.startswith("STG") and op.endswith(".128")),
        byte_shared_loads=sum(n for op, n in ops.items() if op in ("LDS.U8", "LDS.S8")),
        instructions_per_key=(round(facts["loop_instructions"] * num_warps / constexprs["BLOCK_N"], 1)
                              if kernel is decode_triton._decode_kernel else None),
    )


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel (sm_90)':38} {'warps':>5} {'stages':>6} {'regs':>4} {'spill B':>7} {'smem KiB':>8} "
          f"{'prog/SM':>7} {'HGMMA':>5} {'HMMA':>4} {'ld128':>5} {'ld<128':>6} {'st128':>5} {'lds8':>4} "
          f"{'loop':>5} {'per key':>7}")
    for r in rows:
        print(f"{r['name']:38} {r['num_warps']:>5} {str(r['num_stages'] or '-'):>6} {r['registers']:>4} "
              f"{r['spill_bytes']:>7} {r['shared_bytes'] / 1024:>8.1f} {r['programs_per_sm']:>7} {r['hgmma']:>5} "
              f"{r['hmma']:>4} {r['wide_loads']:>5} {r['narrow_loads']:>6} {r['wide_stores']:>5} "
              f"{r['byte_shared_loads']:>4} {r['loop_instructions']:>5} {r['instructions_per_key'] or '-':>7}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--kv8-candidates", action="store_true",
                        help="only benchmarks.kv8_goal's 8-bit decode candidates (int8 and fp8 caches)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1 (interpreted kernels cannot be compiled)")
    chosen = kv8_candidate_variants() if args.kv8_candidates else variants()
    rows = [report_row(name, *variant) for name, variant in chosen.items()]
    print_table(rows)
    probe = launcher_split_probe()
    print(f"decode launcher, fp8 cache, batch {probe['batch']} x {probe['context']} on {probe['num_sms']} SMs: "
          f"{probe.get('programs_per_sm')} programs per SM ({probe.get('registers')} registers, "
          f"{probe.get('shared_bytes', 0) / 1024:.1f} KiB), {probe.get('num_splits')} splits")
    if args.json:
        report = dict(triton=triton.__version__, target="sm_90", date=datetime.date.today().isoformat(), rows=rows,
                      launcher_split_probe=probe)
        args.json.write_text(json.dumps(report, indent=2))
    return rows


if __name__ == "__main__":
    main()
