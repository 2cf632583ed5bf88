"""Vocab-parallel token embedding and LM head.

Decision (LM head): **vocab-parallel, gathered to rank 0**. Each rank holds ``ceil(vocab / tp)``
rows of the embedding / LM-head matrix, computes the logits of its vocabulary range for the
sampling positions only, and ``TPGroup.gather_to_first`` concatenates them on rank 0 (the only rank
that samples); other ranks get None. This keeps the largest matrix of small models sharded and moves
only ``num_sampling_rows x vocab`` floats per step. With tied embeddings the LM head reuses the
embedding's local shard (same Parameter), which has exactly the rows it needs.

Embedding lookup: tokens outside this rank's range read a zero row; an all-reduce sums the
partial embeddings (exactly one rank contributes a non-zero row per token, so the sum is exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import empty_param
from .packed_gemm import PackedLinear, linear
from .partition import VocabPartition


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.part = VocabPartition(vocab_size, tp.world_size, tp.rank)
        # [rows_per_rank, hidden]; rows past part.end (last rank only) stay zero
        self.weight = empty_param((self.part.rows_per_rank, hidden_size), dtype, device)

    def load(self, reader: CheckpointReader, name: str) -> None:
        value = reader.read(name, 0, self.part.start, self.part.end,
                            expect_shape=[self.vocab_size, self.hidden_size])
        n = self.part.end - self.part.start
        self.weight[n:].zero_()
        copy_into(self.weight[:n], value, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [tokens] -> [tokens, hidden]
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= self.part.end - self.part.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """hidden [rows, hidden] -> logits [rows, vocab] float32 on rank 0, None on other ranks."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.tp = embedding.tp
        self.part = embedding.part
        self.vocab_size = embedding.vocab_size
        self.hidden_size = embedding.hidden_size
        self.tied = tied
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = empty_param(tuple(embedding.weight.shape), embedding.weight.dtype,
                                      embedding.weight.device)
        self.packed_weight: PackedLinear | None = None   # packed copies and plan (CPU fp32/bf16, packed_gemm.py)

    def load(self, reader: CheckpointReader, name: str) -> None:
        if self.tied:
            return
        value = reader.read(name, 0, self.part.start, self.part.end,
                            expect_shape=[self.vocab_size, self.hidden_size])
        n = self.part.end - self.part.start
        self.weight[n:].zero_()
        copy_into(self.weight[:n], value, name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = linear(hidden, self.weight, None, self.packed_weight).float()   # [rows, rows_per_rank]
        logits = self.tp.gather_to_first(local)                 # [rows, tp * rows_per_rank] on rank 0
        if logits is None:
            return None
        return logits[:, : self.vocab_size]
