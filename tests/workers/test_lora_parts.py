"""The parts of LoRA serving on their own: the adapter checks (each refusal names the adapter and the
problem, before anything is registered), the grouped slot product against the dense reference
``x @ (W + scale B A)^T`` per row, the engine's slot bookkeeping (free slots first, then the least recently
used; references), the wire fields, the runner's refusal of a slot that holds nothing, and the options."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.lora_adapters import save_adapter
from helpers.tiny_models import save_tiny_llama
from pagedray.cluster.lora_slots import AdapterSlots, LoraRegistry
from pagedray.workers.contract.config import EngineConfig, ModelConfig, SchedulerConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import (
    LoraFiles,
    LoraLoad,
    LoraRead,
    NewSequence,
    StepPlan,
    StepResult,
    WireError,
    decode_plan,
    decode_result,
    encode_plan,
    encode_result,
)
from pagedray.workers.lora.adapter import LoRAError, ModuleShapes, read_adapter, read_adapter_config
from pagedray.workers.lora.slots import LoraBatch, LoraLinearSlots

SHAPES = ModuleShapes.of_dims(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, num_layers=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _edit_config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"r": 0}, "r must be a positive integer"),
    ({"r": True}, "r must be a positive integer"),
    ({"lora_alpha": "big"}, "lora_alpha must be a number"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": "all-linear"}, "as a pattern"),
    ({"target_modules": []}, "non-empty list"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' is not one this model can adapt"),
    ({"target_modules": ["k_proj"]}, "adapts 'q_proj', which target_modules does not list"),
])
def test_each_bad_config_is_refused_naming_the_adapter(model_path, tmp_path, changes, message):
    folder = tmp_path / "a"
    save_adapter(folder, model_path, ["q_proj"], rank=4, alpha=8, seed=0)
    _edit_config(folder, **changes)
    with pytest.raises(LoRAError, match=message) as info:
        read_adapter_config("mine", folder, SHAPES, max_rank=8)
    assert "lora adapter 'mine'" in str(info.value)


def test_files_that_do_not_match_the_model_are_refused(model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "a"
    save_adapter(folder, model_path, ["q_proj", "down_proj"], rank=4, alpha=8, seed=0)
    file = folder / "adapter_model.safetensors"
    tensors = load_file(str(file))
    cases = {
        "names layer 7; the model has 2": {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()},
        "has lora_A or lora_B but not both": {k: v for k, v in tensors.items()
                                              if "layers.0.mlp.down_proj.lora_B" not in k},
        "is not a LoRA A/B weight": {**tensors, "base_model.model.lm_head.weight": torch.zeros(2, 2)},
        "holds no LoRA weights": {},
    }
    for message, content in cases.items():
        save_file(content, str(file))
        with pytest.raises(LoRAError, match=message):
            read_adapter_config("mine", folder, SHAPES, max_rank=8)
    file.write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="not a readable safetensors file"):
        read_adapter_config("mine", folder, SHAPES, max_rank=8)


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora(model_path, tmp_path):
    plain = read_adapter("p", save_adapter(tmp_path / "p", model_path, ["v_proj"], 4, 8, 0), SHAPES, 8)
    rs = read_adapter("r", save_adapter(tmp_path / "r", model_path, ["v_proj"], 4, 8, 0, rslora=True), SHAPES, 8)
    assert plain.config.scale == 2.0 and rs.config.scale == 4.0
    a, b = plain.pairs[(1, "v_proj")]
    assert a.shape == (4, 64) and b.shape == (32, 4) and a.dtype == torch.float32


def test_the_grouped_slot_product_equals_the_dense_merged_weight_per_row(model_path, tmp_path):
    """A merged q/k/v layer sharded to rank 1 of 2 (its segments' rows 8..16 of 16 and 16..32 of 32)."""
    adapters = [read_adapter(n, save_adapter(tmp_path / n, model_path, t, r, 2 * r, s), SHAPES, 8)
                for n, t, r, s in (("x", ["q_proj", "v_proj"], 8, 1), ("y", ["k_proj"], 3, 2))]
    batch = LoraBatch(torch.device("cpu"), 3)
    rows, ranges = [32, 16, 16], [(32, 32), (16, 16), (16, 16)]      # q: heads 2-3 of 4; k, v: head 1 of 2
    slots = LoraLinearSlots(["q_proj", "k_proj", "v_proj"], rows, ranges, 64, None, 3, 8, torch.float64,
                            torch.device("cpu"), batch)
    slots.write(0, 1, adapters[0])
    slots.write(2, 1, adapters[1])
    batch.set_scale(0, adapters[0].config.scale)
    batch.set_scale(2, adapters[1].config.scale)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen, dtype=torch.float64)
    y = torch.zeros(7, 64, dtype=torch.float64)
    token_slots = np.array([0, -1, 2, 0, 2, -1, 0])
    batch.set(token_slots)
    slots.add_delta(x, y)
    for token, slot in enumerate(token_slots):
        expected = torch.zeros(64, dtype=torch.float64)
        if slot >= 0:
            adapter = adapters[0 if slot == 0 else 1]
            offset = 0
            for target, (start, count) in zip(["q_proj", "k_proj", "v_proj"], ranges):
                pair = adapter.pairs.get((1, target))
                if pair is not None:
                    a, b = (t.double() for t in pair)
                    dense = adapter.config.scale * (b @ a)                  # [out_full, in]
                    expected[offset:offset + count] = dense[start:start + count] @ x[token]
                offset += count
        torch.testing.assert_close(y[token], expected, rtol=1e-12, atol=1e-12)
    slots.clear(0)
    y.zero_()
    batch.set(np.array([0]))
    slots.add_delta(x[:1], y[:1])
    assert torch.count_nonzero(y) == 0


