"""How attention heads, MLP columns and the vocabulary are split across tensor-parallel ranks.

Heads: query heads are split evenly, rank r gets ``[r * hq / tp, (r + 1) * hq / tp)``.
KV heads are split evenly when ``num_kv_heads >= tp``; when there are fewer KV heads than ranks,
each rank holds exactly one KV head, the one its query heads attend with (query head h uses KV
head ``h // (hq / hkv)``), so KV heads are replicated ``tp / hkv`` times. Anything that does not
divide is rejected with a ValueError naming tensor_parallel_size.

Vocabulary: split into ``tp`` contiguous ranges of ``ceil(vocab / tp)`` rows (the last range may be
shorter; its local weight is zero-padded to the common size so that shards gather evenly).
"""

from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HeadPartition:
    num_heads: int
    num_kv_heads: int
    tp_size: int
    rank: int

    def __post_init__(self) -> None:
        check_head_split(self.num_heads, self.num_kv_heads, self.tp_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        return self.rank * self.num_local_heads

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.tp_size:
            return self.rank * self.num_local_kv_heads
        # replicated: the KV head that this rank's query heads share
        return self.first_head // (self.num_heads // self.num_kv_heads)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError (naming tensor_parallel_size) when the heads cannot be split over tp_size."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"model: num_attention_heads={num_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    if num_heads % tp_size != 0:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_attention_heads={num_heads}")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size != 0:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads={num_kv_heads} "
                         "(or be a multiple of it, to replicate KV heads)")
    if num_kv_heads < tp_size and tp_size % num_kv_heads != 0:
        raise ValueError(f"tensor_parallel_size={tp_size} must be a multiple of num_key_value_heads="
                         f"{num_kv_heads} to replicate KV heads")


def check_even_split(size: int, tp_size: int, name: str) -> int:
    """size // tp_size, or ValueError naming tensor_parallel_size and the model dimension."""
    if size % tp_size != 0:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide {name}={size}")
    return size // tp_size


@dataclass(frozen=True)
class VocabPartition:
    vocab_size: int
    tp_size: int
    rank: int

    @property
    def rows_per_rank(self) -> int:
        return _ceil_div(self.vocab_size, self.tp_size)

    @property
    def start(self) -> int:
        return min(self.rank * self.rows_per_rank, self.vocab_size)

    @property
    def end(self) -> int:
        return min(self.start + self.rows_per_rank, self.vocab_size)
