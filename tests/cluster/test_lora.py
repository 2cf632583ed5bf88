"""LoRA adapters end to end (fp32, CPU): greedy tokens with an adapter equal transformers' with the adapter
merged into its weights (``W + scale B A``), with the C product and with the torch one, at TP=1 (LLM +
LocalExecutor) and TP=2 (two thread ranks under the real engine); a batch mixing three adapters and the base
model equals each run alone, also when fewer slots than adapters make requests wait and slots change hands;
prefix blocks are never shared across adapters; a bad adapter is a ValueError naming it and the engine serves
on."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest
import torch
from helpers.hf_oracle import hf_greedy
from helpers.lora_adapters import merged_hf_model, save_adapter
from helpers.thread_tp import ThreadTPExecutor, thread_tp_workers
from helpers.worker_setup import engine_config
from pagedray.cluster import LLM, LoRARequest, SamplingParams
from pagedray.cluster.engine import Engine
from pagedray.workers.lora import model_lora

MAX_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _prompts(seed: int, count: int, length: tuple[int, int] = (5, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(*length))] for _ in range(count)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    """Three adapters: every target at rank 8, attention only at rank 4 with rsLoRA, MLP only at rank 2
    on layer 1."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": save_adapter(root / "all", tiny_llama_path, ALL, rank=8, alpha=16, seed=1),
        "attn": save_adapter(root / "attn", tiny_llama_path, ALL[:4], rank=4, alpha=8, seed=2, rslora=True),
        "mlp": save_adapter(root / "mlp", tiny_llama_path, ALL[4:], rank=2, alpha=4, seed=3, layers=[1]),
    }


@pytest.fixture(scope="module")
def references(tiny_llama_path, tiny_hf_model, adapters):
    models = {None: tiny_hf_model, **{name: merged_hf_model(tiny_llama_path, path) for name, path in adapters.items()}}
    cache = {}

    def ref(prompt, adapter):
        key = (tuple(prompt), adapter)
        if key not in cache:
            cache[key] = hf_greedy(models[adapter], prompt, MAX_TOKENS)
        return cache[key]
    return ref


def _llm(path, **kwargs) -> LLM:
    options = dict(dtype="float32", block_size=8, watermark=0.0, threads_per_worker=1, enable_lora=True,
                   max_lora_rank=8)
    return LLM(path, **{**options, **kwargs})


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_peft_running_each_adapter_gives_the_engines_tokens(tiny_llama_path, adapters, references):
    """The oracle itself: PEFT's PeftModel over transformers, loading the adapter folders as they are, generates
    what the engine does (and what the merged-weight references of the other tests say)."""
    from helpers.hf_oracle import load_hf_model
    from peft import PeftModel

    prompts = _prompts(11, 2)
    with _llm(tiny_llama_path) as llm:
        for name, path in adapters.items():
            peft_model = PeftModel.from_pretrained(load_hf_model(tiny_llama_path), path).eval()
            lora = LoRARequest(name, path)
            results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
            for prompt, result in zip(prompts, results):
                expected = hf_greedy(peft_model, prompt, MAX_TOKENS)
                assert result.outputs[0].token_ids == expected == references(prompt, name), name


@pytest.mark.parametrize("product", ["c", "torch"])
def test_each_adapter_alone_equals_transformers_with_it_merged(tiny_llama_path, adapters, references, product,
                                                               monkeypatch):
    from pagedray.kernels.cpu import cpu_layers, cpu_lora

    if product == "torch":          # the products CUDA (or a machine without a C compiler) runs
        monkeypatch.setattr(cpu_lora, "available", lambda dtype: False)
    one_call_lora_rows = []         # LoRA rows of the decode steps that ran as one C call over every layer
    decode_layers = cpu_layers.decode_layers
    monkeypatch.setattr(cpu_layers, "decode_layers",
                        lambda layers, step: one_call_lora_rows.append(step.lora_count) or decode_layers(layers, step))
    prompts = _prompts(0, 3)
    with _llm(tiny_llama_path) as llm:
        for name, path in [(None, None), *adapters.items()]:
            lora = None if name is None else LoRARequest(name, path)
            results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
            for prompt, result in zip(prompts, results):
                assert result.outputs[0].token_ids == references(prompt, name), (name, prompt[:4])
    if cpu_layers.available(torch.float32):      # the one call takes LoRA rows only with the C product
        assert any(one_call_lora_rows) == (product == "c") and 0 in one_call_lora_rows
    for prompt in prompts:          # each adapter changes the output: the test sees whether it is applied
        assert len({tuple(references(prompt, name)) for name in (None, *adapters)}) > 1