def _read(slots: AdapterSlots, *loras: LoRARequest) -> None:
    """Order each adapter's read and report it finished, as rank 0 would."""
    for lora in loras:
        slots.want(lora)
        assert slots.read_done(LoraRead(lora.name, lora.path)) is None


def test_slots_go_to_never_used_ones_first_then_the_least_recently_released():
    slots = AdapterSlots(2, max_host=3)
    a, b, c = (LoRARequest(n, f"/adapters/{n}") for n in "abc")
    assert not slots.can_acquire(a) and slots.acquire(a) is None     # not read yet: no slot
    _read(slots, a, b, c)
    assert slots.acquire(a) == 0 and slots.acquire(b) == 1
    assert [(load.slot, load.name) for load in slots.take_loads()] == [(0, "a"), (1, "b")]
    assert slots.take_loads() == []
    assert slots.acquire(c) is None                            # both referenced
    assert slots.acquire(a) == 0 and slots.take_loads() == []  # resident: a second reference, no load
    slots.release(1)
    slots.release(0)
    assert slots.acquire(c) == 1 and slots.take_loads() == [LoraLoad(1, "c", "/adapters/c")]   # b's slot: idle
    slots.release(0)
    assert slots.acquire(a) == 0 and slots.take_loads() == []  # still resident after its last reference
    with pytest.raises(RuntimeError, match="forgetting"):
        slots.forget_resident()
    slots.release(0)
    slots.release(1)
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(1)
    slots.forget_resident()
    assert slots.acquire(c) is None                            # the new ranks hold no copy either: read again
    _read(slots, c)
    assert slots.acquire(c) == 0 and slots.take_loads() == [LoraLoad(0, "c", "/adapters/c")]


def test_host_copies_are_read_once_dropped_least_recent_first_and_a_failed_read_is_forgotten():
    slots = AdapterSlots(1, max_host=2)
    a, b, c = (LoRARequest(n, f"/adapters/{n}") for n in "abc")
    files = [LoraFiles(n, f"/adapters/{n}") for n in "abc"]
    slots.want(a)
    slots.want(a)                                              # already ordered: one read
    slots.want(b)
    assert slots.take_orders() == ([files[0], files[1]], []) and slots.reads_in_flight
    slots.want(c)                                              # both held are still being read: c waits
    assert slots.take_orders() == ([], [])
    assert slots.read_done(LoraRead("a", "/adapters/a")) is None
    assert slots.read_done(LoraRead("b", "/adapters/b", error="lora adapter 'b': gone")) == "lora adapter 'b': gone"
    assert not slots.can_acquire(b) and slots.take_orders() == ([], [])   # b is not held after its failed read
    slots.begin_pass()
    slots.want(a)                                              # wanted in this pass: not dropped for c
    slots.want(b)
    slots.want(c)
    assert slots.take_orders() == ([files[1]], []) and slots.reads_in_flight
    assert slots.read_done(LoraRead("b", "/adapters/b")) is None and not slots.reads_in_flight
    slots.begin_pass()
    slots.want(c)                                              # a is the least recently wanted: dropped for c
    assert slots.take_orders() == ([files[2]], [files[0]])
    assert slots.read_done(LoraRead("zzz", "/nowhere")) is None   # a read no longer held is ignored


