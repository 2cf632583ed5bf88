"""This rank's second KV tier in host memory: the tier a CUDA rank takes when no folder is given.

On CUDA the paged cache is device memory, so the natural second tier is the host's RAM: an evicted block's bytes
go over PCIe into one pinned host tensor and come back the same way on a prefix hit, with no file in between.
The engine's side is the same as for the file tier (``kv_tier.py``: ``StepPlan.kv_saves`` / ``kv_loads``, slots it
chose); only where the bytes rest differs.

- ``rows [slots, block_bytes]`` uint8 on the host (``kv_blocks.py``'s layout), pinned when the cache is on CUDA.
  Allocated at start: ``kv_offload_gib`` of pinned memory per rank.
- Saves are asynchronous. The blocks' bytes are first gathered on the device in stream order
  (``read_blocks(host=False)``: a copy that exists before anything later in the step writes those blocks, such as a
  new owner's K/V), then a side stream that waits for that gather copies them into their host rows; the step's
  forward does not wait for these copies. ``record_stream`` keeps the gathered rows' memory from being reused
  before the side stream is done with it.
- Loads are asynchronous too. The engine loads a prefix's blocks in one step and admits its request in a later
  one (``block_manager/offload_tier.py``), so the step that carries the loads does not read those blocks: the host
  rows go into a device staging tensor and from there into their blocks (``write_blocks``) on the same side stream
  (after every save queued before them, even into the same slot), while the step's forward runs. The next step
  orders its compute stream after them (``wait_loads``, at the start of ``Worker.execute``), before anything reads
  the cache. The seconds a load takes, which the tier cost model weighs (``cluster/tier_cost.py``), come from CUDA
  events around the copies: the first load batch is waited for once to time it; later ones report the per-block
  time of the newest batch that has completed, times their blocks.
- A slot holds a block from its save until its load (the engine frees a slot once loaded, as with the file tier):
  a load of a slot that was never saved, or was loaded already, is a miss (False, the block untouched). Host
  memory is not corrupted the way a file can be, so there is no CRC.

On a CPU cache the same class runs with plain host memory and synchronous copies (what the tests drive; a CPU
rank's default tier stays the file tier: its first tier already is host memory).
"""

from __future__ import annotations

import time

import torch

from .kv_blocks import block_bytes, read_blocks, write_blocks
from .kv_cache import KVCache


class HostTierStore:
    def __init__(self, kv_cache: KVCache, num_slots: int) -> None:
        if type(num_slots) is not int or num_slots < 1:     # noqa: E721
            raise ValueError(f"kv_offload_gib: the host tier needs at least one block's bytes, got {num_slots!r} slots")
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes(kv_cache)
        self.device = kv_cache.data.device
        self.cuda = self.device.type == "cuda"
        try:
            self.rows = torch.empty((num_slots, self.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        except RuntimeError as exc:
            raise ValueError(f"kv_offload_gib: {num_slots} blocks of {self.block_bytes} bytes of "
                             f"{'pinned ' if self.cuda else ''}host memory could not be allocated ({exc})") from None
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._held: set[int] = set()          # slots holding a saved block
        self._loads_done: torch.cuda.Event | None = None              # the last load batch not yet waited for
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []   # (begin, end, blocks) not read yet
        self._per_block: float | None = None   # seconds per block of the newest completed load batch

    def save(self, block: int, slot: int) -> None:
        self.save_many([(block, slot)])

    def load(self, slot: int, block: int) -> bool:
        return self.load_many([(slot, block)])[0][0]

    def _check_slots(self, slots: list[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.rows.shape[0]]
        if bad:
            raise ValueError(f"kv_saves / kv_loads: slots {bad[:4]} are outside the host tier "
                             f"(0..{self.rows.shape[0] - 1})")

    def save_many(self, pairs: list[tuple[int, int]]) -> None:
        """(block, slot) pairs: each block's bytes into its slot's host row (asynchronously on CUDA)."""
        if not pairs:
            return
        blocks, slots = [b for b, _ in pairs], [s for _, s in pairs]
        self._check_slots(slots)
        gathered = read_blocks(self.kv_cache, blocks, host=False)                  # [n, block_bytes] on the device
        if self._stream is None:
            self.rows[torch.tensor(slots)] = gathered
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))      # after the gather
            with torch.cuda.stream(self._stream):
                for i, slot in enumerate(slots):
                    self.rows[slot].copy_(gathered[i], non_blocking=True)
            gathered.record_stream(self._stream)
        self._held.update(slots)

    def load_many(self, pairs: list[tuple[int, int]]) -> tuple[list[bool], float]:
        """(slot, block) pairs: each held slot's bytes into its block (asynchronously on CUDA). (per pair: loaded, or
        a miss that leaves the block as it was; the seconds the copies take)."""
        self._check_slots([s for s, _ in pairs])
        loaded = [slot in self._held for slot, _ in pairs]
        hits = [pair for pair, hit in zip(pairs, loaded) if hit]
        for slot, _ in pairs:
            self._held.discard(slot)
        if not hits:
            return loaded, 0.0
        slots, blocks = [s for s, _ in hits], [b for _, b in hits]
        if self._stream is None:
            started = time.perf_counter()
            write_blocks(self.kv_cache, blocks, self.rows[torch.tensor(slots)])
            return loaded, time.perf_counter() - started
        staging = torch.empty((len(slots), self.block_bytes), dtype=torch.uint8, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))    # after the saves' gathers, the staging
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            for i, slot in enumerate(slots):
                staging[i].copy_(self.rows[slot], non_blocking=True)
            write_blocks(self.kv_cache, blocks, staging)
            end.record()
        staging.record_stream(self._stream)
        self._loads_done = end
        self._timings.append((begin, end, len(slots)))
        return loaded, self._load_seconds(len(slots))

    def _load_seconds(self, num_blocks: int) -> float:
        """The newest completed load batch's seconds per block, times ``num_blocks`` (the first batch is waited for)."""
        if self._per_block is None:
            begin, end, n = self._timings.pop()
            end.synchronize()
            self._per_block = begin.elapsed_time(end) / 1e3 / n
        pending = []
        for begin, end, n in self._timings:
            if end.query():
                self._per_block = begin.elapsed_time(end) / 1e3 / n
            else:
                pending.append((begin, end, n))
        self._timings = pending
        return self._per_block * num_blocks

    def wait_loads(self) -> None:
        """Orders the compute stream after every load issued so far (call before a step reads the cache)."""
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._held.clear()
