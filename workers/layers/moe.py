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

A quantized checkpoint's experts on CUDA stay packed (``packed``: two ``PackedExperts``, gate and up packed
side by side along the output) when every expert's slice has uniform groups (GPTQ without ``desc_act``, AWQ,
int8, FP8): the 16-bit ``gate_up`` / ``down`` are then never allocated (they are meta tensors until ``load``)
and ``kernels.fused_moe`` unpacks tile by tile. Activation-order experts load dequantized. Each rank decides
for its own slice: with TP a slice that starts inside a group can leave uneven groups on one rank, which
then loads its experts dequantized while the others keep theirs packed (tests/workers/test_packed_tp2.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from pagedray.kernels.quant_gemm import PackedExperts
from torch import nn

from ... import kernels
from ..tp_group import TPGroup
from ..weights.quantization import PackedIntWeight
from ..weights.weight_loader import CheckpointReader, copy_into
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
    swiglu_limit: float | None = None   # gpt-oss: biased experts with a clamped SwiGLU (layers/clamped_moe.py)
    swiglu_alpha: float = 1.702


def _uniform(part: PackedIntWeight) -> PackedIntWeight | None:
    """A grouped packed slice with no permutation and one group size, holding only its own groups; else None."""
    if part.perm is not None or not part.group_size:
        return None
    groups = -(-part.g_idx.shape[0] // part.group_size)
    return replace(part, zeros=part.zeros[:groups].contiguous(), scales=part.scales[:groups].contiguous())


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
        meta = torch.device("meta")                                      # allocated at load unless packed
        self.gate_up = empty_param((spec.num_experts, 2 * rows, hidden_size), dtype, meta)   # [E, 2 I_local, H]
        self.down = empty_param((spec.num_experts, hidden_size, rows), dtype, meta)         # [E, H, I_local]
        self.device = device
        self.packed: tuple[PackedExperts, PackedExperts] | None = None    # (gate_up, down) when kept packed

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        """``{prefix}.gate.weight`` and ``{prefix}.experts.{e}.{gate,up,down}_proj.weight`` (this rank's rows /
        columns of each expert)."""
        full, hidden, start, end = self.spec.intermediate_size, self.hidden_size, self.start, self.start + self.rows
        name = f"{prefix}.gate.weight"
        copy_into(self.gate, reader.read(name, expect_shape=[self.spec.num_experts, hidden]), name)
        gate_name, up_name, down_name = self.spec.names
        self.packed = self._read_packed(reader, prefix)
        if self.packed is not None:
            self.gate_up = self.down = None
        else:
            self.gate_up = empty_param(tuple(self.gate_up.shape), self.gate_up.dtype, self.device)
            self.down = empty_param(tuple(self.down.shape), self.down.dtype, self.device)
        for e in range(self.spec.num_experts if self.packed is None else 0):
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

    def _read_packed(self, reader: CheckpointReader, prefix: str) -> tuple[PackedExperts, PackedExperts] | None:
        """Every expert's slices packed with uniform groups (``PackedIntWeight.grouped``: no permutation, one
        group size) -> the stacked (gate_up, down) on this layer's device; None when any is not."""
        full, hidden, start, end = self.spec.intermediate_size, self.hidden_size, self.start, self.start + self.rows
        gate_name, up_name, down_name = self.spec.names
        gate_up, down = [], []
        for e in range(self.spec.num_experts):
            base = f"{prefix}.experts.{e}"
            parts = [reader.read_packed(f"{base}.{proj}.weight", 0, start, end, [full, hidden])
                     for proj in (gate_name, up_name)]
            parts.append(reader.read_packed(f"{base}.{down_name}.weight", 1, start, end, [hidden, full]))
            if any(part is None for part in parts):
                return None
            parts = [_uniform(part.grouped()) for part in parts]
            if any(part is None for part in parts):
                return None
            gate, up, d = parts
            if gate.group_size != up.group_size or not torch.equal(gate.g_idx, up.g_idx):
                return None
            gate_up.append(replace(gate, qweight=torch.cat([gate.qweight, up.qweight], 1),
                                   zeros=torch.cat([gate.zeros, up.zeros], 1),
                                   scales=torch.cat([gate.scales, up.scales], 1)))
            down.append(d)
        stacked = []
        for parts in (gate_up, down):
            first = parts[0]
            if any(p.group_size != first.group_size or not torch.equal(p.g_idx, first.g_idx) for p in parts):
                return None
            stacked.append(PackedExperts(torch.stack([p.qweight for p in parts]).to(self.device),
                                         torch.stack([p.zeros for p in parts]).to(self.device),
                                         torch.stack([p.scales for p in parts]).to(self.device),
                                         first.g_idx.to(self.device), first.bits, first.group_size, first.float8))
        return stacked[0], stacked[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [tokens, H] -> [tokens, H] (all-reduced over the ranks)
        logits = F.linear(x, self.gate)                                                   # [tokens, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)                    # [tokens, k]
        if self.spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        gate_up, down = self.packed or (self.gate_up, self.down)
        out = kernels.fused_moe(x, gate_up, down, weights.to(logits.dtype), experts)   # [tokens, H]
        self.tp.all_reduce(out)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out
