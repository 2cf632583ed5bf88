"""LoRA adapters on a hybrid model (Qwen3.5: workers/lora/model_lora.py adapts its full-attention layers' gated
q_proj, k/v/o and its dense MLPs; the linear-attention layers have no targets), against transformers with the
adapter merged into its weights (fp32, greedy):

- a batch mixing the adapter and the base model, in process; a prompt run again with its adapter resumes from a
  state snapshot under the adapter's own prefix chains, never from the base model's;
- TP=2 (threads): each rank holds its heads' query and gate rows of the adapter's q_proj B;
- refused, naming the adapter: a tensor for a linear-attention layer's q_proj, and MLP targets on the MoE hybrid."""

from __future__ import annotations

import random

import pytest
from helpers.hf_oracle import hf_greedy, load_hf_model
from helpers.lora_adapters import merged_hf_model, save_adapter
from helpers.thread_tp import ThreadTPExecutor, thread_tp_workers
from helpers.worker_setup import engine_config
from pagedray.cluster import LLM, LoRARequest, SamplingParams
from pagedray.cluster.engine import Engine
from pagedray.workers.lora.adapter import LoRAError, read_adapter_config
from pagedray.workers.lora.model_lora import module_shapes
from pagedray.workers.models.model_info import load_hf_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tiny_model_path, tmp_path_factory):
    """(model folder, adapter folder, prompts, {None: base tokens, "a": adapter tokens} per prompt)."""
    path = tiny_model_path("qwen3.5")
    adapter = save_adapter(tmp_path_factory.mktemp("hybrid-lora"), path, TARGETS, rank=4, alpha=8, seed=3)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (19, 26)]
    base, merged = load_hf_model(path), merged_hf_model(path, adapter)
    want = {None: [hf_greedy(base, p, NEW) for p in prompts], "a": [hf_greedy(merged, p, NEW) for p in prompts]}
    assert want[None] != want["a"]                       # the adapter changes the tokens: the checks can fail
    return path, adapter, prompts, want


def test_a_mixed_batch_and_adapter_prefix_hits_equal_transformers_with_it_merged(hybrid):
    path, adapter, prompts, want = hybrid
    lora = LoRARequest("a", adapter)
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=64, threads_per_worker=1, enable_lora=True,
              max_loras=2, max_lora_rank=8, hybrid_prefix_states=4)
    try:
        mixed = llm.generate([prompts[0], prompts[0], prompts[1]], GREEDY, use_tqdm=False,
                             lora_request=[lora, None, lora])
        again = llm.generate([prompts[1]], GREEDY, use_tqdm=False, lora_request=lora)[0]
        base_again = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
        llm.engine.block_manager.check_invariants()
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in mixed] == [want["a"][0], want[None][0], want["a"][1]]
    assert again.outputs[0].token_ids == want["a"][1] and again.num_cached_prompt_tokens == 24
    assert base_again.outputs[0].token_ids == want[None][1] and base_again.num_cached_prompt_tokens == 0


def test_tensor_parallel_ranks_shard_the_adapter_like_each_layer(hybrid, monkeypatch):
    path, adapter, prompts, want = hybrid
    kwargs = dict(num_blocks=64, enable_lora=True, max_lora_rank=8)
    workers = thread_tp_workers(monkeypatch, path, tp=2, **kwargs)
    engine = Engine(engine_config(path, tp=2, **kwargs), executor=ThreadTPExecutor(workers, 64))
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, GREEDY, lora=LoRARequest("a", adapter) if i == 0 else None)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    engine.shutdown()
    assert [tokens["r0"], tokens["r1"]] == [want["a"][0], want[None][1]]


def test_a_linear_layers_module_and_moe_mlp_targets_are_refused_naming_the_adapter(hybrid, tiny_model_path,
                                                                                   tmp_path):
    from safetensors.torch import load_file, save_file

    path, adapter, _, _ = hybrid
    shapes = module_shapes(load_hf_config(path), 256)
    assert read_adapter_config("a", adapter, shapes, 8).rank == 4
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    full, linear = (f"base_model.model.model.layers.{i}.self_attn.q_proj" for i in (3, 0))   # 3: full attention
    for side in ("A", "B"):
        tensors[f"{linear}.lora_{side}.weight"] = tensors[f"{full}.lora_{side}.weight"].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(open(f"{adapter}/adapter_config.json").read())
    with pytest.raises(LoRAError, match="'bad'.*'q_proj' of layer 0, which has none"):
        read_adapter_config("bad", bad, shapes, 8)
    moe = tiny_model_path("qwen3.5-moe")
    mlp = save_adapter(tmp_path / "mlp", moe, ["q_proj", "gate_proj"], rank=2, alpha=2, seed=1)
    with pytest.raises(LoRAError, match="'mlp'.*target module 'gate_proj' is not one this model can adapt"):
        read_adapter_config("mlp", mlp, module_shapes(load_hf_config(moe), 256), 8)