class InlineReader:
    """The ranks' adapter reader, reading at once on the calling thread: which step sees a read finished no longer
    depends on the machine's load (the scheduling, preemptions included, is the same on every run)."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def submit(self, fn, *args) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed over as the read's failure
            future.set_exception(exc)
        return future


@pytest.mark.parametrize("max_loras,num_blocks", [(4, None), (2, None), (2, 14)],
                         ids=["a-slot-each", "slots-change-hands", "preempted"])
def test_a_batch_mixing_adapters_and_the_base_equals_each_run_alone(tiny_llama_path, adapters, references,
                                                                    max_loras, num_blocks, monkeypatch):
    monkeypatch.setattr(model_lora, "ThreadPoolExecutor", InlineReader)
    prompts = _prompts(1, 8)
    names = [None, "all", "attn", "mlp"] * 2
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in names]
    with _llm(tiny_llama_path, max_loras=max_loras, num_blocks=num_blocks) as llm:
        slots, loads = llm.engine.scheduler.lora_slots, []
        take_loads = slots.take_loads
        slots.take_loads = lambda: loads.extend(taken := take_loads()) or taken      # counts the plans' loads
        results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert slots.refs == [0] * max_loras                                   # every reference given back
        assert (llm.engine.scheduler.num_preemptions > 0) == (num_blocks is not None)   # re-admitted: slot again
        # a slot each: each adapter loaded once; two slots for three adapters: a slot changed hands
        assert len(loads) == 3 if max_loras == 4 else len(loads) >= 3 and len({load.slot for load in loads}) == 2
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == references(prompt, name), (name, prompt[:4])


def test_prefix_blocks_are_never_shared_across_adapters(tiny_llama_path, adapters):
    prompt = _prompts(2, 1, (40, 41))[0]          # five full blocks of 8
    one = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    runs = [("all", adapters["all"]), ("attn", adapters["attn"]), None, ("all", adapters["all"]), None]
    cached = []
    with _llm(tiny_llama_path) as llm:
        for run in runs:
            lora = None if run is None else LoRARequest(*run)
            (result,) = llm.generate([prompt], one, use_tqdm=False, lora_request=lora)
            cached.append(result.num_cached_prompt_tokens)
    # first use under each adapter and the base: nothing cached; the same adapter (or the base) again: a hit
    assert cached[:3] == [0, 0, 0]
    assert cached[3] > 0 and cached[4] > 0


def test_bad_adapters_are_named_and_the_engine_serves_on(tiny_llama_path, adapters, tmp_path, references):
    wide = save_adapter(tmp_path / "wide", tiny_llama_path, ["q_proj"], rank=16, alpha=16, seed=4)
    lm_head = save_adapter(tmp_path / "head", tiny_llama_path, ["q_proj"], rank=2, alpha=2, seed=5)
    (tmp_path / "head" / "adapter_config.json").write_text(
        (tmp_path / "head" / "adapter_config.json").read_text().replace('["q_proj"]', '["q_proj", "lm_head"]'))
    shape = save_adapter(tmp_path / "shape", tiny_llama_path, ["k_proj"], rank=2, alpha=2, seed=6)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "shape" / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:-1]
    save_file(tensors, str(tmp_path / "shape" / "adapter_model.safetensors"))
    cases = [(LoRARequest("wide", wide), "rank 16 is over max_lora_rank 8"),
             (LoRARequest("head", lm_head), "target module 'lm_head'"),
             (LoRARequest("shape", shape), "has shape"),
             (LoRARequest("gone", str(tmp_path / "missing")), "no adapter_config.json"),
             (LoRARequest("all", adapters["attn"]), "already served from")]
    prompt = _prompts(3, 1)[0]
    with _llm(tiny_llama_path, lora_modules=f"all={adapters['all']}") as llm:
        for lora, message in cases:
            with pytest.raises(ValueError, match=message) as info:
                llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
            assert repr(lora.name) in str(info.value) or lora.name == "all"
            assert not llm.engine.has_unfinished_requests()
        (result,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("all", adapters["all"]))
        assert result.outputs[0].token_ids == references(prompt, "all")
    with _llm(tiny_llama_path, enable_lora=False) as llm, pytest.raises(ValueError, match="enable_lora"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("all", adapters["all"]))


def test_tensor_parallel_ranks_shard_each_adapter_like_its_layer(tiny_llama_path, adapters, references, monkeypatch):
    workers = thread_tp_workers(monkeypatch, tiny_llama_path, tp=2, num_blocks=64, enable_lora=True,
                                max_lora_rank=8)
    config = engine_config(tiny_llama_path, tp=2, num_blocks=64, enable_lora=True, max_lora_rank=8)
    engine = Engine(config, executor=ThreadTPExecutor(workers, 64))
    prompts = _prompts(4, 4)
    names = ["all", None, "attn", "mlp"]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add(f"r{i}", prompt, GREEDY, lora=None if name is None else LoRARequest(name, adapters[name]))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert tokens[f"r{i}"] == references(prompt, name), name


def test_requests_queued_behind_one_waiting_for_a_slot_go_on(tiny_llama_path, adapters, references):
    """One slot and one adapter read in host memory: "all" is read off the step (the base request runs from the
    first step on, before any read is done), then "all" takes the slot for r0 and r3; "attn" waits for it."""
    prompts = _prompts(5, 4)
    names = ["all", "attn", None, "all"]
    with _llm(tiny_llama_path, max_loras=1) as llm:
        engine = llm.engine
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            engine.add(f"r{i}", prompt, GREEDY, lora=None if name is None else LoRARequest(name, adapters[name]))
        tokens = {f"r{i}": [] for i in range(4)}

        def step() -> set[str]:
            for out in engine.step():
                tokens[out.request_id].extend(out.outputs[0].token_ids)
            return {seq.request.request_id for seq in engine.scheduler.running}

        assert step() == {"r2"}               # the adapters are being read: the base model goes on meanwhile
        while "r0" not in step():
            assert [s.request.request_id for s in engine.scheduler.waiting] == ["r0", "r1", "r3"]
        assert {"r0", "r3"} <= step() and [s.request.request_id for s in engine.scheduler.waiting] == ["r1"]
        while engine.has_unfinished_requests():
            step()
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert tokens[f"r{i}"] == references(prompt, name), name


@pytest.mark.integration
def test_tensor_parallel_ranks_over_ray_serve_a_mixed_batch_exactly(ray_session, tiny_llama_path, adapters,
                                                                    references):
    """TP=2 rank actors (Ray executor): every rank reads each adapter on its own thread and shards it; two slots
    for three adapters, so one waits for a slot and another's is reused."""
    prompts = _prompts(9, 5)
    names = ["all", None, "attn", "mlp", "all"]
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in names]
    with _llm(tiny_llama_path, tensor_parallel_size=2, max_loras=2) as llm:
        assert llm.config.parallel.use_ray
        results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert llm.engine.scheduler.lora_slots.refs == [0, 0]
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == references(prompt, name), name


