"""Paged-attention kernel benchmark: ``python -m benchmarks.kernels [--dry-run] [--out PATH]``.

Prints a table and writes JSON (device name, date, every row).

* Decode: batch {1, 8, 64, 256} x context {512, 2k, 8k, 32k}, 32 query / 8 KV heads, head_dim 128,
  block size 16, bf16 and fp16, physical blocks shuffled. Reports time, achieved GB/s counting the
  K/V bytes read plus q and out, and that as a % of the device-to-device copy bandwidth measured in
  the same run (``dst.copy_(src)`` of 1 GiB, read + write bytes). Goal: >= 85% at batch >= 64, ctx >= 2k.
* Prefill: 4k, 8k, 16k query tokens (one sequence), causal, without history and with a history as long
  as the chunk; TFLOP/s (causal FLOPs only: 4 * head_dim * Hq * visible pairs) against torch
  ``scaled_dot_product_attention`` on the same data gathered dense (flash backend where it accepts
  the inputs, else the next fused backend; the backend used is recorded).
* Timing: ``triton.testing.do_bench`` (median, L2 flushed between runs) on CUDA.
* ``--dry-run``: tiny shapes on CPU through the Triton interpreter (re-executes itself with
  ``TRITON_INTERPRET=1``), to check the plumbing; its numbers mean nothing.
Each configuration is first checked against the torch reference on a small slice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

FULL = dict(batches=(1, 8, 64, 256), contexts=(512, 2048, 8192, 32768), q_heads=32, kv_heads=8,
            head_dim=128, block_size=16, prefill_tokens=(4096, 8192, 16384), dtypes=("bfloat16", "float16"))
DRY = dict(batches=(1, 3), contexts=(40, 130), q_heads=4, kv_heads=2, head_dim=64, block_size=16,
           prefill_tokens=(48,), dtypes=("float16",))


def time_ms(fn, on_cuda: bool) -> float:
    if on_cuda:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(device: torch.device, on_cuda: bool) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / time of ``dst.copy_(src)``."""
    nbytes = (1 << 30) if on_cuda else (1 << 22)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), on_cuda)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def paged_kv_case(batch: int, context: int, cfg: dict, dtype, device, gen):
    """Shuffled paged cache holding ``batch`` sequences of ``context`` tokens."""
    bs = cfg["block_size"]
    per_seq = math.ceil(context / bs)
    num_blocks = batch * per_seq
    shape = (num_blocks, bs, cfg["kv_heads"], cfg["head_dim"])
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks, device="cpu", generator=torch.Generator().manual_seed(batch))
    tables = perm.view(batch, per_seq).to(torch.int32).to(device)
    return k_cache, v_cache, tables


def decode_bytes(q: torch.Tensor, context: int, kv_heads: int, head_dim: int) -> int:
    """Bytes one decode step must move: K and V of ``context`` tokens per sequence, plus q and out."""
    elem = q.element_size()
    return 2 * q.shape[0] * context * kv_heads * head_dim * elem + 2 * q.numel() * elem


