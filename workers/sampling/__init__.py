"""Turning rank 0's logits into tokens: the sampler and its ops, grammar masks (``grammar``,
``grammar_limits``) and the verification of speculative drafts (``speculative``)."""