def test_the_registry_checks_each_folder_once_unless_asked_again(model_path, tmp_path):
    first = save_adapter(tmp_path / "one", model_path, ["q_proj"], 2, 2, 0)
    other = save_adapter(tmp_path / "two", model_path, ["q_proj", "v_proj"], 2, 2, 1)
    registry = LoraRegistry(SHAPES, 8, {"one": first})
    assert registry.check(LoRARequest("one", other)).targets == ("q_proj", "v_proj")   # another folder: another adapter
    (tmp_path / "one" / "adapter_config.json").unlink()          # checked once: not read again
    assert registry.check(LoRARequest("one", first)).rank == 2
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        registry.check(LoRARequest("one", first), again=True)


def test_lora_fields_cross_the_wire_and_malformed_ones_are_refused():
    new = NewSequence(3, [1, 2], [], 0, 2, [0], SamplingParams(max_tokens=2), lora_slot=1)
    plan = StepPlan(7, new_seqs=[new], lora_loads=[LoraLoad(1, "x", "/a/x")])
    back = decode_plan(encode_plan(plan))
    assert back.new_seqs[0].lora_slot == 1 and back.lora_loads == [LoraLoad(1, "x", "/a/x")]
    import msgpack
    raw = msgpack.unpackb(encode_plan(plan), raw=False)
    raw["lora_loads"] = [{"slot": "1", "name": "x", "path": "/a/x"}]
    with pytest.raises(WireError, match="lora_loads"):
        decode_plan(msgpack.packb(raw, use_bin_type=True))
    orders = StepPlan(8, lora_reads=[LoraFiles("y", "/a/y")], lora_drops=[LoraFiles("x", "/a/x")])
    back = decode_plan(encode_plan(orders))
    assert back.lora_reads == [LoraFiles("y", "/a/y")] and back.lora_drops == [LoraFiles("x", "/a/x")]
    raw = msgpack.unpackb(encode_plan(orders), raw=False)
    raw["lora_drops"] = [{"name": "x", "path": 3}]
    with pytest.raises(WireError, match="lora_drops"):
        decode_plan(msgpack.packb(raw, use_bin_type=True))
    result = StepResult(8, lora_reads=[LoraRead("y", "/a/y"), LoraRead("z", "/a/z", "lora adapter 'z': gone")])
    assert decode_result(encode_result(result)).lora_reads == result.lora_reads
    raw = msgpack.unpackb(encode_result(result), raw=False)
    raw["lora_reads"][0]["error"] = 5
    with pytest.raises(WireError, match="lora_reads"):
        decode_result(msgpack.packb(raw, use_bin_type=True))


def test_a_plan_naming_an_empty_slot_is_refused_before_anything_runs(model_path):
    from helpers.worker_setup import local_driver

    worker, _ = local_driver(model_path, enable_lora=True, max_lora_rank=8)
    new = NewSequence(0, [5, 6, 7], [], 0, 3, [0], SamplingParams(max_tokens=2), lora_slot=2)
    with pytest.raises(ValueError, match="lora_slot 2 holds no adapter"):
        worker.execute(StepPlan(0, new_seqs=[new]))
    assert 0 not in worker.runner.mirror
    plain, _ = local_driver(model_path)
    with pytest.raises(ValueError, match="enable_lora is off"):
        plain.execute(StepPlan(0, lora_loads=[LoraLoad(0, "x", "/nowhere")]))


