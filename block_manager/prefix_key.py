"""Content keys of full KV blocks for the prefix cache.

A full block's key chains its parent block's key with the block's own token ids. Two blocks have
equal keys exactly when every token of their whole prefix is equal.

Decisions: docs/design/block_manager.md, ``pagedray.block_manager.prefix_key``.
"""

from __future__ import annotations

# the first block's parent in the chained hash: a fixed int, since hash(None) is an address on Python 3.11
# (it differs between processes, and a router in another process compares these hashes)
ROOT_HASH = 0x5EED


class BlockKey:
    """Identity of the contents of one full block together with its whole prefix.

    Invariant: ``parent is None`` exactly for the first block of a sequence.
    """

    __slots__ = ("parent", "token_ids", "_hash")

    def __init__(self, parent: BlockKey | None, token_ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self._hash = hash((ROOT_HASH if parent is None else parent._hash, token_ids))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        left: BlockKey | None = self
        right: BlockKey | None = other
        while left is not right:
            if left is None or right is None:
                return False
            if left._hash != right._hash or left.token_ids != right.token_ids:
                return False
            left, right = left.parent, right.parent
        return True

    def depth(self) -> int:
        """Number of blocks in the chain ending at this key (1 for a root key; a ``namespace_root`` is no
        block and counts 0)."""
        count = 0
        key: BlockKey | None = self
        while key is not None:
            count += not is_namespace_root(key)
            key = key.parent
        return count

    def __repr__(self) -> str:
        return f"BlockKey(depth={self.depth()}, tokens={self.token_ids!r})"


def namespace_root(namespace: int) -> BlockKey:
    """The parent of the first block of every sequence in ``namespace`` (a LoRA adapter's identity): its
    chains, hashes and keys differ from the base model's and from every other namespace's, so their blocks
    are never shared. It is no block (no pool entry); its token ids are (-1, namespace), and no real token id
    is negative."""
    return BlockKey(None, (-1, namespace))


def is_namespace_root(key: BlockKey) -> bool:
    return key.parent is None and len(key.token_ids) == 2 and key.token_ids[0] == -1


def prefix_block_hashes(token_ids, block_size: int, namespace: int | None = None) -> list[int]:
    """Hashes of the chained keys of every full block of ``token_ids``, first block first: what
    ``BlockManager.cached_prefix_hashes`` reports for the same blocks once they are cached (``namespace``:
    the chains of a LoRA adapter's sequences, ``namespace_root``). Deterministic across processes (tuples of
    ints are not hash-randomised), so a router in another process can compare a prompt with a replica's
    cache (``pagedray.deploy.routing.router``)."""
    hashes: list[int] = []
    key: BlockKey | None = None if namespace is None else namespace_root(namespace)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = BlockKey(key, tuple(token_ids[start:start + block_size]))
        hashes.append(hash(key))
    return hashes

