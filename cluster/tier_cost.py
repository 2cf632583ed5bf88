"""TierCost: how much of a block's prefill a second-tier load saves, measured on this replica.

The cache-aware router counts a block in a replica's second KV tier (``routing_stats``' ``tier_hashes``) as
``weight`` of a block in its KV cache: ``1 - load seconds per block / compute seconds per block``, floored at 0.
Both figures are exponential moving averages of what the engine saw:
- compute: the wall time of synchronous steps that scheduled at least one block's worth of tokens and loaded
  nothing, per token scheduled, times the block size (a prefill-heavy step's cost of a block);
- load: rank 0's ``StepResult.kv_load_seconds`` per block loaded.
Until both have been seen the weight is 0: a tier block counts for nothing before its cost is known.
The engine times every synchronous step, with or without a tier (steps moving blocks between replicas aside):
``compute_s_per_token`` is also what a pull from a peer replica is weighed against (``deploy/serve/kv_pull.py``).
"""

from __future__ import annotations

SMOOTHING = 0.2     # weight of the newest observation in the moving averages


class TierCost:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.compute_s_per_token: float | None = None
        self.load_s_per_block: float | None = None

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

    def observe(self, num_tokens: int, step_s: float, num_loads: int, load_s: float) -> None:
        """One synchronous step: ``num_tokens`` scheduled in ``step_s`` seconds, ``num_loads`` tier blocks read in
        ``load_s`` of them."""
        if num_loads:
            self.load_s_per_block = self._average(self.load_s_per_block, load_s / num_loads)
        elif num_tokens >= self.block_size and step_s > 0:
            self.compute_s_per_token = self._average(self.compute_s_per_token, step_s / num_tokens)

    @property
    def weight(self) -> float:
        if self.compute_s_per_token is None or self.load_s_per_block is None:
            return 0.0
        return max(0.0, 1.0 - self.load_s_per_block / (self.compute_s_per_token * self.block_size))
