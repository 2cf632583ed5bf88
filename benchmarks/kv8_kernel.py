"""8-bit KV cache on the GPU: paged decode reading int8 / fp8 rows against the same decode over a bf16 cache.

    python -m benchmarks.kv8_kernel [--dry-run] [--out PATH]

The same shapes as ``benchmarks.kernels`` (32 query / 8 KV heads, head_dim 128, block 16, shuffled
blocks, bf16 queries) at batch {8, 64, 256} x context {2k, 8k, 32k}; each 8-bit cache holds the bf16
cache's rows quantized by ``kernels.store_kv`` (one float16 scale per row). Per configuration: ms per
decode call (``triton.testing.do_bench`` median), sequences x tokens per second of it, the speed-up over
bf16 and the bytes read per second (codes + scales + q and out); rows named ``<cache>+f16`` run the same
cache under the kernel's ``F16_MATH`` (off by default). Goal (issue #37): >= 1.6x bf16 at batch 64, ctx 8k.
Each 8-bit configuration is first checked against the torch reference on a small slice. A prefill row (one
4k chunk over a 4k history) shows what the dequantizing loads cost there. ``--dry-run``: tiny shapes on CPU
through the Triton interpreter (float16 queries), numbers meaningless.
"""

from __future__ import annotations

import math
import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, check_close, paged_kv_case, time_ms, write_report

FULL = dict(batches=(8, 64, 256), contexts=(2048, 8192, 32768), q_heads=32, kv_heads=8, head_dim=128,
            block_size=16, dtype="bfloat16", cache_dtypes=("int8", "fp8_e4m3"), prefill=(4096, 4096))
DRY = dict(batches=(2,), contexts=(70,), q_heads=4, kv_heads=2, head_dim=32, block_size=16, dtype="float16",
           cache_dtypes=("int8", "fp8_e4m3"), prefill=(20, 30))
F16_MATH = "+f16"   # a row name's suffix: the same cache under the decode kernel's F16_MATH (off by default)


def quantized_copy(k_cache, v_cache, cache_dtype: torch.dtype):
    """The rows of a full-precision cache stored into an 8-bit one -> (k8, v8, k_scale, v_scale)."""
    from pagedray import kernels

    shape = k_cache.shape
    k8 = torch.empty(shape, dtype=cache_dtype, device=k_cache.device)
    v8 = torch.empty_like(k8)
    k_scale = torch.empty(shape[:3], dtype=torch.float16, device=k_cache.device)
    v_scale = torch.empty_like(k_scale)
    slots = torch.arange(shape[0] * shape[1], dtype=torch.int32, device=k_cache.device)
    rows = (shape[0] * shape[1], shape[2], shape[3])
    kernels.store_kv(k_cache.reshape(rows), v_cache.reshape(rows), k8, v8, slots, k_scale=k_scale, v_scale=v_scale,
                     use_triton=True)
    return k8, v8, k_scale, v_scale


def read_bytes(batch: int, context: int, cfg: dict, cache_dtype: torch.dtype, q: torch.Tensor) -> int:
    rows = 2 * batch * context * cfg["kv_heads"]
    per_row = cfg["head_dim"] * torch.empty((), dtype=cache_dtype).element_size()
    from pagedray.kernels.kv_quant import is_quantized

    scales = 2 if is_quantized(cache_dtype) else 0
    return rows * (per_row + scales) + 2 * q.numel() * q.element_size()


