"""StepPlan and StepResult: the only things that cross the engine -> worker boundary.

The engine sends one StepPlan per step to every TP rank; rank 0 alone answers with a StepResult.
Both are plain dataclasses encoded with msgpack (no pickle, no extension types, size-capped), so a
worker can never be made to run code by a message and a corrupt message fails loudly.

A plan describes the batch of one forward pass. The batch order is ``decodes``, then ``running``, then
``new_seqs``; results come back in that order for the sequences that sample.

Worker-side mirror (what every rank keeps per sequence id, updated only from plans):
``token_ids`` (prompt + output tokens known so far), ``num_computed_tokens`` (tokens whose K/V are
in the cache), ``block_ids`` and the sampling params.

- ``NewSequence``: a sequence the workers have not seen (first admission, re-admission after a
  preemption, or a forked sample of an ``n > 1`` request). It carries everything in full.
  ``num_computed_tokens`` counts tokens whose K/V are already in the cache (prefix-cache hit, or
  blocks shared with a parent at fork).
- ``RunningDelta``: a sequence the workers already mirror. ``new_token_id`` is the token sampled at
  the previous step (append it to the mirror first), or None while the sequence is still in prefill.
  ``PENDING_TOKEN`` (-1) stands for the token that the immediately preceding plan sampled for this
  sequence, which the engine does not know yet (async scheduling, TP=1): the sampling rank
  appends the token it drew itself.
  ``new_block_ids`` extend the block table, after it is cut to its first ``num_kept_blocks`` blocks when
  that is set (blocks given back after rejected drafts, or a last block replaced by its copy).
  ``accepted_token_ids``: drafts of the previous step that
  were accepted (their K/V are in the cache already): append them, and count them as computed, before
  ``new_token_id``. ``draft_token_ids``: speculative tokens computed this step after the sequence's own
  tokens (the last ``len(draft_token_ids)`` of ``num_scheduled_tokens``); they are not appended, and a
  sampling sequence samples at each of their positions as well (cluster/speculation.py). A
  ``NewSequence`` may carry drafts too (a forked sample's first decode). With a draft model on the
  ranks (``speculative_model``) the drafts are ``MODEL_DRAFT`` (-2) placeholders, all of a sequence's or
  none: each rank's draft model fills them in before the forward (the engine learns the accepted ones
  from the result, as ever).
- ``DecodeRows`` (``plan.decodes``): the steady decode, column by column. A mirrored sequence that computes
  exactly one token this step, the one sampled at its previous step (``token_ids``, or ``PENDING_TOKEN``), and
  samples after it: no drafts, no accepted drafts, no cut of its table, at most one new block (rows listed
  in ``grown``, with the block in ``new_block_ids``). It means what a ``RunningDelta`` with those fields would
  mean; columns instead of one object per sequence keep the engine's plan, the wire and the worker's
  inputs free of per-sequence objects in the step that dominates serving (benchmarks.host_step).
- In both, ``num_scheduled_tokens`` tokens are computed this step, starting at
  ``num_computed_tokens``: the tokens ``token_ids[num_computed : num_computed + num_scheduled]``.
  A sequence samples a token when, after this step, every known token is computed.
- ``released_seq_ids``: sequences finished, aborted or preempted since the last plan; the workers
  drop their mirrors (applied before anything else in the plan).
- ``block_copies``: (src, dst) block pairs to copy in every layer's K and V before the forward
  (copy-on-write at fork/truncate). ``state_copies``: the same for a hybrid model's state slots (a forked
  sample starts from its parent's recurrent and convolution state, a prefix hit's seat from the snapshot at
  the hit); a ``NewSequence``'s ``state_slot`` names the slot its linear-attention layers read and write for as
  long as it is mirrored. ``state_snapshots``: (seat, position, snapshot slot): during the forward, the state
  the sequence in that seat reaches after its first ``position`` tokens (one of this step's) is copied to the
  snapshot slot (a hybrid model's prefix cache).
- ``lora_loads``: LoRA adapters to copy into slots before the forward, each from the rank's host copy (read
  earlier, off the step: ``lora_reads``); a ``NewSequence``'s ``lora_slot`` names the slot its tokens use for
  as long as it is mirrored (-1: the base model).
- ``kv_saves`` / ``kv_loads``: the second KV tier (``workers/kv_tier.py``): evicted blocks whose bytes go to a
  tier slot (applied first of all), and tier slots whose bytes come back into a block (after the saves);
  rank 0's result lists the slots that failed to load (on any rank).
- ``kv_exports`` / ``kv_imports``: moving blocks between replicas (``cluster/kv_transfers.py``): every rank
  reads the exported blocks (after the tier's saves, before anything writes) and rank 0's result carries each
  rank's bytes (``kv_export``, one entry per rank, ``workers/kv_blocks.py``'s layout); the imported blocks are
  written after the tier's loads, from ``kv_import_shards`` (one entry per rank of the source replica, whose TP
  size is ``kv_import_tp``: every rank receives every shard and takes or re-shards its own heads).
- ``lora_reads`` / ``lora_drops``: adapters each rank starts reading into host memory on a thread of its own
  (the step does not wait for them) / forgets from host memory; applied after ``lora_loads``. The engine
  decides which adapters are held (``max_cpu_loras``), so every rank holds the same ones.

A result carries one ``SampledToken`` per sampling sequence, in batch order; a sequence with drafts
has one per accepted draft first, then the step's own token, in position order (a row rank 0 could not
sample carries ``error`` instead of a real token: the failure is that request's, not the step's), and one
``PromptLogprobs`` per sequence that asked for prompt logprobs and computed prompt positions this step,
and one ``LoraRead`` per adapter read that rank 0 finished since its last result (``error`` when the files
could not be read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from .sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
PENDING_TOKEN = -1   # RunningDelta.new_token_id: "the token you sampled for it at the previous step"
MODEL_DRAFT = -2     # in draft_token_ids: "a draft your draft model proposes in this step" (runner/draft_model.py)


class WireError(ValueError):
    """A message that is not a well-formed, size-capped plan or result."""


@dataclass
class NewSequence:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    draft_token_ids: list[int] = field(default_factory=list)   # as RunningDelta's
    lora_slot: int = -1        # the LoRA adapter slot its tokens use (a ``LoraLoad`` filled it); -1: none
    state_slot: int = -1       # its slot of a hybrid model's state pool (-1: the model has none)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class RunningDelta:
    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    new_token_id: int | None = None
    accepted_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    num_kept_blocks: int | None = None


@dataclass
class DecodeRows:
    """Plain decodes, one token each (module doc): ``seq_ids[i]`` appends ``token_ids[i]`` and computes it;
    row ``grown[j]`` (an index into ``seq_ids``, increasing) first extends its table by ``new_block_ids[j]``."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    grown: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass
