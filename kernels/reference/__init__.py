"""Torch references of the kernels: the test oracles, and on CPU the attention path where no C kernel
takes a shape (``attention``: paged attention and KV stores; ``fused``: RMSNorm, rotary, SiLU, MoE)."""