def bench_decode(batch: int, context: int, cfg: dict, device, on_cuda: bool) -> list[dict]:
    from pagedray import kernels
    from pagedray.kernels.kv_quant import KV_CACHE_DTYPES
    from pagedray.kernels.triton.decode_triton import paged_decode_triton

    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    k_cache, v_cache, tables = paged_kv_case(batch, context, cfg, dtype, device, gen)
    q = torch.randn((batch, cfg["q_heads"], cfg["head_dim"]), dtype=dtype, device=device, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out, scale = torch.empty_like(q), 1.0 / math.sqrt(cfg["head_dim"])
    caches = {cfg["dtype"]: (k_cache, v_cache, {}, None)}          # name -> (K, V, row scales, kernel config)
    for name in cfg["cache_dtypes"]:
        k8, v8, ks, vs = quantized_copy(k_cache, v_cache, KV_CACHE_DTYPES[name])
        caches[name] = (k8, v8, dict(k_scale=ks, v_scale=vs), None)
        caches[name + F16_MATH] = (k8, v8, dict(k_scale=ks, v_scale=vs), dict(F16_MATH=True))
    rows, base_ms = [], None
    for name, (k, v, scales, config) in caches.items():
        few = min(batch, 2)
        check_close(paged_decode_triton(q[:few], k, v, tables[:few], lens[:few], scale, config=config, **scales),
                    kernels.paged_decode(q[:few], k, v, tables[:few], lens[:few], scale, use_triton=False, **scales),
                    f"decode {name} b={batch} ctx={context}")
        ms = time_ms(lambda k=k, v=v, scales=scales, config=config: paged_decode_triton(
            q, k, v, tables, lens, scale, out=out, config=config, **scales), on_cuda)
        base_ms = base_ms or ms
        nbytes = read_bytes(batch, context, cfg, k.dtype, q)
        rows.append(dict(kind="decode", cache=name, batch=batch, context=context, ms=ms,
                         ktok_per_s=batch * context / ms, speedup_vs_16bit=base_ms / ms,
                         gbps=nbytes / (ms * 1e-3) / 1e9))
    del caches
    if on_cuda:
        torch.cuda.empty_cache()
    return rows


def bench_prefill(cfg: dict, device, on_cuda: bool) -> list[dict]:
    from pagedray import kernels
    from pagedray.kernels.kv_quant import KV_CACHE_DTYPES

    tokens, history = cfg["prefill"]
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator(device=device).manual_seed(11)
    k_cache, v_cache, tables = paged_kv_case(1, tokens + history, cfg, dtype, device, gen)
    q = torch.randn((tokens, cfg["q_heads"], cfg["head_dim"]), dtype=dtype, device=device, generator=gen)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    lens = torch.tensor([tokens + history], dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(cfg["head_dim"])
    rows, base_ms = [], None
    for name in (cfg["dtype"], *cfg["cache_dtypes"]):
        k, v, extra = k_cache, v_cache, {}
        if name in KV_CACHE_DTYPES:
            k, v, ks, vs = quantized_copy(k_cache, v_cache, KV_CACHE_DTYPES[name])
            extra = dict(k_scale=ks, v_scale=vs)
        ms = time_ms(lambda k=k, v=v, extra=extra: kernels.paged_prefill(q, k, v, cu, lens, tables, scale,
                                                                         use_triton=True, **extra), on_cuda)
        base_ms = base_ms or ms
        rows.append(dict(kind="prefill", cache=name, tokens=tokens, history=history, ms=ms,
                         speedup_vs_16bit=base_ms / ms))
    return rows


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    print(f"{'cache':9} {'batch':>6} {'context':>8} {'ms':>9} {'ktok/s':>10} {'GB/s':>8} {'x 16-bit':>9}")
    rows = []
    for batch, context in ((b, c) for b in cfg["batches"] for c in cfg["contexts"]):
        rows += bench_decode(batch, context, cfg, device, on_cuda)
        for r in rows[-1 - 2 * len(cfg["cache_dtypes"]):]:             # printed as measured: a cut run keeps them
            print(f"{r['cache']:9} {r['batch']:>6} {r['context']:>8} {r['ms']:>9.4f} {r['ktok_per_s']:>10.0f} "
                  f"{r['gbps']:>8.1f} {r['speedup_vs_16bit']:>8.2f}x", flush=True)
    rows += bench_prefill(cfg, device, on_cuda)
    for r in (r for r in rows if r["kind"] == "prefill"):
        print(f"prefill {r['tokens']} over {r['history']}: {r['cache']:9} {r['ms']:.3f} ms "
              f"({r['speedup_vs_16bit']:.2f}x 16-bit)")
    return write_report(out_path, device, cfg, rows, dry_run)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.kv8_kernel", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/kv8_kernel.json", "pagedray_kv8_kernel_dry_run.json")


if __name__ == "__main__":
    main()
