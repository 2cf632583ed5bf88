"""pagedray.block_manager: the global paged-KV block allocator (pure Python, no torch).

- ``BlockManager``: the only owner of sequence -> block table (allocate / fork / free,
  slot mapping, prefix cache, stats, invariant checks).
- ``BlockPool``: ref-counted blocks, the free queue in eviction order, the prefix-cache map.
- ``BlockKey``: chained content key of a full block.
- ``SessionPins``: the blocks of each session's last prompt and output, evicted last until their TTL.
- Errors: ``BlockManagerError`` and its subclasses (see ``errors``).

Benchmark (from a checkout): ``python -m benchmarks.block_manager``.
"""

from .block_pool import BlockPool
from .errors import (
    BlockManagerError,
    CannotAllocateError,
    DoubleFreeError,
    SequenceExistsError,
    UnknownSequenceError,
)
from .free_queue import FreeBlockQueue
from .manager import BlockManager
from .prefix_key import BlockKey, namespace_root, prefix_block_hashes
from .records import Allocation, BlockManagerStats
from .session_pins import SessionPins

__all__ = [
    "Allocation",
    "BlockKey",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "BlockPool",
    "CannotAllocateError",
    "DoubleFreeError",
    "FreeBlockQueue",
    "SequenceExistsError",
    "SessionPins",
    "UnknownSequenceError",
    "namespace_root",
    "prefix_block_hashes",
]
