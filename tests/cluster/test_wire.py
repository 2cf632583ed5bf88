"""The msgpack wire types: round trips, and the decoder's refusals (ext types, oversize, garbage)."""

import msgpack
import pytest
from pagedray.workers.contract import wire
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import (
    PENDING_TOKEN,
    DecodeRows,
    NewSequence,
    RunningDelta,
    SampledToken,
    StepPlan,
    StepResult,
    WireError,
    decode_plan,
    decode_result,
    encode_plan,
    encode_result,
)


def _plan() -> StepPlan:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop_token_ids=(2, 9), logprobs=2, min_tokens=3,
                            logit_bias=((4, 1.5), (8, -100.0)))
    return StepPlan(
        step_id=41,
        new_seqs=[NewSequence(seq_id=7, prompt_token_ids=[1, 2, 3], output_token_ids=[4],
                              num_computed_tokens=0, num_scheduled_tokens=4, block_ids=[5, 11],
                              sampling_params=params)],
        running=[RunningDelta(seq_id=3, num_scheduled_tokens=1, new_block_ids=[8], new_token_id=99),
                 RunningDelta(seq_id=4, num_scheduled_tokens=16)],
        released_seq_ids=[1, 2],
        block_copies=[(5, 6)],
        decodes=DecodeRows(seq_ids=[12, 13, 14], token_ids=[7, PENDING_TOKEN, 9], grown=[1], new_block_ids=[30]),
    )


def test_state_slots_and_copies_round_trip_and_malformed_copies_are_refused():
    plan = _plan()
    plan.new_seqs[0].state_slot = 5
    plan.state_copies = [(5, 2), (5, 3)]
    decoded = decode_plan(encode_plan(plan))
    assert decoded == plan and decoded.new_seqs[0].state_slot == 5 and decoded.state_copies == [(5, 2), (5, 3)]
    assert decode_plan(encode_plan(_plan())).state_copies == []            # absent on the wire: none
    obj = msgpack.unpackb(encode_plan(plan))
    obj["state_copies"] = [[1, "x"]]
    with pytest.raises(WireError, match="state_copies"):
        decode_plan(msgpack.packb(obj))


def test_state_snapshots_round_trip_and_malformed_ones_are_refused():
    plan = _plan()
    plan.state_snapshots = [(5, 16, 9), (2, 8, 10)]
    assert decode_plan(encode_plan(plan)).state_snapshots == [(5, 16, 9), (2, 8, 10)]
    assert decode_plan(encode_plan(_plan())).state_snapshots == []         # absent on the wire: none
    for bad in ([[1, 2]], [[1, 2, "x"]], [7]):
        obj = msgpack.unpackb(encode_plan(plan))
        obj["state_snapshots"] = bad
        with pytest.raises(WireError, match="state_snapshots"):
            decode_plan(msgpack.packb(obj))


def test_plan_round_trip_is_exact():
    plan = _plan()
    decoded = decode_plan(encode_plan(plan))
    assert decoded == plan
    assert decoded.new_seqs[0].sampling_params.stop_token_ids == (2, 9)
    assert decoded.num_scheduled_tokens == 3 + 4 + 1 + 16
    assert decoded.new_seqs[0].token_ids == [1, 2, 3, 4]


def test_result_round_trip_is_exact():
    result = StepResult(step_id=3, sampled=[
        SampledToken(seq_id=1, token_id=5, logprob=-0.25, top_logprobs=[(5, -0.25), (7, -1.5)]),
        SampledToken(seq_id=2, token_id=8),
        SampledToken(seq_id=4, token_id=0, error="its grammar refused token 3"),
        SampledToken(seq_id=6, token_id=9, logprob=-2.0, top_logprobs=[]),
    ])
    assert decode_result(encode_result(result)) == result


def test_a_results_tier_fields_round_trip_and_a_bad_load_time_is_refused():
    result = StepResult(step_id=4, sampled=[SampledToken(seq_id=1, token_id=5)], kv_load_failures=[3, 9],
                        kv_load_seconds=0.0125)
    assert decode_result(encode_result(result)) == result
    for bad in (-1.0, "1", True):
        data = msgpack.packb({"step_id": 1, "seq_ids": [], "token_ids": [], "extras": [], "prompt_logprobs": [],
                              "kv_load_seconds": bad})
        with pytest.raises(WireError, match="kv_load_seconds: must be a number >= 0"):
            decode_result(data)


def test_a_result_whose_columns_disagree_is_refused():
    data = msgpack.packb({"step_id": 1, "seq_ids": [1, 2], "token_ids": [3], "extras": [], "prompt_logprobs": []})
    with pytest.raises(WireError, match="malformed StepResult"):
        decode_result(data)
    data = msgpack.packb({"step_id": 1, "seq_ids": [1], "token_ids": [3], "extras": [[5, -1.0, None, None]],
                          "prompt_logprobs": []})
    with pytest.raises(WireError, match="malformed StepResult"):
        decode_result(data)


def test_decoder_rejects_extension_types():
    data = msgpack.packb({"step_id": 1, "sampled": [msgpack.ExtType(3, b"xx")]})
    with pytest.raises(WireError, match="extension type 3"):
        decode_result(data)


def test_decoder_rejects_oversized_messages(monkeypatch):
    data = encode_plan(_plan())
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", len(data) - 1)
    with pytest.raises(WireError, match="exceeds"):
        decode_plan(data)
    with pytest.raises(WireError, match="exceeds"):
        encode_plan(_plan())


@pytest.mark.parametrize("data", [b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"step_id": 1}), b"", "text"])
def test_decoder_rejects_malformed_messages(data):
    with pytest.raises(WireError):
        decode_plan(data)


def test_decoder_rejects_bad_sampling_params():
    obj = msgpack.unpackb(encode_plan(_plan()))
    obj["new_seqs"][0]["sampling_params"]["temperature"] = -1.0
    with pytest.raises(WireError, match="temperature"):
        decode_plan(msgpack.packb(obj))


def test_transfer_fields_round_trip_and_malformed_ones_are_refused():
    plan = StepPlan(step_id=5, kv_exports=[3, 4], kv_imports=[7], kv_import_shards=[b"\x01\x02", b"\x03\x04"],
                    kv_import_tp=2)
    assert decode_plan(encode_plan(plan)) == plan
    result = StepResult(step_id=5, kv_export=[b"\x00" * 6, b"\xff" * 6])
    assert decode_result(encode_result(result)) == result
    base = msgpack.unpackb(encode_plan(StepPlan(step_id=1)))
    for field_name, bad in (("kv_exports", [1.5]), ("kv_import_shards", ["text"]), ("kv_import_tp", -1)):
        with pytest.raises(WireError, match=field_name):
            decode_plan(msgpack.packb({**base, field_name: bad}, use_bin_type=True))
