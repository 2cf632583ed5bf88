"""Running one step on a rank: the plan's mirror (``seq_mirror``), the step's inputs (``input_batch``),
the forward (``model_runner``; decode steps through ``decode_graphs``), prompt logprobs, the draft model,
and the memory profile that sizes the KV cache."""