def test_decode_buckets_take_each_rows_adapter_slot(tiny_llama_path, adapters, references, monkeypatch):
    """The CUDA-graph decode path (run eagerly on CPU: the same static buffers and padded buckets) with adapter
    rows, base rows and padding rows in one bucket. The reads finish inline: on a loaded machine a reader thread
    can finish each adapter after the requests before it are done, and no bucket would then mix them."""
    from helpers.worker_plans import log_bucket_runs
    from pagedray.workers.runner.decode_graphs import DecodeGraphs

    monkeypatch.setattr(model_lora, "ThreadPoolExecutor", InlineReader)
    prompts = _prompts(10, 5)
    names = ["all", None, "attn", "mlp", "all"]
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in names]
    with _llm(tiny_llama_path, max_num_seqs=6, max_loras=3) as llm:
        worker = llm.engine.executor.worker
        runner = worker.runner
        graphs = DecodeGraphs(worker.model, runner.kv_cache, runner.block_size, 6, worker.max_model_len, worker.device)
        runner.use_decode_graphs(graphs)
        log = log_bucket_runs(graphs)
        results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert any(rows < bucket for rows, bucket in log) and any(rows >= 3 for rows, _ in log), log
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == references(prompt, name), name


@pytest.mark.gpu
def test_on_cuda_adapters_equal_transformers_with_them_merged(tiny_llama_path, adapters, references):
    """The Triton product (kernels/triton/lora_triton.py) under the real engine, a mixed batch; TP=1 on CUDA
    captures decode CUDA graphs, so the decode steps replay them with the rows' adapter slots as an input."""
    prompts = _prompts(6, 4)
    names = ["all", None, "attn", "mlp"]
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in names]
    with _llm(tiny_llama_path, device="cuda") as llm:
        results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == references(prompt, name), name


