"""pagedray.workers: one tensor-parallel rank of a model replica.

Rooms, from the bottom (tests/test_layers.py holds each to the rooms below it):
- ``contract/``: what crosses the engine-worker boundary (config, sampling params, the wire types);
- ``kv_cache``, ``kv_blocks``, ``kv_tier``, ``kv_host_tier``, ``tp_group``, ``host_memory``: the rank's KV tensors,
  its blocks as bytes (the tier's files and transfers between replicas; head re-sharding uses ``layers.partition``),
  its second KV tier (files; pinned host memory on CUDA), its process group, its allocator;
- ``weights/``: checkpoint reading, quantization formats, the default model, the dtype choice;
- ``layers/``: the tensor-parallel layers; ``models/``: the model families on them, model loading and info;
- ``lora/``: LoRA adapters on the layers (PEFT files checked, per-layer slots, the grouped product);
- ``sampling/``: logits -> tokens (sampler, grammar masks, draft verification);
- ``runner/``: one step (the plan's mirror, the inputs, the forward, decode graphs, the draft model);
- ``worker``, ``ray_worker``, ``step_channel``: the rank itself, as a class, a Ray actor and a byte channel.

Data flow of a step: ``worker.Worker.execute(plan)`` -> ``runner.model_runner.ModelRunner``
(``runner.seq_mirror`` applies the plan, ``kv_cache.copy_blocks`` the copy-on-write pairs,
``runner.input_batch`` builds the tensors) -> ``models/`` (on the parallel ``layers/``, attention through
``pagedray.kernels``) -> logits gathered to rank 0 -> ``sampling.sampler.Sampler`` -> StepResult.
``benchmarks.step`` and ``benchmarks.host_step`` (a checkout's benchmark scripts) measure a step's host work.
"""
