"""Decode rows (``StepPlan.decodes``, issue #60): the steady decode step as columns instead of one
``RunningDelta`` per sequence, the worker's persistent block-table rows, and the inputs built from them.

Checked against the general path they replace: the same packed inputs as ``build_host_batch`` on random
states (padding included), the same mirror as the equivalent deltas, and, through a real engine on a tiny
model, the same streams (tokens and logprobs, greedy, seeded and mixed batches) with decode rows on and
off. Bad rows raise ValueError naming the field and change nothing.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from pagedray.cluster.engine import Engine
from pagedray.cluster.plan_builder import PlanBuilder
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import (
    DecodeRows,
    NewSequence,
    RunningDelta,
    StepPlan,
    WireError,
    decode_plan,
    encode_plan,
)
from pagedray.workers.runner.input_batch import build_decode_host_batch, build_host_batch
from pagedray.workers.runner.seq_mirror import BatchedSequence, BlockTableRows, SequenceMirror, SequenceState

GREEDY = SamplingParams(temperature=0)


def _decoding_mirror(rng: random.Random, num_seqs: int, block_size: int = 4, num_blocks: int = 512):
    """A mirror whose sequences all computed every known token, plus each one's next token."""
    mirror = SequenceMirror(block_size, num_blocks=num_blocks)
    free = list(range(num_blocks))
    rng.shuffle(free)
    new_seqs = []
    for seq_id in range(num_seqs):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        blocks = [free.pop() for _ in range(-(-len(prompt) // block_size))]
        new_seqs.append(NewSequence(seq_id, prompt, [], 0, len(prompt), blocks, GREEDY))
    mirror.mark_computed(mirror.apply(StepPlan(0, new_seqs=new_seqs)))
    return mirror, free


def _decode_plan(mirror: SequenceMirror, free: list[int], seq_ids: list[int], rng: random.Random,
                 step_id: int = 1) -> StepPlan:
    rows = DecodeRows()
    for i, seq_id in enumerate(seq_ids):
        state = mirror.state(seq_id)
        rows.seq_ids.append(seq_id)
        rows.token_ids.append(rng.randrange(1000))
        if state.num_tokens >= len(state.block_ids) * mirror.block_size:   # the token opens a block
            rows.grown.append(i)
            rows.new_block_ids.append(free.pop())
    return StepPlan(step_id, decodes=rows)


def _as_deltas(plan: StepPlan) -> StepPlan:
    """The same plan with a RunningDelta per decode row (the general form)."""
    blocks = dict(zip(plan.decodes.grown, plan.decodes.new_block_ids))
    running = [RunningDelta(seq_id, 1, [blocks[i]] if i in blocks else [], token)
               for i, (seq_id, token) in enumerate(zip(plan.decodes.seq_ids, plan.decodes.token_ids))]
    return StepPlan(plan.step_id, running=running, released_seq_ids=list(plan.released_seq_ids))


def _states(mirror: SequenceMirror) -> dict:
    return {seq_id: (s.output_token_ids, s.num_computed_tokens, s.block_ids) for seq_id, s in mirror._seqs.items()}


@pytest.mark.parametrize("seed", range(4))
def test_decode_rows_update_the_mirror_as_the_equivalent_deltas_and_build_the_same_inputs(seed):
    rng = random.Random(seed)
    rows_mirror, free = _decoding_mirror(rng, 12)
    delta_mirror = copy.deepcopy(rows_mirror)
    for step_id in range(1, 14):                     # several block boundaries, a release and a new sequence
        seq_ids = sorted(rows_mirror._seqs, key=lambda _: rng.random())
        released = [seq_ids.pop()] if step_id == 5 else []
        if released:
            released_row = rows_mirror.state(released[0]).row
        plan = _decode_plan(rows_mirror, free, seq_ids, rng, step_id)
        plan.released_seq_ids = released
        general = _as_deltas(plan)
        rows = rows_mirror.apply(decode_plan(encode_plan(plan)))            # the columns survive the wire
        batch = delta_mirror.apply(general).batch
        assert [s.seq_id for s in rows.decode_states] == seq_ids and not rows.batch
        fast = build_decode_host_batch(rows.decode_states, rows_mirror.table_rows.tables, 4)
        slow = build_host_batch(batch, 4)
        assert torch.equal(fast.packed, slow.packed) and fast.shape == slow.shape
        assert fast.max_query_len == slow.max_query_len == 1
        assert [s.seq_id for s in fast.sampling_seqs] == [s.seq_id for s in slow.sampling_seqs]
        rows_mirror.mark_computed(rows)
        delta_mirror.mark_computed(type(rows)(batch=batch))
        assert _states(rows_mirror) == _states(delta_mirror)
        if step_id == 7:                            # a new sequence reuses the released one's table row
            prompt = [rng.randrange(1000) for _ in range(9)]
            blocks = [free.pop() for _ in range(3)]
            new = StepPlan(100 + step_id, new_seqs=[NewSequence(500, prompt, [], 0, 9, blocks, GREEDY)])
            for mirror in (rows_mirror, delta_mirror):
                mirror.mark_computed(mirror.apply(copy.deepcopy(new)))
            assert rows_mirror.state(500).row == released_row


@pytest.mark.parametrize("rows,width", [(None, None), (16, 12), (9, 9)])
def test_decode_inputs_pad_like_the_general_builder(rows, width):
    rng = random.Random(7)
    mirror, free = _decoding_mirror(rng, 9)
    step = mirror.apply(_decode_plan(mirror, free, list(range(9)), rng))
    fast = build_decode_host_batch(step.decode_states, mirror.table_rows.tables, 4, rows=rows, width=width)
    slow = build_host_batch(step.as_batch(), 4, rows=rows, width=width)
    assert torch.equal(fast.packed, slow.packed) and fast.shape == slow.shape and fast.num_real_rows == 9
    with pytest.raises(ValueError, match="width"):
        build_decode_host_batch(step.decode_states, mirror.table_rows.tables, 4, rows=16, width=1)
    with pytest.raises(ValueError, match="rows"):
        build_decode_host_batch(step.decode_states, mirror.table_rows.tables, 4, rows=4)


def test_block_table_rows_grow_and_reuse_rows():
    table_rows = BlockTableRows()
    rows = [table_rows.take(list(range(i, i + 3))) for i in range(40)]          # past the first 16 rows
    assert len(set(rows)) == 40
    table_rows.write(rows[3], 3, list(range(100, 140)))                          # past the first 16 columns
    assert table_rows.tables[rows[3], :5].tolist() == [3, 4, 5, 100, 101]
    assert table_rows.tables[rows[39], :3].tolist() == [39, 40, 41]
    table_rows.give_back(rows[3])
    assert table_rows.take([7]) == rows[3]


def _small_mirror() -> SequenceMirror:
    """Three sequences of 5 computed prompt tokens in 2 blocks of 4 (room for the next one)."""
    mirror = SequenceMirror(4, num_blocks=512)
    new = [NewSequence(i, [1, 2, 3, 4, 5], [], 0, 5, [2 * i, 2 * i + 1], GREEDY) for i in range(3)]
    mirror.mark_computed(mirror.apply(StepPlan(0, new_seqs=new)))
    return mirror


@pytest.mark.parametrize("fields,released,running,message", [
    ({"seq_ids": [0, 9], "token_ids": [5, 6]}, [], [], "decodes: seq 9 is not mirrored"),
    ({}, [1], [], "decodes: seq 1 is not mirrored"),
    ({"seq_ids": [0, 0], "token_ids": [5, 6]}, [], [], "listed twice"),
    ({}, [], [RunningDelta(1, 1, [], 3)], "listed twice"),
    ({"grown": [0, 0], "new_block_ids": [40, 41]}, [], [], "distinct indices"),
    ({"grown": [2], "new_block_ids": [40]}, [], [], "distinct indices"),
    ({"grown": [0], "new_block_ids": [512]}, [], [], "outside the KV cache"),
])
def test_bad_decode_rows_name_the_field_and_change_nothing(fields, released, running, message):
    mirror = _small_mirror()
    before = copy.deepcopy(_states(mirror))
    plan = StepPlan(3, decodes=DecodeRows(**{"seq_ids": [0, 1], "token_ids": [5, 6], **fields}),
                    running=running, released_seq_ids=released)
    with pytest.raises(ValueError, match=message):
        mirror.apply(plan)
    assert _states(mirror) == before


def test_a_decode_row_needs_a_decoding_sequence_and_room_for_its_slot():
    mirror = SequenceMirror(4, num_blocks=64)
    mirror.apply(StepPlan(0, new_seqs=[NewSequence(0, [1, 2, 3, 4, 5], [], 0, 2, [0, 1], GREEDY),
                                       NewSequence(1, [1, 2, 3, 4], [], 0, 4, [2], GREEDY)]))
    with pytest.raises(ValueError, match="decodes: seq 0 is not decoding"):      # 2 of 5 prompt tokens computed
        mirror.apply(StepPlan(1, decodes=DecodeRows([0], [9])))
    mirror._seqs[1].num_computed_tokens = 4
    with pytest.raises(ValueError, match="block_ids: seq 1 has too few blocks"):  # position 4 needs a 2nd block
        mirror.apply(StepPlan(1, decodes=DecodeRows([1], [9])))
    assert mirror.state(1).output_token_ids == [] and mirror.state(1).block_ids == [2]
    mirror.apply(StepPlan(1, decodes=DecodeRows([1], [9], [0], [3])))
    assert mirror.state(1).output_token_ids == [9] and mirror.state(1).block_ids == [2, 3]


@pytest.mark.parametrize("decodes", [
    {"seq_ids": [1, 2], "token_ids": [3]},
    {"seq_ids": [1], "token_ids": [3], "grown": [0], "new_block_ids": []},
    {"seq_ids": [1], "token_ids": ["3"]},
    {"seq_ids": [1], "token_ids": [3], "colour": 1},
])
def test_malformed_decode_rows_are_wire_errors(decodes):
    import msgpack

    data = msgpack.packb({"step_id": 1, "new_seqs": [], "running": [], "released_seq_ids": [], "block_copies": [],
                          "decodes": decodes})
    with pytest.raises(WireError, match="malformed StepPlan"):
        decode_plan(data)


# -- end to end: the engine with decode rows on and off --------------------------------------------------------
def _engine(path: str, plain_decodes: bool) -> Engine:
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                          cache=CacheConfig(block_size=8, num_blocks=64, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6))
    engine = Engine(config)
    engine.plan_builder = PlanBuilder(engine.block_manager, plain_decodes=plain_decodes)
    return engine


def _streams(engine: Engine, requests) -> dict:
    for request_id, prompt, params in requests:
        engine.add(request_id, prompt, params)
    streams = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for choice in out.outputs:
                stream = streams.setdefault((out.request_id, choice.index), {"tokens": [], "logprobs": []})
                stream["tokens"] += choice.token_ids
                stream["logprobs"] += [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in choice.logprobs or []]
                if choice.finish_reason is not None:
                    stream["finish"] = choice.finish_reason
    return streams


def test_the_engine_streams_the_same_with_decode_rows_as_with_deltas(tiny_model_path):
    path = tiny_model_path("llama")
    rng = random.Random(11)
    requests = [(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randrange(2, 19))], params)
                for i, params in enumerate([
                    SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
                    SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, min_tokens=4),
                    SamplingParams(max_tokens=11, temperature=0.8, seed=5, ignore_eos=True, n=2),
                    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2),
                    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3),
                    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=1),
                    SamplingParams(max_tokens=15, temperature=0, ignore_eos=True),
                ])]
    fast, general = _engine(path, True), _engine(path, False)
    try:
        assert _streams(fast, requests) == _streams(general, requests)
        assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks
        assert fast.executor.worker.num_sequences() == 0
    finally:
        fast.shutdown()
        general.shutdown()


