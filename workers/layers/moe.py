"""Sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): router, top-k, then ``kernels.fused_moe``
(the Triton grouped GEMMs on CUDA, a torch loop over experts elsewhere).

Per token the router's softmax (float32) picks ``top_k`` experts (with ``norm_topk_prob`` their weights are
renormalised to sum to 1, then cast to the hidden dtype); each picked expert runs its SiLU-gated MLP on the
tokens routed to it, the output is scaled by the token's weight and added into the token's row; the torch
path adds experts in ascending order (transformers' order, so float32 sums match it), the Triton path sums
each token's picks in slot order.

Tensor parallelism: the router is replicated; every rank holds every expert's slice of the intermediate
dimension (gate / up rows, down columns), as vLLM's fused-MoE TP does, so each rank's sum is a partial one
and one all-reduce completes it: the same collective as the dense MLP's down projection.

Qwen2-MoE adds a shared expert (a dense MLP passed in by the model, tensor-parallel as usual) whose output,
scaled by ``sigmoid(shared_expert_gate(x))`` (a replicated [1, H] projection), joins the experts' sum.
Checkpoint names: ``MoESpec.block`` (``mlp``; Mixtral ``block_sparse_moe``) holds ``gate`` (the router) and
``experts.{e}.{names}`` (``gate_proj / up_proj / down_proj``; Mixtral ``w1 / w3 / w2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ..tp_group import TPGroup
from ..weight_loader import CheckpointReader, copy_into
from .linear import empty_param
from .partition import check_even_split


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int          # per expert
    norm_topk_prob: bool
    shared_intermediate_size: int = 0   # Qwen2-MoE's shared expert (0: none)
    block: str = "mlp"                  # the layer's checkpoint module
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, tp: TPGroup, dtype, device,
                 shared: nn.Module | None = None) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.checkpoint_name = spec.block
        self.shared = shared                                                                  # [T, H] -> [T, H]
        self.shared_gate = empty_param((1, hidden_size), dtype, device) if shared is not None else None
        rows = check_even_split(spec.intermediate_size, tp.world_size, "moe_intermediate_size")
        self.start, self.rows, self.hidden_size = tp.rank * rows, rows, hidden_size
        self.gate = empty_param((spec.num_experts, hidden_size), dtype, device)              # router [E, H]
        self.gate_up = empty_param((spec.num_experts, 2 * rows, hidden_size), dtype, device)  # [E, 2 I_local, H]
        self.down = empty_param((spec.num_experts, hidden_size, rows), dtype, device)        # [E, H, I_local]

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        """``{prefix}.gate.weight`` and ``{prefix}.experts.{e}.{gate,up,down}_proj.weight`` (this rank's rows /
        columns of each expert)."""
        full, hidden, start, end = self.spec.intermediate_size, self.hidden_size, self.start, self.start + self.rows
        name = f"{prefix}.gate.weight"
        copy_into(self.gate, reader.read(name, expect_shape=[self.spec.num_experts, hidden]), name)
        gate_name, up_name, down_name = self.spec.names
        for e in range(self.spec.num_experts):
            base = f"{prefix}.experts.{e}"
            for half, proj in enumerate((gate_name, up_name)):
                name = f"{base}.{proj}.weight"
                copy_into(self.gate_up[e, half * self.rows:(half + 1) * self.rows],
                          reader.read(name, 0, start, end, expect_shape=[full, hidden]), name)
            name = f"{base}.{down_name}.weight"
            copy_into(self.down[e], reader.read(name, 1, start, end, expect_shape=[hidden, full]), name)
        if self.shared is not None:
            self.shared.load(reader, f"{prefix}.shared_expert")
            name = f"{prefix}.shared_expert_gate.weight"
            copy_into(self.shared_gate, reader.read(name, expect_shape=[1, hidden]), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [tokens, H] -> [tokens, H] (all-reduced over the ranks)
        logits = F.linear(x, self.gate)                                                   # [tokens, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)                    # [tokens, k]
        if self.spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = kernels.fused_moe(x, self.gate_up, self.down, weights.to(logits.dtype), experts)   # [tokens, H]
        self.tp.all_reduce(out)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out
