"""pagedray.workers: one tensor-parallel rank of a model replica.

Data flow of a step: ``worker.Worker.execute(plan)`` -> ``model_runner.ModelRunner`` (``seq_mirror``
applies the plan, ``kv_cache.copy_blocks`` the copy-on-write pairs, ``input_batch`` builds the tensors)
-> ``models/`` (Llama / Mistral / Qwen2 / Qwen3 on the parallel ``layers/``, attention through
``pagedray.kernels``) -> logits gathered to rank 0 -> ``sampler.Sampler`` -> StepResult.

Set-up: ``model_info`` (what the engine needs, no weights), ``default_model`` (SmolLM2 fetch),
``weight_loader`` (per-rank safetensors slices), ``tp_group`` (torch.distributed), ``memory_profile``
(GPU KV capacity), ``ray_worker.RayWorker`` (the actor). ``benchmarks.step`` (a checkout's
benchmark script) measures host overhead per step.
"""
