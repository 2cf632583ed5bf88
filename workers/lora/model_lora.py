"""LoRA slots on one rank's model: ``ModelLora.attach`` gives every adaptable linear layer of a dense
decoder (``models/decoder.py``) its ``LoraLinearSlots``, all sharing one ``LoraBatch``; ``load`` writes an
adapter into a slot of every layer (sharded like each layer), ``unload`` zeroes it. The last
``max_cpu_loras`` adapters loaded stay read in host memory (an LRU), so one evicted from its slot loads again
without reading its files.

Adaptable: the merged q/k/v projection, o_proj, and the merged gate/up and down_proj of a dense MLP (a
sparse-expert layer's MLP is not: its targets are refused by the adapter check). A model whose checkpoint
fuses qkv_proj / gate_up_proj (Phi-3) names its modules differently from the targets here, so its
adapters are refused too. The one-call CPU decode path and CUDA graphs do not run the slots' products: a
decode step with an adapter row runs the layers one by one (``cpu_decode_layers.takes`` checks the step's
``LoraBatch``), and a model with LoRA captures no CUDA graphs (``Worker.uses_decode_graphs``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..models.decoder import DecoderAttention, DecoderForCausalLM, DecoderMLP, ModelDims
from ..models.registry import model_class
from .adapter import Adapter, ModuleShapes, read_adapter
from .slots import LoraBatch, LoraLinearSlots


class ModelLora:
    def __init__(self, model: DecoderForCausalLM, max_loras: int, max_rank: int, max_cpu_loras: int | None = None
                 ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._read: OrderedDict[tuple[str, str], Adapter] = OrderedDict()   # (name, path) -> read, newest last
        self.dtype = model.embed_tokens.weight.dtype        # the products run in the model's dtype
        self.batch = LoraBatch(model.embed_tokens.weight.device, max_loras)
        self.resident: dict[int, str] = {}                   # slot -> adapter name
        self.failed: dict[int, str] = {}                     # slot -> why its last load failed (slot left empty)
        self.layers: list[tuple[int, LoraLinearSlots]] = []
        dims = model.dims
        dense_mlp = all(isinstance(layer.mlp, DecoderMLP) for layer in model.layers)
        self.shapes = ModuleShapes.of_dims(dims.hidden_size, dims.intermediate_size, dims.num_heads,
                                           dims.num_kv_heads, dims.head_dim, dims.num_layers, dense_mlp)
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            if not isinstance(attn, DecoderAttention):
                raise ValueError(f"enable_lora: {type(model).__name__} has layers LoRA cannot adapt")
            self._column(index, attn.qkv_proj, ["q_proj", "k_proj", "v_proj"])
            self._row(index, attn.o_proj, "o_proj")
            if dense_mlp:
                self._column(index, layer.mlp.gate_up_proj, ["gate_proj", "up_proj"])
                self._row(index, layer.mlp.down_proj, "down_proj")

    @classmethod
    def attach(cls, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None = None
               ) -> ModelLora:
        """The slots on ``model``'s layers (ValueError naming the model when it has no LoRA support)."""
        if not isinstance(model, DecoderForCausalLM):
            raise ValueError(f"enable_lora: {type(model).__name__} has no LoRA support (dense decoders only)")
        lora = cls(model, max_loras, max_rank, max_cpu_loras)
        model.lora = lora
        return lora

    def _column(self, index: int, layer: ColumnParallelLinear, targets: list[str]) -> None:
        slots = LoraLinearSlots(targets, [s.rows for s in layer.segments], [(s.start, s.rows) for s in layer.segments],
                                layer.input_size, None, self.max_loras, self.max_rank, self.dtype, layer.device,
                                self.batch)
        layer.lora = slots
        self.layers.append((index, slots))

    def _row(self, index: int, layer: RowParallelLinear, target: str) -> None:
        slots = LoraLinearSlots([target], [layer.output_size], [None], layer.cols,
                                (layer.tp.rank * layer.cols, layer.cols), self.max_loras, self.max_rank, self.dtype,
                                layer.device, self.batch)
        layer.lora = slots
        self.layers.append((index, slots))

    def load(self, slot: int, name: str, path: str) -> None:
        """Adapter ``name`` (PEFT files at ``path``) into ``slot`` of every layer. Files that cannot be read
        (changed since the engine checked them at intake) leave the slot empty and ``failed[slot]`` saying why:
        the rows of that slot then end their requests with that error (``Worker``), never the step."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot: {slot} is outside 0..{self.max_loras - 1}")
        self.failed.pop(slot, None)
        try:
            adapter = self._read.pop((name, path), None) or read_adapter(name, path, self.shapes, self.max_rank)
        except (ValueError, OSError) as exc:          # LoRAError is a ValueError
            self.unload(slot)
            self.failed[slot] = str(exc)
            return
        self._read[(name, path)] = adapter                   # the most recently loaded last
        while len(self._read) > self.max_cpu_loras:
            self._read.popitem(last=False)
        for index, slots in self.layers:
            slots.write(slot, index, adapter)
        self.batch.set_scale(slot, adapter.config.scale)
        self.resident[slot] = name

    def unload(self, slot: int) -> None:
        for _, slots in self.layers:
            slots.clear(slot)
        self.batch.set_scale(slot, 0.0)
        self.resident.pop(slot, None)


def module_shapes(hf_config, max_model_len: int) -> ModuleShapes:
    """The target modules' shapes of the model ``hf_config`` describes (what the engine checks adapters
    against without loading the model); ValueError when the model has no LoRA support."""
    cls = model_class(hf_config)
    if not issubclass(cls, DecoderForCausalLM):
        raise ValueError(f"enable_lora: {cls.__name__} has no LoRA support (dense decoders only)")
    spec, dims = cls.arch_spec(hf_config, max_model_len), ModelDims.from_hf(hf_config)
    dense_mlp = spec.moe is None or not any(spec.moe_layers)
    return ModuleShapes.of_dims(dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads,
                                dims.head_dim, dims.num_layers, dense_mlp)