def test_an_all_greedy_batch_decodes_through_rows_and_one_argmax(tiny_model_path):
    """The steady decode step: its plan is rows only, and the worker neither builds a BatchedSequence nor
    calls the general sampler for it."""
    engine = _engine(tiny_model_path("llama"), True)
    worker = engine.executor.worker
    plans, general_samples = [], []
    build, sample = engine.plan_builder.build, worker.sample
    engine.plan_builder.build = lambda out: plans.append(build(out)) or plans[-1]
    worker.sample = lambda *args, **kwargs: general_samples.append(1) or sample(*args, **kwargs)
    try:
        for i in range(4):
            engine.add(f"g{i}", [5 + i, 6, 7], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    decode_only = [p for p in plans if p.decodes and not p.running and not p.new_seqs]
    assert len(decode_only) == 8 and all(len(p.decodes) == 4 for p in decode_only)
    assert general_samples == []


def test_sampler_argmax_is_the_greedy_fast_path_and_fails_a_non_finite_row():
    from pagedray.workers.sampling.sampler import NON_FINITE_ROW, PLACEHOLDER_TOKEN, Sampler, SamplingRow

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))            # [rows, vocab]
    logits[3] = float("nan")
    logits[4, 7] = 1e30
    rows = [SamplingRow(10 + i, GREEDY, [1], [2]) for i in range(5)]
    sampler = Sampler(seed=0)
    assert sampler.argmax([10, 11, 12, 13, 14], logits) == sampler(logits, rows)
    tokens = sampler.argmax([10, 11, 12, 13, 14], logits)
    assert tokens[3].token_id == PLACEHOLDER_TOKEN and tokens[3].error == NON_FINITE_ROW
    assert tokens[4].token_id == 7 and tokens[4].error is None
    assert [t.token_id for t in tokens[:3]] == np.argmax(logits[:3].numpy(), axis=1).tolist()
    with pytest.raises(ValueError, match="logits"):
        sampler.argmax([1, 2], logits)


def test_batched_sequence_of_a_decode_row_samples():
    state = SequenceState(3, [1, 2], [4], 2, [0], GREEDY)
    assert BatchedSequence(state, 1, True).num_own_tokens == 1 and state.greedy_from == 0
    assert SequenceState(4, [1], [], 0, [0], SamplingParams(temperature=0.5)).greedy_from is None