@pytest.mark.parametrize("kwargs,message", [
    ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 1024}, "max_lora_rank"),
    ({"lora_modules": "a=/x,b"}, "entry 'b' is not name=folder"),
    ({"lora_modules": "a=/x,a=/y"}, "named twice"),
])
def test_lora_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(enable_lora=True, **kwargs).validate()


def test_lora_modules_need_enable_lora_and_lora_no_draft_model():
    with pytest.raises(ValueError, match="set enable_lora"):
        ModelConfig(lora_modules="a=/x").validate()
    with pytest.raises(ValueError, match="not with speculative_model"):
        EngineConfig(model=ModelConfig(enable_lora=True),
                     scheduler=SchedulerConfig(num_speculative_tokens=2, speculative_model="/draft"))
    assert ModelConfig(enable_lora=True, lora_modules="a=/x, b = /y").lora_module_paths() == {"a": "/x", "b": "/y"}


def test_a_lora_request_is_checked_and_has_a_stable_namespace():
    for name in ("", "base:x", 3):
        with pytest.raises(ValueError, match="name must be"):
            LoRARequest(name, "/p")
    with pytest.raises(ValueError, match="path must be"):
        LoRARequest("x", "")
    assert LoRARequest("x", "/p").cache_namespace == LoRARequest("x", "/p").cache_namespace
    assert LoRARequest("x", "/p").cache_namespace != LoRARequest("x", "/q").cache_namespace


def test_a_rank_reads_adapters_on_its_reader_thread_and_loads_slots_from_the_copy(model_path, tmp_path, monkeypatch):
    """The plan's reads run on the rank's reader thread (a step goes on while one is blocked); a slot load copies
    from the host copy without reading the files again; a dropped copy is read anew; rank 0 reports each
    finished read once, a failed one with its error (the copy forgotten)."""
    import threading

    from helpers.worker_setup import local_driver
    from pagedray.workers.lora import model_lora

    paths = {n: save_adapter(tmp_path / n, model_path, ["q_proj", "down_proj"], 4, 8, seed) for n, seed in
             (("a", 1), ("b", 2))}
    worker, _ = local_driver(model_path, enable_lora=True, max_lora_rank=8, max_loras=1)
    lora, read, release = worker.model.lora, [], threading.Event()
    real = model_lora.read_adapter

    def slow_read(name, *args):
        release.wait()
        read.append(name)
        return real(name, *args)
    monkeypatch.setattr(model_lora, "read_adapter", slow_read)
    result = worker.execute(StepPlan(0, lora_reads=[LoraFiles("a", paths["a"])]))
    assert result.lora_reads == [] and read == []          # the step answered while the read is blocked
    release.set()
    result = worker.execute(StepPlan(1))                    # nothing to run: waits a moment for the read
    while not result.lora_reads:
        result = worker.execute(StepPlan(2))
    assert result.lora_reads == [LoraRead("a", paths["a"])] and read == ["a"]
    qkv = worker.model.layers[0].self_attn.qkv_proj.lora
    worker.execute(StepPlan(3, lora_loads=[LoraLoad(0, "a", paths["a"])]))
    first = qkv.a[0].clone()
    assert read == ["a"] and torch.count_nonzero(first) > 0 and lora.resident == {0: "a"}
    worker.execute(StepPlan(4, lora_loads=[LoraLoad(0, "b", paths["b"])]))    # no copy held: read now
    assert read == ["a", "b"] and not torch.equal(qkv.a[0], first)
    worker.execute(StepPlan(5, lora_loads=[LoraLoad(0, "a", paths["a"])], lora_drops=[LoraFiles("a", paths["a"])]))
    assert torch.equal(qkv.a[0], first) and read == ["a", "b"]              # loaded from the copy, then dropped
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"broken")
    reads = worker.execute(StepPlan(6, lora_reads=[LoraFiles("b", paths["b"])])).lora_reads
    while not reads:
        reads = worker.execute(StepPlan(7)).lora_reads
    assert reads[0].name == "b" and "lora adapter 'b'" in reads[0].error
    with pytest.raises(LoRAError, match="lora adapter 'b'"):       # the failed copy is gone: read again, fails
        worker.execute(StepPlan(8, lora_loads=[LoraLoad(0, "b", paths["b"])]))
    assert lora.resident == {}