def prefill_flops(tokens: int, history: int, q_heads: int, head_dim: int) -> int:
    """Causal FLOPs of a chunk over its history: 4 * head_dim * Hq * visible (query, key) pairs."""
    return 4 * head_dim * q_heads * (tokens * history + tokens * (tokens + 1) // 2)


def check_close(out, expected, what: str) -> None:
    err = (out.float() - expected.float()).abs().max().item()
    ref = max(expected.float().abs().max().item(), 1e-6)
    if not err / ref < 2e-2:
        raise RuntimeError(f"{what}: kernel disagrees with the reference (rel err {err / ref:.3e})")


def bench_decode(batch: int, context: int, dtype_name: str, cfg: dict, device, on_cuda: bool,
                 copy_gbps: float) -> dict:
    from pagedray.kernels import paged_decode, paged_decode_reference

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k_cache, v_cache, tables = paged_kv_case(batch, context, cfg, dtype, device, gen)
    q = torch.randn((batch, cfg["q_heads"], cfg["head_dim"]), dtype=dtype, device=device, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(cfg["head_dim"])
    few = min(batch, 2)
    check_close(paged_decode(q[:few], k_cache, v_cache, tables[:few], seq_lens[:few], scale, use_triton=True),
           paged_decode_reference(q[:few], k_cache, v_cache, tables[:few], seq_lens[:few], scale),
           f"decode b={batch} ctx={context}")
    ms = time_ms(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                                       use_triton=True), on_cuda)
    gbps = decode_bytes(q, context, cfg["kv_heads"], cfg["head_dim"]) / (ms * 1e-3) / 1e9
    return dict(kind="decode", dtype=dtype_name, batch=batch, context=context, ms=ms, gbps=gbps,
                pct_of_copy=100.0 * gbps / copy_gbps)


def _sdpa_dense(q, keys, values, history: int):
    """q [1, Hq, T, D]; keys/values [1, Hkv, history + T, D] -> (callable, "BACKEND/gqa-mode").

    Tries the flash backend first, with native GQA and then with K/V heads repeated densely; falls back
    to the other fused backends only when flash refuses the inputs (e.g. a lower-right causal bias)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // keys.shape[1]
    repeated = {}

    def call(backend, mode):
        def run():
            k, v = (keys, values) if mode == "native" else repeated["kv"]
            mask = None if history == 0 else causal_lower_right(q.shape[2], k.shape[2])
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=history == 0,
                                                      enable_gqa=mode == "native" and group > 1)
        return run

    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        for mode in ("native", "repeat"):
            if mode == "repeat" and "kv" not in repeated:
                repeated["kv"] = (keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1))
            try:
                call(backend, mode)()
                return call(backend, mode), f"{backend.name}/{mode}"
            except RuntimeError as exc:   # this backend refuses these inputs
                errors.append(f"{backend.name}/{mode}: {exc}")
    raise RuntimeError("no SDPA backend accepted the inputs: " + " | ".join(errors))


def bench_prefill(tokens: int, history: int, dtype_name: str, cfg: dict, device, on_cuda: bool) -> dict:
    from pagedray.kernels import paged_prefill, paged_prefill_reference

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(tokens + history)
    total = history + tokens
    k_cache, v_cache, tables = paged_kv_case(1, total, cfg, dtype, device, gen)
    hq, hkv, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    q = torch.randn((tokens, hq, d), dtype=dtype, device=device, generator=gen)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, cu, seq_lens, tables, scale)
    ms = time_ms(lambda: paged_prefill(*args, out=out, use_triton=True), on_cuda)
    # Dense copy of the same data for the peer: [1, H, L, D].
    idx = tables[0].long()
    keys = k_cache[idx].reshape(-1, hkv, d)[:total].transpose(0, 1)[None].contiguous()
    values = v_cache[idx].reshape(-1, hkv, d)[:total].transpose(0, 1)[None].contiguous()
    q_dense = q.transpose(0, 1)[None].contiguous()
    sdpa, backend = _sdpa_dense(q_dense, keys, values, history)
    expected = paged_prefill_reference(*args) if not on_cuda or tokens <= 4096 else None
    if expected is not None:
        check_close(out, expected, f"prefill T={tokens} hist={history}")
        check_close(sdpa()[0].transpose(0, 1), expected, f"sdpa T={tokens} hist={history}")
    sdpa_ms = time_ms(sdpa, on_cuda)
    flops = prefill_flops(tokens, history, hq, d)
    return dict(kind="prefill", dtype=dtype_name, tokens=tokens, history=history, ms=ms,
                tflops=flops / (ms * 1e-3) / 1e12, sdpa_ms=sdpa_ms,
                sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12, sdpa_backend=backend, speedup_vs_sdpa=sdpa_ms / ms)


def print_table(rows: list[dict], copy_gbps: float) -> None:
    print(f"device-to-device copy bandwidth: {copy_gbps:.1f} GB/s")
    print(f"{'dtype':9} {'batch':>6} {'context':>8} {'ms':>9} {'GB/s':>9} {'% copy':>7}")
    for r in (r for r in rows if r["kind"] == "decode"):
        print(f"{r['dtype']:9} {r['batch']:>6} {r['context']:>8} {r['ms']:>9.4f} {r['gbps']:>9.1f} "
              f"{r['pct_of_copy']:>6.1f}%")
    print(f"\n{'dtype':9} {'tokens':>7} {'history':>8} {'ms':>9} {'TFLOP/s':>8} {'sdpa ms':>9} "
          f"{'sdpa TF/s':>9} {'ratio':>6}  sdpa backend")
    for r in (r for r in rows if r["kind"] == "prefill"):
        print(f"{r['dtype']:9} {r['tokens']:>7} {r['history']:>8} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['sdpa_ms']:>9.3f} {r['sdpa_tflops']:>9.1f} {r['speedup_vs_sdpa']:>6.2f}  {r['sdpa_backend']}")


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    copy_gbps = copy_bandwidth_gbps(device, on_cuda)
    rows = []
    for dtype_name in cfg["dtypes"]:
        for batch in cfg["batches"]:
            for context in cfg["contexts"]:
                rows.append(bench_decode(batch, context, dtype_name, cfg, device, on_cuda, copy_gbps))
                if on_cuda:
                    torch.cuda.empty_cache()
        for tokens in cfg["prefill_tokens"]:
            for history in (0, tokens):
                rows.append(bench_prefill(tokens, history, dtype_name, cfg, device, on_cuda))
    print_table(rows, copy_gbps)
    return write_report(out_path, device, cfg, rows, dry_run, copy_gbps=copy_gbps)


def write_report(out_path: pathlib.Path, device: torch.device, cfg: dict, rows: list[dict], dry_run: bool,
                 **extra) -> dict:
    """The GPU kernel benchmarks' JSON (device name, date, torch, config, rows, ``extra``) -> written, returned."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET dry run)"
    report = dict(device=name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  dry_run=dry_run, torch=torch.__version__, config=cfg, **extra, rows=rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {out_path}")
    return report


def bench_main(argv: list[str] | None, module: str, description: str, run, full: dict, dry: dict,
               default_out: str, dry_out: str) -> None:
    """The command line of the GPU kernel benchmarks: ``--dry-run`` re-executes under ``TRITON_INTERPRET=1``
    and runs ``dry`` on CPU, else ``full`` on CUDA; ``run(cfg, device, out_path, dry_run)`` does the work."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU via TRITON_INTERPRET=1")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if dry_run_or_cuda(parser, args, module):
        run(dry, torch.device("cpu"), args.out or pathlib.Path(tempfile.gettempdir()) / dry_out, dry_run=True)
        return
    run(full, torch.device("cuda"), args.out or pathlib.Path(default_out), False)


def dry_run_or_cuda(parser: argparse.ArgumentParser, args: argparse.Namespace, module: str) -> bool:
    """True for ``--dry-run`` (re-executing ``python -m module`` under ``TRITON_INTERPRET=1`` first: Triton reads
    it when the kernels are defined); else False, or a usage error where there is no CUDA GPU."""
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
        return True
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --dry-run to check the script on CPU)")
    return False


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.kernels", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/kernels_bench.json", "pagedray_kernels_bench_dry_run.json")


if __name__ == "__main__":
    main()
