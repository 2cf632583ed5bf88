"""CPU timing of the torch references (the engine's CPU attention path):
``python -m benchmarks.kernel_reference [--threads N] [--out PATH]``.

Peer: ``scaled_dot_product_attention`` on the same K/V already dense and contiguous (no block-table
gather, no masking of padding), i.e. a lower bound for the same math; the table shows the reference's
time as a multiple of it. Prints a table and writes JSON. Timings are the median of several runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from pagedray.kernels.cpu.cpu_twins import median_ms
from pagedray.kernels.reference.attention import paged_decode_reference, paged_prefill_reference

HEADS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
DECODE = [(1, 512), (8, 512), (32, 512), (8, 2048), (64, 256), (128, 1024)]
PREFILL = [(128, 0), (512, 0), (128, 512), (512, 1024)]
BLOCK_SIZE = 16


def _paged(gen, lens, kv_heads, head_dim, dtype):
    """Shuffled paged cache + tables for sequences of ``lens`` tokens, and their dense K/V."""
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in lens]
    num_blocks = sum(per_seq)
    k_cache = torch.randn((num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(lens), max(per_seq)), dtype=torch.int32)
    offset = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[offset:offset + nb].to(torch.int32)
        offset += nb
    return k_cache, v_cache, tables


def _dense(cache, tables, length):
    """[B, Hkv, length, D] float32 contiguous copy of the first ``length`` positions."""
    g = cache[tables.long()].flatten(1, 2)[:, :length]
    return g.transpose(1, 2).to(torch.float32).contiguous()


def time_decode(model: str, batch: int, context: int, dtype) -> dict:
    hq, hkv, d = HEADS[model]
    gen = torch.Generator().manual_seed(batch * 7 + context)
    k_cache, v_cache, tables = _paged(gen, [context] * batch, hkv, d, dtype)
    q = torch.randn((batch, hq, d), generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    ref_ms = median_ms(lambda: paged_decode_reference(q, k_cache, v_cache, tables, lens, 0.1), repeats=7)
    keys, values = _dense(k_cache, tables, context), _dense(v_cache, tables, context)
    q_rows = q.to(torch.float32).view(batch, hkv, hq // hkv, d)
    peer_ms = median_ms(lambda: F.scaled_dot_product_attention(q_rows, keys, values, scale=0.1), repeats=7)
    return dict(kind="decode", model=model, dtype=str(dtype)[6:], batch=batch, context=context,
                ref_ms=ref_ms, dense_sdpa_ms=peer_ms, ratio=ref_ms / peer_ms)


def time_prefill(model: str, chunk: int, history: int, dtype) -> dict:
    hq, hkv, d = HEADS[model]
    gen = torch.Generator().manual_seed(chunk * 13 + history)
    total = chunk + history
    k_cache, v_cache, tables = _paged(gen, [total], hkv, d, dtype)
    q = torch.randn((chunk, hq, d), generator=gen).to(dtype)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    lens = torch.tensor([total], dtype=torch.int32)
    ref_ms = median_ms(lambda: paged_prefill_reference(q, k_cache, v_cache, cu, lens, tables, 0.1), repeats=5)
    keys = _dense(k_cache, tables, total).repeat_interleave(hq // hkv, dim=1)
    values = _dense(v_cache, tables, total).repeat_interleave(hq // hkv, dim=1)
    q_dense = q.to(torch.float32).transpose(0, 1)[None].contiguous()
    mask = torch.ones((chunk, total), dtype=torch.bool).tril(diagonal=history)
    peer_ms = median_ms(lambda: F.scaled_dot_product_attention(q_dense, keys, values, attn_mask=mask,
                                                                scale=0.1), repeats=5)
    return dict(kind="prefill", model=model, dtype=str(dtype)[6:], chunk=chunk, history=history,
                ref_ms=ref_ms, dense_sdpa_ms=peer_ms, ratio=ref_ms / peer_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="time the CPU torch references")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("benchmarks/results/kernels_reference_cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'kind':8} {'model':8} {'dtype':8} {'shape':>14} {'ref ms':>9} {'dense sdpa ms':>14} {'ratio':>6}")
    for model in HEADS:
        for dtype in (torch.float32, torch.bfloat16):
            for batch, context in DECODE:
                rows.append(time_decode(model, batch, context, dtype))
            for chunk, history in PREFILL:
                rows.append(time_prefill(model, chunk, history, dtype))
            for r in rows[-len(DECODE) - len(PREFILL):]:
                shape = f"{r['batch']}x{r['context']}" if r["kind"] == "decode" else f"{r['chunk']}+h{r['history']}"
                print(f"{r['kind']:8} {r['model']:8} {r['dtype']:8} {shape:>14} {r['ref_ms']:>9.2f} "
                      f"{r['dense_sdpa_ms']:>14.2f} {r['ratio']:>6.2f}")
    report = dict(device=f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
