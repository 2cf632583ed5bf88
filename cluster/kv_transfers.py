"""Moving a prefix's KV blocks from one replica to another: the export, the import and their checks.

An export (``Engine.start_export``) reads the blocks of the longest cached run of full blocks of a token list
on every rank: the engine holds those blocks (they cannot be evicted) and the next plans carry them
(``StepPlan.kv_exports``); rank 0's results bring each rank's bytes back (``workers/kv_blocks.py``'s layout).
The ``KVExport`` it makes names the layout the bytes mean something in, the adapter namespace and the tokens.

An import (``Engine.start_import``) puts an export into this replica's pool under the same chained keys: the
leading blocks already cached here are skipped, free blocks are taken for the rest (never below the
watermark, so running sequences keep their room; an import that finds less room imports a shorter prefix),
and the next plans write them (``StepPlan.kv_imports``). Each block joins the prefix cache when its plan's
result is back; a request that arrives after the import finds them as if it had computed them. With another
TP size the ranks re-shard the heads (``kv_blocks.reshard_rows``).

Checks before anything changes: the two layouts must agree on everything but the TP size (model, its
dimensions, block size, dtype, KV cache dtype); otherwise ValueError names the field, and the caller prefills
instead. The shards must have the sizes the layout gives.

Pace: a plan carries at most ``TRANSFER_BYTES_PER_PLAN`` bytes of one export and of one import (all ranks'
shards counted), so a long prefix moves over several steps. A transfer does not wait behind a long step: when
chunks are waiting, the engine sends them in a plan of their own (nothing scheduled), every other step at most,
so the steps of running requests go on between.
Transfers are settled on the step thread; ``Transfer.on_done`` callbacks run there. A failed step or a rebuilt
TP group fails the transfers in flight (``fail_all``): an export's holds are dropped, an import's blocks go
with the lost cache. The draft model's cache (``speculative_model``) is not moved: the drafts of an imported
prefix are worse, the tokens the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from pagedray.block_manager import BlockManager, namespace_root
from pagedray.kernels.kv_quant import SCALE_DTYPE, cache_dtype, is_quantized
from pagedray.workers.contract.wire import StepPlan, StepResult

from .request import SequenceStatus

TRANSFER_BYTES_PER_PLAN = 32 * 1024 * 1024


@dataclass(frozen=True)
class KVLayout:
    """What a block's bytes mean: two replicas can move blocks when everything but the TP size agrees."""

    model: str                 # the model as configured (name or folder)
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str                 # the model's resolved dtype, e.g. "bfloat16"
    kv_cache_dtype: str        # as configured: "auto" (the model's dtype), "int8", "fp8_e4m3"
    tensor_parallel_size: int
    kv_layer_shapes: tuple[tuple[int, int], ...] = ()   # (KV heads, head_dim) per KV-holding layer (Gemma 4)

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field (TP size aside) that differs, as "field: here vs there"; None when they agree."""
        for f in fields(self):
            if f.name != "tensor_parallel_size" and getattr(self, f.name) != getattr(other, f.name):
                return f"{f.name}: {getattr(self, f.name)!r} here, {getattr(other, f.name)!r} in the export"
        return None

    @property
    def rank_block_bytes(self) -> int:
        """Bytes of one block on one rank (``workers/kv_blocks.py``)."""
        storage = cache_dtype(self.kv_cache_dtype, getattr(torch, self.dtype))
        if len(set(self.kv_layer_shapes)) > 1:     # one tensor per head shape (workers/kv_cache.py), never 8-bit
            tp, element = self.tensor_parallel_size, torch.empty((), dtype=storage).element_size()
            return 2 * self.block_size * element * sum(max(1, h // tp) * d for h, d in self.kv_layer_shapes)
        heads = max(1, self.num_kv_heads // self.tensor_parallel_size)
        rows = (len(self.kv_layer_shapes) or self.num_layers) * 2 * self.block_size * heads
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(storage) else 0
        return rows * (self.head_dim * torch.empty((), dtype=storage).element_size() + scale)


@dataclass
class KVExport:
    """The KV of ``token_ids`` (whole blocks) in ``layout``, under the adapter namespace ``namespace`` (None:
    the base model). ``shards[r]``: rank r's bytes, ``len(token_ids) // block_size`` blocks of
    ``layout.rank_block_bytes`` (between replicas an ObjectRef of them: ``deploy/serve/kv_pull.py``)."""

    layout: KVLayout
    namespace: int | None
    token_ids: list[int]
    shards: list

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.layout.block_size


class Transfer:
    """One export or import in progress: ``result`` (a KVExport, or the tokens an import left cached) or
    ``error`` once ``done``."""

    def __init__(self) -> None:
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[Transfer], None]] = []

    def on_done(self, callback: Callable[[Transfer], None]) -> None:
        if self.done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def settle(self, result=None, error: BaseException | None = None) -> None:
        self.done, self.result, self.error = True, result, error
        for callback in self._callbacks:
            callback(self)
        self._callbacks = []


@dataclass
class _Export:
    transfer: Transfer
    blocks: list[int]
    token_ids: list[int]
    namespace: int | None
    sent: int = 0                      # blocks handed to plans
    received: int = 0                  # blocks whose bytes came back
    shards: list[list[bytes]] | None = None


@dataclass
class _Import:
    transfer: Transfer
    export: KVExport
    first: int                         # the export's block the first imported block is
    blocks: list[int]
    keys: list
    sent: int = 0
    written: int = 0


class KVTransfers:
    """The engine's exports and imports in progress (step thread only)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._exports: deque[_Export] = deque()
        self._imports: deque[_Import] = deque()
        self._in_plan: dict[int, tuple[_Export | None, int, int, _Import | None, int, int]] = {}

    @property
    def has_work(self) -> bool:
        return bool(self._exports or self._imports)

    @property
    def has_unsent(self) -> bool:
        """Chunks not handed to a plan yet."""
        return any(e.sent < len(e.blocks) for e in self._exports) or any(i.sent < len(i.blocks) for i in self._imports)

    def _blocks_per_plan(self, tp: int) -> int:
        return max(1, TRANSFER_BYTES_PER_PLAN // (tp * self.layout.rank_block_bytes))

    def start_export(self, bm: BlockManager, token_ids: list[int], namespace: int | None) -> Transfer:
        transfer = Transfer()
        root = None if namespace is None else namespace_root(namespace)
        blocks = bm.hold_cached_blocks(token_ids, root)
        tokens = list(token_ids[:len(blocks) * self.layout.block_size])
        if not blocks:
            transfer.settle(KVExport(self.layout, namespace, [], [b""] * self.layout.tensor_parallel_size))
        else:
            self._exports.append(_Export(transfer, blocks, tokens, namespace))
        return transfer

    def check(self, export: KVExport) -> None:
        """ValueError naming what makes ``export`` unusable here (nothing changes)."""
        if not isinstance(export, KVExport):
            raise ValueError(f"export: expected a KVExport, got {type(export).__name__}")
        problem = self.layout.mismatch(export.layout)
        if problem is not None:
            raise ValueError(f"export: its layout differs ({problem})")
        if len(set(self.layout.kv_layer_shapes)) > 1 and export.layout.tensor_parallel_size != \
                self.layout.tensor_parallel_size:   # workers/kv_blocks.reshard_rows refuses it
            raise ValueError("export: KV of several head shapes is not re-sharded across TP sizes "
                             f"(tensor_parallel_size {export.layout.tensor_parallel_size} there, "
                             f"{self.layout.tensor_parallel_size} here)")
        size = export.num_blocks * export.layout.rank_block_bytes
        if len(export.token_ids) % self.layout.block_size:
            raise ValueError(f"export: {len(export.token_ids)} tokens are not whole blocks of {self.layout.block_size}")
        if len(export.shards) != export.layout.tensor_parallel_size or any(
                not isinstance(shard, (bytes, bytearray)) or len(shard) != size for shard in export.shards):
            raise ValueError(f"export: expected {export.layout.tensor_parallel_size} shards of {size} bytes")

    def start_import(self, bm: BlockManager, export: KVExport) -> Transfer:
        self.check(export)
        transfer = Transfer()
        root = None if export.namespace is None else namespace_root(export.namespace)
        cached, blocks, keys = bm.start_import(export.token_ids, root, export.num_blocks)
        if not blocks:
            transfer.settle(cached * self.layout.block_size)
        else:
            self._imports.append(_Import(transfer, export, cached, blocks, keys))
        return transfer

    def fill(self, plan: StepPlan) -> None:
        """Puts the next chunk of the oldest export and of the oldest import into ``plan``."""
        export = next((e for e in self._exports if e.sent < len(e.blocks)), None)
        imp = next((i for i in self._imports if i.sent < len(i.blocks)), None)
        if export is None and imp is None:
            return
        e_from = e_to = i_from = i_to = 0
        if export is not None:
            e_from = export.sent
            per_plan = self._blocks_per_plan(self.layout.tensor_parallel_size)
            e_to = export.sent = min(len(export.blocks), e_from + per_plan)
            plan.kv_exports = export.blocks[e_from:e_to]
        if imp is not None:
            source = imp.export.layout
            i_from = imp.sent
            i_to = imp.sent = min(len(imp.blocks), i_from + self._blocks_per_plan(source.tensor_parallel_size))
            size = source.rank_block_bytes
            start, end = (imp.first + i_from) * size, (imp.first + i_to) * size
            plan.kv_imports = imp.blocks[i_from:i_to]
            plan.kv_import_shards = [bytes(shard[start:end]) for shard in imp.export.shards]
            plan.kv_import_tp = source.tensor_parallel_size
        self._in_plan[plan.step_id] = (export, e_from, e_to, imp, i_from, i_to)

    def finish(self, bm: BlockManager, plan: StepPlan, result: StepResult) -> None:
        """``plan``'s chunks came back: keeps an export's bytes, caches an import's blocks; settles what is whole."""
        entry = self._in_plan.pop(plan.step_id, None)
        if entry is None:
            return
        export, e_from, e_to, imp, i_from, i_to = entry
        if export is not None:
            self._receive(bm, export, e_to - e_from, result.kv_export)
        if imp is not None:
            bm.finish_import(imp.blocks[i_from:i_to], imp.keys[i_from:i_to])
            imp.written += i_to - i_from
            if imp.written == len(imp.blocks):
                self._imports.remove(imp)
                imp.transfer.settle((imp.first + len(imp.blocks)) * self.layout.block_size)

    def _receive(self, bm: BlockManager, export: _Export, count: int, shards: list[bytes]) -> None:
        size, tp = count * self.layout.rank_block_bytes, self.layout.tensor_parallel_size
        if len(shards) != tp or any(len(shard) != size for shard in shards):
            raise RuntimeError(f"kv_export: rank 0 sent {[len(s) for s in shards]} bytes, expected {tp} x {size}")
        export.shards = [[] for _ in range(tp)] if export.shards is None else export.shards
        for parts, shard in zip(export.shards, shards):
            parts.append(shard)
        export.received += count
        if export.received == len(export.blocks):
            self._exports.remove(export)
            bm.release_transfer(export.blocks)
            export.transfer.settle(KVExport(self.layout, export.namespace, export.token_ids,
                                            [b"".join(parts) for parts in export.shards]))

    def fail_all(self, bm: BlockManager | None, error: BaseException) -> None:
        """Fails every transfer in progress (a failed step, a rebuilt TP group). ``bm``: the block manager that
        stays (its holds are dropped); None when it goes with the lost cache."""
        exports, imports = list(self._exports), list(self._imports)
        self._exports.clear()
        self._imports.clear()
        self._in_plan.clear()
        for export in exports:
            if bm is not None:
                bm.release_transfer(export.blocks)
            export.transfer.settle(error=error)
        for imp in imports:
            if bm is not None:
                bm.release_transfer(imp.blocks[imp.written:])
            imp.transfer.settle(error=error)


def movable_requests(scheduler, request_ids: set[str], count: int) -> list[str]:
    """Up to ``count`` of ``request_ids`` that a rebalancing may move to another replica, best first: n=1 requests
    not finished; the waiting ones first (oldest first: they have waited longest), then the running ones with the
    most tokens left to generate (they gain the most from a less loaded replica)."""
    waiting, running = [], []
    for seq in list(scheduler.waiting) + list(scheduler.running):
        request = seq.request
        if request.request_id not in request_ids or request.params.n != 1 or seq.is_finished:
            continue
        if seq.status is SequenceStatus.WAITING:
            waiting.append(request.request_id)
        else:
            left = request.params.max_tokens - len(seq.output_token_ids)
            running.append((-left, len(running), request.request_id))
    return (waiting + [request_id for *_, request_id in sorted(running)])[:count]
