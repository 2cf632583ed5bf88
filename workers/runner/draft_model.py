"""The draft model of speculative decoding, on every TP rank (``speculative_model``; engine side:
``cluster/speculation.py``).

Each rank holds its shard of a small model with the target's vocabulary, sharded over the same TP group,
and a paged KV shard of its own beside the target's. That cache has as many blocks as the target's and
is addressed with the SAME block ids and tables: block b holds the draft's K/V of the tokens whose
target K/V are in the target's block b. So the engine's one allocator, prefix cache, copy-on-write and
speculative rollback cover both caches, and the plan needs no new field: a speculating sequence's
``draft_token_ids`` are ``MODEL_DRAFT`` placeholders (one per slot the scheduler reserved) that
``propose`` replaces with the draft model's tokens before the target forward of the same step.

A step, on every rank (same plan, same inputs, so the collectives line up):

1. One forward of the draft model over every scheduled sequence's own tokens of the step, starting
   where the draft's K/V end (``_seen``: after a step that accepted every draft, the last draft's K/V are
   in the target cache only, so that sequence runs 2 tokens). A speculating sequence takes its first
   draft from the logits at its last own token.
2. Passes 2..k: each speculating sequence that wants more runs its previous draft (one token) and takes
   the next. Drafts are greedy: the argmax of the gathered logits on rank 0, broadcast to the others.

Positions the draft has computed: ``_seen[seq]`` (the draft's K/V are valid for positions below
``min(_seen, num_computed_tokens)``, since the drafts it ran past the accepted ones were rejected). A
sequence not seen before (new, re-admitted, forked) starts at its ``num_computed_tokens``: blocks from the
prefix cache or a parent carry the draft's K/V too, because every token the target computes goes through
the draft in step 1. One exception, left as is: a sequence that finished right after a step that accepted
every draft leaves the draft's K/V of its last draft unwritten; a later prefix hit on that block gets
worse drafts there, never wrong output (verification is exact whatever the drafts are).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from pagedray.kernels import kv_quant

from ..contract.config import EngineConfig
from ..contract.wire import MODEL_DRAFT
from ..kv_cache import copy_blocks
from ..models.decoder import DecoderForCausalLM
from ..models.model_info import load_hf_config
from ..models.model_loading import kv_cache_spec, load_model, pack_for_cpu, settle_cpu_decode
from ..models.registry import model_class
from ..sampling.sampling_ops import argmax_rows
from ..tp_group import TPGroup
from ..weights.default_model import resolve_model_path
from .input_batch import build_host_batch
from .model_runner import ModelRunner
from .seq_mirror import BatchedSequence


class DraftModel:
    def __init__(self, model: str, config: EngineConfig, target: DecoderForCausalLM, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        try:
            model_path = str(resolve_model_path(model))
            hf_config = load_hf_config(model_path)
            model_class(hf_config).validate_config(hf_config, max_model_len, tp.world_size)
        except ValueError as exc:     # the model's own checks, said of this option
            raise ValueError(f"speculative_model: {exc}") from exc
        self.model, _, _ = load_model(model_path, hf_config, "auto", dtype, device, max_model_len, lambda: tp)
        vocab, target_vocab = self.model.dims.vocab_size, target.dims.vocab_size
        if vocab > target_vocab:
            raise ValueError(f"speculative_model: its vocabulary ({vocab} tokens) is larger than the target "
                             f"model's ({target_vocab}); the draft model must share the target's tokenizer")
        pack_for_cpu(self.model, config.model, config.scheduler.max_num_seqs, dtype, device)
        self.kv_spec = kv_cache_spec(self.model, config.cache.block_size,
                                     kv_quant.cache_dtype(config.cache.kv_cache_dtype, dtype))
        self.tp = tp
        self.device = device
        self.runner: ModelRunner | None = None     # the draft's forward over its own cache (init_kv_cache)
        self._seen: dict[int, int] = {}            # seq id -> positions whose draft K/V were computed

    def init_kv_cache(self, num_blocks: int) -> None:
        """The draft's cache: as many blocks as the target's, the same ids."""
        kv_cache = self.kv_spec.allocate(num_blocks, self.device)
        settle_cpu_decode(self.model, kv_cache, self.kv_spec.block_size)
        self.runner = ModelRunner(self.model, kv_cache, self.kv_spec.block_size, self.device)

    def apply_plan_bookkeeping(self, released_seq_ids: list[int], block_copies: list[tuple[int, int]]) -> None:
        """What a plan changes before its forward: released sequences forgotten, copy-on-write copies made
        in the draft's cache too."""
        for seq_id in released_seq_ids:
            self._seen.pop(seq_id, None)
        copy_blocks(self.runner.kv_cache, block_copies)

    @torch.inference_mode()
    def propose(self, batch: list[BatchedSequence]) -> list[BatchedSequence]:
        """``batch`` (the target's, in order) with every ``MODEL_DRAFT`` placeholder replaced by a draft token."""
        if not batch:
            return batch
        wanted = [sum(d == MODEL_DRAFT for d in item.draft_token_ids) for item in batch]
        drafts: list[list[int]] = [[] for _ in batch]
        rows = []
        for item, k in zip(batch, wanted):
            state = item.state
            end = state.num_computed_tokens + item.num_own_tokens
            start = min(self._seen.get(state.seq_id, state.num_computed_tokens), state.num_computed_tokens)
            rows.append(BatchedSequence(replace(state, num_computed_tokens=start), end - start, k > 0))
            self._seen[state.seq_id] = end
        speculating = [i for i, k in enumerate(wanted) if k]
        for i, token in zip(speculating, self._greedy(rows)):
            drafts[i].append(token)
        for step in range(1, max(wanted)):
            more = [i for i in speculating if wanted[i] > step]
            rows = []
            for i in more:          # the previous draft, at the position after the tokens before it
                state = batch[i].state
                seen = replace(state, output_token_ids=state.output_token_ids + drafts[i],
                               num_computed_tokens=state.num_tokens + step - 1)
                rows.append(BatchedSequence(seen, 1, True))
                self._seen[state.seq_id] = state.num_tokens + step
            for i, token in zip(more, self._greedy(rows)):
                drafts[i].append(token)
        return [replace(item, draft_token_ids=tuple(d)) if k else item
                for item, k, d in zip(batch, wanted, drafts)]

    def _greedy(self, rows: list[BatchedSequence]) -> list[int]:
        """One draft forward over ``rows``; the argmax token of each sampling row, the same on every rank."""
        host = build_host_batch(rows, self.kv_spec.block_size, pin_memory=self.device.type == "cuda")
        self.runner.check_host_metadata(host)
        logits = self.runner.forward(host.to_device(self.device)).logits      # [sampling rows, vocab] on rank 0
        num = host.shape.logits
        if num == 0:
            return []
        tokens = (argmax_rows(logits) if self.tp.is_first
                  else torch.empty(num, dtype=torch.int64, device=self.device))   # [sampling rows]
        return self.tp.broadcast_from_first(tokens).tolist()