class LoraLoad:
    """Before this step's forward, adapter ``name`` (PEFT files at ``path``, readable on every rank) goes into
    LoRA slot ``slot``, replacing whatever was there (workers/lora/model_lora.py)."""

    slot: int
    name: str
    path: str


@dataclass
class LoraFiles:
    """An adapter's identity on the ranks: ``name`` served from the PEFT folder ``path``."""

    name: str
    path: str


@dataclass
class LoraRead:
    """Rank 0 finished reading adapter ``name`` from ``path`` into host memory (``error``: why it could not)."""

    name: str
    path: str
    error: str | None = None


@dataclass
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    running: list[RunningDelta] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    decodes: DecodeRows = field(default_factory=DecodeRows)
    lora_loads: list[LoraLoad] = field(default_factory=list)
    lora_reads: list[LoraFiles] = field(default_factory=list)
    lora_drops: list[LoraFiles] = field(default_factory=list)
    kv_saves: list[tuple[int, int]] = field(default_factory=list)     # (block, tier slot): before anything else
    kv_loads: list[tuple[int, int]] = field(default_factory=list)     # (tier slot, block): after the saves
    kv_exports: list[int] = field(default_factory=list)               # blocks whose bytes rank 0's result carries
    kv_imports: list[int] = field(default_factory=list)               # blocks written from kv_import_shards
    kv_import_shards: list[bytes] = field(default_factory=list)       # per source rank: [imports, its block bytes]
    kv_import_tp: int = 0                                             # the source replica's TP size
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots, before the forward
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)   # (seat, position, slot), during it

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            r.num_scheduled_tokens for r in self.running)


