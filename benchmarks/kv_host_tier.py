"""The pinned host-memory KV tier on CUDA: ``python -m benchmarks.kv_host_tier [--dry-run] [--out PATH]``.

``workers/kv_host_tier.py`` (issue #64's second tier on a GPU) on a Qwen3-8B-shaped rank cache (36 layers, 8 KV heads
of 128, blocks of 16 tokens, bf16: 2.4 MB a block). For 1, 16 and 64 blocks at a time, after checking that saved
blocks load back bit for bit into other blocks:
- ``save_ms``: ``save_many`` until its copies have landed; ``save_load_ms``: a save and then the load of the same
  slots (``load_many``), until they have landed; ``load_ms`` = the difference;
- ``pinned_ms``: one contiguous pinned-host -> device copy of as many bytes, and each direction's GB/s against it;
- overlap: a stand-in forward (bf16 matmuls, ``forward_ms``) alone, the tier's save + load alone, then both issued
  together (the tier's copies on its side stream, the forward on the compute stream): ``overlap`` = the share of the
  shorter one hidden, (alone + alone - together) / min(alone, alone); 0 when they ran one after the other.
Timing: ``triton.testing.do_bench`` medians on CUDA. Prints a table and writes JSON (device, date, rows).
``--dry-run``: tiny shapes on CPU (synchronous copies) to check the plumbing; its numbers mean nothing.
"""

from __future__ import annotations

import pathlib
import sys

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch

from benchmarks.kernels import bench_main, time_ms, write_report

FULL = dict(layers=36, kv_heads=8, head_dim=128, block_size=16, num_blocks=256, dtype="bfloat16",
            batches=(1, 16, 64), matmul=4096, matmuls=8)
DRY = dict(layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=16, dtype="bfloat16", batches=(1, 4),
           matmul=64, matmuls=2)


def _store(cfg: dict, device: torch.device):
    from pagedray.workers.kv_cache import KVCache
    from pagedray.workers.kv_host_tier import HostTierStore

    shape = (cfg["layers"], 2, cfg["num_blocks"], cfg["block_size"], cfg["kv_heads"], cfg["head_dim"])
    data = torch.randn(shape, device=device).to(getattr(torch, cfg["dtype"]))
    return HostTierStore(KVCache(data), num_slots=max(cfg["batches"]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(store, n: int, device: torch.device) -> None:
    """Blocks 0..n-1 saved, then loaded into blocks n..2n-1: bit for bit."""
    data = store.kv_cache.data
    store.save_many([(b, b) for b in range(n)])
    loaded, _ = store.load_many([(b, n + b) for b in range(n)])
    store.wait_loads()
    _sync(device)
    if not all(loaded) or not torch.equal(data[:, :, n:2 * n], data[:, :, :n]):
        raise AssertionError(f"{n} blocks: the host tier did not give the saved blocks back exactly")


def bench(n: int, cfg: dict, store, device: torch.device, on_cuda: bool) -> dict:
    _check(store, n, device)
    saves, loads = [(b, b) for b in range(n)], [(b, n + b) for b in range(n)]

    def save():
        store.save_many(saves)
        _sync(device)

    def save_load():
        store.save_many(saves)
        store.load_many(loads)
        store.wait_loads()
        _sync(device)

    size = cfg["matmul"]
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def forward():
        for _ in range(cfg["matmuls"]):
            a @ a
        _sync(device)

    def both():
        store.save_many(saves)
        store.load_many(loads)
        for _ in range(cfg["matmuls"]):
            a @ a
        store.wait_loads()
        _sync(device)

    nbytes = n * store.block_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    save_ms, save_load_ms = time_ms(save, on_cuda), time_ms(save_load, on_cuda)
    pinned_ms = time_ms(lambda: (target.copy_(host, non_blocking=True), _sync(device)), on_cuda)
    forward_ms, both_ms = time_ms(forward, on_cuda), time_ms(both, on_cuda)
    load_ms = max(save_load_ms - save_ms, 1e-6)
    gb = nbytes / 1e9
    hidden = save_load_ms + forward_ms - both_ms
    return dict(blocks=n, mb=nbytes / 1e6, save_ms=save_ms, load_ms=load_ms, save_load_ms=save_load_ms,
                pinned_ms=pinned_ms, save_gb_s=gb / (save_ms / 1e3), load_gb_s=gb / (load_ms / 1e3),
                pinned_gb_s=gb / (pinned_ms / 1e3), forward_ms=forward_ms, both_ms=both_ms,
                overlap=max(hidden, 0.0) / min(save_load_ms, forward_ms))


def run(cfg: dict, device: torch.device, out_path: pathlib.Path, dry_run: bool) -> dict:
    on_cuda = device.type == "cuda"
    store = _store(cfg, device)
    rows = [bench(n, cfg, store, device, on_cuda) for n in cfg["batches"]]
    store.close()
    print(f"{'blocks':>6} {'MB':>7} {'save ms':>8} {'load ms':>8} {'pinned ms':>10} {'save GB/s':>10} "
          f"{'load GB/s':>10} {'pinned GB/s':>12} {'fwd ms':>7} {'both ms':>8} {'overlap':>8}")
    for r in rows:
        print(f"{r['blocks']:>6} {r['mb']:>7.1f} {r['save_ms']:>8.3f} {r['load_ms']:>8.3f} {r['pinned_ms']:>10.3f} "
              f"{r['save_gb_s']:>10.2f} {r['load_gb_s']:>10.2f} {r['pinned_gb_s']:>12.2f} {r['forward_ms']:>7.2f} "
              f"{r['both_ms']:>8.2f} {r['overlap']:>8.2f}")
    return write_report(out_path, device, cfg, rows, dry_run, block_bytes=store.block_bytes)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "benchmarks.kv_host_tier", __doc__.splitlines()[0], run, FULL, DRY,
               "benchmarks/results/kv_host_tier.json", "pagedray_kv_host_tier_dry_run.json")


if __name__ == "__main__":
    main()
