"""Requests and sequences: the scheduler's view of the work.

A ``Request`` is what a caller submits (one prompt, one SamplingParams, a priority). It owns one
``Sequence`` per sample (``params.n`` of them). Token bookkeeping lives on the Sequence:

- ``token_ids`` = prompt + output tokens known so far.
- ``num_computed_tokens``: tokens whose K/V are in the paged cache (steps whose results were applied).
  The tokens still to compute are ``token_ids[num_computed_tokens:]``; a sequence samples a new token
  in a step after which every known token is computed (so a decoding sequence always has exactly one
  uncomputed token: the one it sampled last).
- ``num_in_flight``: tokens scheduled in steps whose results have not been applied yet, and
  ``num_pending``: tokens those steps will sample, not known yet. Both are 0 between steps of the
  synchronous engine; with async scheduling (``async_scheduling``) the next step is scheduled
  while one runs, so a decoding sequence computes its pending token at the next step
  (``computable_tokens`` counts it).

Decisions: docs/design/cluster.md, ``pagedray.cluster.request``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import PooledPart, PromptLogprobs

from .outputs import TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS or a stop token id
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # a sample could not be drawn (its own failure), or the engine failed


def sibling_seed(seed: int, index: int) -> int:
    """``seed + index`` wrapped into int64 (two's complement), as the wire and the tensors hold seeds."""
    return (seed + index + 2**63) % 2**64 - 2**63


@dataclass(eq=False)
class Sequence:
    """One sample of a request. Identity-compared; ``seq_id`` is unique within an engine."""

    seq_id: int
    request: Request
    index: int                       # sample index within the request, 0 .. n-1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # logprobs of the sampled tokens (only filled when the request asked for them), from output token
    # ``num_resumed`` on
    output_logprobs: list = field(default_factory=list)
    # output tokens the request had produced elsewhere before it was resumed here (a failover's
    # continuation): computed like a prompt's, never streamed again, no logprobs
    num_resumed: int = 0
    num_in_flight: int = 0           # tokens scheduled in steps not applied yet
    lora_slot: int = -1              # while running with an adapter: the slot it holds a reference on
    num_pending: int = 0             # tokens those steps sample (ids not known yet)
    kv_blocks: int = 0               # KV blocks it held at ``kv_since`` (the scheduler's ``_kv_mark``)
    kv_since: float = 0.0
    # a hybrid model's prefill: the positions (block ends) still to take a prefix-cache state snapshot at, from
    # its registration (``Allocation.snapshot_points``; block_manager/state_pool.py)
    snapshot_points: tuple[int, ...] = ()
    # the OutputBuilder's cursor: output tokens streamed so far (from ``num_resumed``), and whether the
    # finish was streamed
    num_streamed: int = field(init=False)
    finish_streamed: bool = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    def __post_init__(self) -> None:
        self.num_streamed = self.num_resumed
        # prompt + output tokens, maintained by append_token (read on every step: no re-concatenation, and a
        # plain attribute, not a property: the scheduler and the plan builder read it per sequence per step).
        # A live list: do not mutate.
        self.token_ids: list[int] = self.request.prompt_token_ids + self.output_token_ids
        params = self.request.params
        # sample i of a seeded request samples with seed + i (vLLM's rule): the n choices differ and
        # each one is reproducible on its own; the sum wraps like int64 arithmetic, so a seed near
        # INT64_MAX stays a valid seed (it once raised while forking, inside the engine's step)
        seeded_sibling = params.seed is not None and self.index > 0
        self.params = replace(params, seed=sibling_seed(params.seed, self.index)) if seeded_sibling else params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def must_fork_first(self) -> bool:
        """The parent of an n > 1 request that has not forked its siblings yet."""
        return self.index == 0 and self.request.num_unforked > 0

    @property
    def num_scheduled_through(self) -> int:
        """Tokens computed or scheduled in a step in flight: where the next scheduled chunk starts."""
        return self.num_computed_tokens + self.num_in_flight

    def computable_tokens(self) -> int:
        """Tokens this sequence may schedule now (pending ones included): up to the fork point for an
        unforked parent."""
        if self.must_fork_first:
            return max(0, self.request.fork_at - self.num_scheduled_through)
        return self.num_tokens + self.num_pending - self.num_scheduled_through

    def reset_computed(self) -> None:
        """Preemption / KV loss: nothing computed, nothing in flight counts any more."""
        self.num_computed_tokens = 0
        self.num_in_flight = 0
        self.num_pending = 0


@dataclass(eq=False)
class Request:
    """A caller's request. ``arrival`` is a strictly increasing admission counter (ties impossible)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    priority: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    # number of samples still to fork from sequence 0 (n - 1 until the fork happens)
    num_unforked: int = 0
    # prompt tokens reported as prefix-cache hits (first admission of sample 0)
    num_cached_prompt_tokens: int = 0
    # one entry per prompt token when params.prompt_logprobs is set (see the module docstring)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    added_at: float = field(default_factory=time.monotonic)   # when the scheduler took it in
    queue_time_s: float | None = None   # added_at -> first admission of sample 0
    error: str | None = None            # why the request ended with finish_reason "error", for its caller
    num_finished: int = 0               # samples FINISHED (the scheduler's ``_finish`` counts them)
    streamed: bool = False              # its first output (the one with the prompt) was built
    lora: LoRARequest | None = None      # the LoRA adapter its samples run with (None: the base model)
    session: str | None = None           # its session: sample 0's blocks are pinned when it finishes
    tenant: str | None = None            # its tenant (cluster/fair_share.py; None: the default tenant)
    kv_block_seconds: float = 0.0        # KV blocks its samples held, integrated over the scheduler's clock
    # a pooling request (params.pooling): the parts so far (workers/runner/pooling.py). "mean": the sum of the hidden
    # rows of prompt positions [0, pooled_count); "last": the last position's row (pooled_count = prompt length)
    pooled_sum: list[float] | None = None
    pooled_count: int = 0
    pooled_logits: list[float] | None = None

    def record_prompt_logprobs(self, entry: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        end = entry.first_index + len(entry.logprobs)
        if entry.first_index < 1 or end > len(self.prompt_token_ids):
            raise RuntimeError(f"prompt logprobs for positions [{entry.first_index}, {end}) of a "
                               f"{len(self.prompt_token_ids)}-token prompt")
        for j, logprob in enumerate(entry.logprobs):
            i = entry.first_index + j
            if self.prompt_logprobs[i] is None:
                top = entry.top_logprobs[j] if entry.top_logprobs is not None else []
                self.prompt_logprobs[i] = TokenLogprob(self.prompt_token_ids[i], logprob, list(top), entry.ranks[j])

    @property
    def needs_every_position(self) -> bool:
        """Prompt logprobs and mean pooling read every prompt position's result: the prefix cache (and its second
        tier) cannot serve any of its positions."""
        return self.params.prompt_logprobs is not None or self.params.pooling == "mean"

    def record_pooled(self, part: PooledPart) -> None:
        """Adds a step's pooling part; a "mean" part at position 0 starts the sum again (a recomputation)."""
        if self.params.pooling == "mean":
            if part.start == 0:
                self.pooled_sum, self.pooled_count = [0.0] * len(part.values), 0
            if self.pooled_sum is None or part.start != self.pooled_count:
                raise RuntimeError(f"pooled part for positions [{part.start}, {part.start + part.count}) after "
                                   f"{self.pooled_count} positions")
            self.pooled_sum = [a + b for a, b in zip(self.pooled_sum, part.values)]
            self.pooled_count += part.count
        else:
            self.pooled_sum, self.pooled_count = list(part.values), len(self.prompt_token_ids)
        if part.logits:
            self.pooled_logits = list(part.logits)

    def pooled_result(self) -> list[float] | None:
        """The pooled hidden state once every prompt position is in (the mean, or the last row); else None."""
        if self.pooled_sum is None or self.pooled_count != len(self.prompt_token_ids):
            return None
        if self.params.pooling == "mean":
            return [value / self.pooled_count for value in self.pooled_sum]
        return list(self.pooled_sum)

    @property
    def fork_at(self) -> int:
        return len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        """Every sample forked and finished (a count kept by the scheduler, not a walk over the samples:
        this is read for every request with news at every step)."""
        return self.num_unforked == 0 and self.num_finished == len(self.sequences)