@dataclass(slots=True)    # one per sampling row and step
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    # (token_id, logprob) pairs, best first; None unless the sequence asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None
    # set when this row could not be sampled (non-finite logits, its grammar failed): the sequence's
    # request ends with finish_reason "error" and this short message; token_id is then a placeholder
    error: str | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens ``first_index ..`` of one sequence (params.prompt_logprobs), computed
    this step: per token its logprob, its rank, and the k best (token_id, logprob) pairs (None for k=0)."""

    seq_id: int
    first_index: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PooledPart:
    """A pooling sequence's part of a step (workers/runner/pooling.py): prompt positions ``[start, start +
    count)``; ``values`` their hidden rows summed ("mean") or the last one ("last"); ``logits`` of the request's
    ``pooling_token_ids`` at the last prompt position when this part ends there ([] otherwise)."""

    seq_id: int
    start: int
    count: int
    values: list[float]
    logits: list[float] = field(default_factory=list)


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    lora_reads: list[LoraRead] = field(default_factory=list)
    kv_load_failures: list[int] = field(default_factory=list)   # tier slots of this plan's kv_loads that failed
    kv_load_seconds: float = 0.0    # how long rank 0 took to read this plan's kv_loads (the tier's measured cost)
    kv_export: list[bytes] = field(default_factory=list)   # per rank: the plan's kv_exports, [exports, block bytes]
    pooled: list[PooledPart] = field(default_factory=list)


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} is not allowed on the wire")


def _pack(obj: dict) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    return data


def _unpack(data: bytes) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise WireError(f"corrupt message: {exc}") from exc
    if not isinstance(obj, dict):
        raise WireError(f"expected a map at the top level, got {type(obj).__name__}")
    return obj


def encode_plan(plan: StepPlan) -> bytes:
    # the dataclasses' own dicts, read by msgpack and never changed: ``asdict`` deep-copied every delta (2.6 ms
    # for a 256-sequence decode plan on the 2-core VM, benchmarks.host_step's "wire")
    obj = {"step_id": plan.step_id,
           "new_seqs": [{**vars(new), "sampling_params": new.sampling_params.to_dict()} for new in plan.new_seqs],
           "running": [vars(delta) for delta in plan.running],
           "released_seq_ids": plan.released_seq_ids, "block_copies": plan.block_copies,
           "decodes": vars(plan.decodes), "lora_loads": [vars(load) for load in plan.lora_loads]}
    if plan.kv_saves or plan.kv_loads:
        obj["kv_saves"], obj["kv_loads"] = plan.kv_saves, plan.kv_loads
    if plan.kv_exports:
        obj["kv_exports"] = plan.kv_exports
    if plan.kv_imports:
        obj["kv_imports"], obj["kv_import_shards"] = plan.kv_imports, plan.kv_import_shards
        obj["kv_import_tp"] = plan.kv_import_tp
    if plan.lora_reads or plan.lora_drops:
        obj["lora_reads"], obj["lora_drops"] = list(map(vars, plan.lora_reads)), list(map(vars, plan.lora_drops))
    if plan.state_copies:
        obj["state_copies"] = plan.state_copies
    if plan.state_snapshots:
        obj["state_snapshots"] = plan.state_snapshots
    return _pack(obj)


def decode_plan(data: bytes) -> StepPlan:
    obj = _unpack(data)
    try:
        new_seqs = []
        for new in obj["new_seqs"]:
            new = dict(new)
            new["sampling_params"] = SamplingParams.from_dict(new["sampling_params"])
            new_seqs.append(NewSequence(**new))
        return StepPlan(
            step_id=obj["step_id"],
            new_seqs=new_seqs,
            running=[RunningDelta(**r) for r in obj["running"]],
            released_seq_ids=list(obj["released_seq_ids"]),
            block_copies=[(int(s), int(d)) for s, d in obj["block_copies"]],
            decodes=_decode_rows(obj["decodes"]),
            lora_loads=[_lora_load(load) for load in obj.get("lora_loads", [])],
            lora_reads=[_lora_files(files, "lora_reads") for files in obj.get("lora_reads", [])],
            lora_drops=[_lora_files(files, "lora_drops") for files in obj.get("lora_drops", [])],
            kv_saves=_int_pairs(obj.get("kv_saves", []), "kv_saves"),
            kv_loads=_int_pairs(obj.get("kv_loads", []), "kv_loads"),
            kv_exports=_ints(obj.get("kv_exports", []), "kv_exports"),
            kv_imports=_ints(obj.get("kv_imports", []), "kv_imports"),
            kv_import_shards=_byte_strings(obj.get("kv_import_shards", []), "kv_import_shards"),
            kv_import_tp=_count(obj.get("kv_import_tp", 0), "kv_import_tp"),
            state_copies=_int_pairs(obj.get("state_copies", []), "state_copies"),
            state_snapshots=_int_triples(obj.get("state_snapshots", []), "state_snapshots"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed StepPlan: {exc}") from exc


def _lora_load(obj: dict) -> LoraLoad:
    load = LoraLoad(**obj)
    if type(load.slot) is not int or not isinstance(load.name, str) or not isinstance(load.path, str):  # noqa: E721
        raise ValueError("lora_loads: slot must be an integer, name and path strings")
    return load


def _int_pairs(pairs: list, field_name: str) -> list[tuple[int, int]]:
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(type(v) is int for v in p) for p in pairs):  # noqa: E721
        raise ValueError(f"{field_name}: must be a list of integer pairs")
    return [(p[0], p[1]) for p in pairs]


def _int_triples(triples: list, field_name: str) -> list[tuple[int, int, int]]:
    if not all(isinstance(t, (list, tuple)) and len(t) == 3 and all(type(v) is int for v in t) for t in triples):  # noqa: E721
        raise ValueError(f"{field_name}: must be a list of integer triples")
    return [(t[0], t[1], t[2]) for t in triples]


def _ints(values: list, field_name: str) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):  # noqa: E721
        raise ValueError(f"{field_name}: must be a list of integers")
    return values


def _count(value: object, field_name: str) -> int:
    if type(value) is not int or value < 0:  # noqa: E721
        raise ValueError(f"{field_name}: must be an integer >= 0")
    return value


def _byte_strings(values: list, field_name: str) -> list[bytes]:
    if not isinstance(values, list) or not all(isinstance(v, bytes) for v in values):
        raise ValueError(f"{field_name}: must be a list of byte strings")
    return values


def _lora_files(obj: dict, field_name: str) -> LoraFiles:
    files = LoraFiles(**obj)
    if not isinstance(files.name, str) or not isinstance(files.path, str):
        raise ValueError(f"{field_name}: name and path must be strings")
    return files


def _decode_rows(obj: dict) -> DecodeRows:
    rows = DecodeRows(**obj)
    columns = (rows.seq_ids, rows.token_ids, rows.grown, rows.new_block_ids)
    if not all(isinstance(c, list) and all(type(v) is int for v in c) for c in columns):  # noqa: E721
        raise ValueError("decodes: every column must be a list of integers")
    if len(rows.token_ids) != len(rows.seq_ids) or len(rows.new_block_ids) != len(rows.grown):
        raise ValueError("decodes: token_ids must match seq_ids, and new_block_ids grown, in length")
    return rows


def _pooled_part(obj: dict) -> PooledPart:
    part = PooledPart(**obj)
    if not all(type(v) is int for v in (part.seq_id, part.start, part.count)) or part.count < 1:  # noqa: E721
        raise ValueError("pooled: seq_id, start and count must be integers (count >= 1)")
    if not all(isinstance(v, float) for v in part.values + part.logits):
        raise ValueError("pooled: values and logits must be lists of floats")
    return part


def encode_result(result: StepResult) -> bytes:
    # columns for the ids (every row has them); the other fields only for the rows that carry one
    sampled = result.sampled
    extras = [[i, s.logprob, s.top_logprobs, s.error] for i, s in enumerate(sampled)
              if s.logprob is not None or s.top_logprobs is not None or s.error is not None]
    obj = {"step_id": result.step_id, "seq_ids": [s.seq_id for s in sampled],
           "token_ids": [s.token_id for s in sampled], "extras": extras,
           "prompt_logprobs": [vars(p) for p in result.prompt_logprobs]}
    if result.lora_reads:
        obj["lora_reads"] = [vars(read) for read in result.lora_reads]
    if result.kv_load_failures:
        obj["kv_load_failures"] = result.kv_load_failures
    if result.kv_load_seconds:
        obj["kv_load_seconds"] = float(result.kv_load_seconds)
    if result.kv_export:
        obj["kv_export"] = result.kv_export
    if result.pooled:
        obj["pooled"] = [vars(part) for part in result.pooled]
    return _pack(obj)


def decode_result(data: bytes) -> StepResult:
    obj = _unpack(data)
    try:
        seq_ids, token_ids = obj["seq_ids"], obj["token_ids"]
        if len(seq_ids) != len(token_ids):
            raise ValueError("seq_ids and token_ids differ in length")
        sampled = [SampledToken(seq_id, token_id) for seq_id, token_id in zip(seq_ids, token_ids)]
        for i, logprob, top, error in obj["extras"]:
            token = sampled[i]
            token.logprob, token.error = logprob, error
            if top is not None:
                token.top_logprobs = [(int(t), float(lp)) for t, lp in top]
        prompt = []
        for p in obj.get("prompt_logprobs", []):
            p = dict(p)
            if p.get("top_logprobs") is not None:
                p["top_logprobs"] = [[(int(t), float(lp)) for t, lp in row] for row in p["top_logprobs"]]
            prompt.append(PromptLogprobs(**p))
        reads = [LoraRead(**read) for read in obj.get("lora_reads", [])]
        if not all(isinstance(r.name, str) and isinstance(r.path, str) and isinstance(r.error, (str, type(None)))
                   for r in reads):
            raise ValueError("lora_reads: name and path must be strings, error a string or null")
        failures = obj.get("kv_load_failures", [])
        if not all(type(slot) is int for slot in failures):  # noqa: E721
            raise ValueError("kv_load_failures: must be a list of integers")
        load_s = obj.get("kv_load_seconds", 0.0)
        if isinstance(load_s, bool) or not isinstance(load_s, (int, float)) or not load_s >= 0:
            raise ValueError("kv_load_seconds: must be a number >= 0")
        return StepResult(step_id=obj["step_id"], sampled=sampled, prompt_logprobs=prompt, lora_reads=reads,
                          kv_load_failures=list(failures), kv_load_seconds=float(load_s),
                          kv_export=_byte_strings(obj.get("kv_export", []), "kv_export"),
                          pooled=[_pooled_part(part) for part in obj.get("pooled", [])])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise WireError(f"malformed StepResult: {exc}") from exc
