"""This rank's second KV tier: blocks evicted from the paged cache, kept as files, loaded back on a prefix hit.

The engine decides everything (``block_manager/offload_tier.py``): which evicted block goes to which tier slot
(``StepPlan.kv_saves``: (block, slot) pairs) and which slot comes back into which free block
(``StepPlan.kv_loads``: (slot, block)). The rank moves its own shard's bytes: a block's K/V rows of every layer
(and their scales with an 8-bit cache), ``block_bytes`` of them in ``kv_blocks.py``'s layout, in one file per slot
under its folder.

- Saves run before anything else in the plan (the evicted block may be written again in this very step: a new
  owner's K/V, a copy-on-write); loads run after the saves, before the forward.
- Every file carries a CRC-32 of its bytes, kept in memory when saved. A load whose file is missing, has the
  wrong size or a different CRC is a failure (the block is left as it was): the engine then treats the prefix
  as not cached and computes it again, never a wrong token.
- On CUDA with a folder the bytes go through host memory to the same files; without one the tier is pinned host
  memory (``kv_host_tier.py``, chosen by ``open_tier_store``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch

from .kv_blocks import block_bytes, read_blocks, write_blocks
from .kv_cache import KVCache
from .kv_host_tier import HostTierStore

DEFAULT_PREFIX = "pagedray-kv-tier-"
log = logging.getLogger(__name__)


def _remove_orphans() -> None:
    """Removes the default folders of rank processes that no longer run on this machine."""
    for path in Path(tempfile.gettempdir()).glob(f"{DEFAULT_PREFIX}*"):
        pid = path.name.removeprefix(DEFAULT_PREFIX)
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:       # another user's process: alive
            pass


class KVTierStore:
    def __init__(self, kv_cache: KVCache, folder: str | None, rank: int) -> None:
        """Files under ``folder``/rank<rank>; whatever an earlier run left there is removed first (its CRCs are
        gone, so it could only ever fail to load). ``folder`` None: ``pagedray-kv-tier-<pid>`` in the temporary
        directory, removed by ``close``; a rank actor killed without ``close`` leaves its folder, which the next
        rank to start on that machine removes (its process is gone)."""
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes(kv_cache)
        self._owns_root = folder is None
        if folder is None:
            _remove_orphans()
        root = Path(tempfile.gettempdir()) / f"{DEFAULT_PREFIX}{os.getpid()}" if folder is None else Path(folder)
        self.root = root
        self.folder = root / f"rank{rank}"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._crc: dict[int, int] = {}

    def _file(self, slot: int) -> Path:
        return self.folder / f"{slot}.kv"

    def save(self, block: int, slot: int) -> None:
        """Block ``block``'s bytes (every layer, K and V, scales) into slot ``slot``'s file."""
        data = read_blocks(self.kv_cache, [block]).numpy().tobytes()                   # [block_bytes]
        try:
            self._file(slot).write_bytes(data)
        except OSError as exc:        # a full or unwritable disk: this slot cannot load (a miss), the step goes on
            self._crc.pop(slot, None)
            log.warning("second KV tier: slot %d not saved (%s); a prompt reaching it computes it again", slot, exc)
            return
        self._crc[slot] = zlib.crc32(data)

    def load(self, slot: int, block: int) -> bool:
        """Slot ``slot``'s bytes into block ``block``; False (block untouched) when the file is missing, short
        or its CRC differs from the one saved."""
        crc = self._crc.pop(slot, None)
        try:
            data = self._file(slot).read_bytes()
        except OSError:
            return False
        if crc is None or len(data) != self.block_bytes or zlib.crc32(data) != crc:
            return False
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, -1)      # [1, block_bytes]
        write_blocks(self.kv_cache, [block], rows)
        return True

    def save_many(self, pairs: list[tuple[int, int]]) -> None:
        """(block, slot) pairs, saved one after the other (``HostTierStore``'s interface)."""
        for block, slot in pairs:
            self.save(block, slot)

    def wait_loads(self) -> None:
        """Loads are done when ``load_many`` returns (``HostTierStore`` orders CUDA streams here)."""

    def load_many(self, pairs: list[tuple[int, int]]) -> tuple[list[bool], float]:
        """(slot, block) pairs: (per pair: loaded or not, the seconds the reads took)."""
        started = time.perf_counter()
        loaded = [self.load(slot, block) for slot, block in pairs]
        return loaded, time.perf_counter() - started

    def close(self) -> None:
        shutil.rmtree(self.root if self._owns_root else self.folder, ignore_errors=True)


def open_tier_store(kv_cache: KVCache, folder: str | None, rank: int, num_slots: int) -> KVTierStore | HostTierStore:
    """The rank's second tier: files under ``folder`` when one is given or the cache is on the CPU (whose first
    tier already is host memory); pinned host memory on CUDA without a folder (``kv_host_tier.py``)."""
    if folder is None and kv_cache.data.device.type == "cuda":
        return HostTierStore(kv_cache, num_slots)
    return KVTierStore(kv_cache, folder, rank)