def test_forked_samples_keep_their_adapter(tiny_llama_path, adapters, references):
    prompts = _prompts(7, 2)
    two = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    with _llm(tiny_llama_path, max_loras=1) as llm:
        results = llm.generate(prompts, two, use_tqdm=False, lora_request=LoRARequest("attn", adapters["attn"]))
        assert llm.engine.scheduler.lora_slots.refs == [0]
    for prompt, result in zip(prompts, results):
        assert [o.token_ids for o in result.outputs] == [references(prompt, "attn")] * 2


def test_an_adapter_whose_files_break_after_intake_ends_only_its_requests(tiny_llama_path, tmp_path, references):
    path = save_adapter(tmp_path / "fragile", tiny_llama_path, ["q_proj"], rank=4, alpha=8, seed=9)
    prompts = _prompts(8, 3)
    with _llm(tiny_llama_path) as llm:
        engine, fragile = llm.engine, LoRARequest("fragile", path)
        engine.validate(prompts[0], GREEDY, lora=fragile)                       # checked at intake ...
        weights = tmp_path / "fragile" / "adapter_model.safetensors"
        good = weights.read_bytes()
        weights.write_bytes(b"not safetensors any more")
        engine.add("broken", prompts[0], GREEDY, validated=True, lora=fragile)  # ... unreadable at its load
        engine.add("base", prompts[1], GREEDY)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        broken, base = outputs["broken"][-1], outputs["base"]
        assert broken.finished and broken.outputs[0].finish_reason == "error"
        assert "lora adapter 'fragile'" in broken.error
        assert [t for out in base for t in out.outputs[0].token_ids] == references(prompts[1], None)
        (result,) = llm.generate([prompts[2]], GREEDY, use_tqdm=False)           # the engine serves on
        assert result.outputs[0].token_ids == references(prompts[2], None)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        weights.write_bytes(good)                                   # mended: the next request reads it again
        (result,) = llm.generate([prompts[0]], GREEDY, use_tqdm=False, lora_request=fragile)
        assert result.outputs[0].token_ids == hf_greedy(merged_hf_model(tiny_llama_path, path), prompts[0], MAX_TOKENS)
