"""LoRA slots on one rank's model: ``ModelLora.attach`` gives every adaptable linear layer of a dense
decoder (``models/decoder.py``) or of a hybrid one (``models/qwen3_5.py``: its full-attention layers' projections
and every dense MLP; the linear-attention layers' projections are not targets) its ``LoraLinearSlots``, all
sharing one ``LoraBatch``; ``load`` writes an adapter into a slot of every layer (sharded like each layer),
``unload`` zeroes it.

Reading an adapter's files never holds up a step: the engine orders a read (``start_read``) when a request
names an adapter the ranks do not hold in host memory; the read runs on this rank's reader thread while steps
go on, rank 0 reports it finished (``finished_reads``, in its StepResult), and only then does the engine give
the adapter a slot (``load``: a copy from host memory into the slot tensors). Which adapters stay read
(``max_cpu_loras``) is the engine's choice (``drop``), so every rank holds the same ones.

Adaptable: the merged q/k/v projection, o_proj, and the merged gate/up and down_proj of a dense MLP (a
sparse-expert layer's MLP is not: its targets are refused by the adapter check). A model whose checkpoint
fuses qkv_proj / gate_up_proj (Phi-3) names its modules differently from the targets here, so its
adapters are refused too. The one-call CPU decode path adds the slots' products inside its C call
(``cpu_decode_layers``); a model with LoRA captures no CUDA graphs (``Worker.uses_decode_graphs``).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
from pagedray.workers.contract.wire import LoraRead

from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..models.decoder import DecoderAttention, DecoderForCausalLM, DecoderMLP, ModelDims
from ..models.qwen3_5 import GatedAttention, Qwen3_5ForCausalLM
from ..models.registry import model_class
from .adapter import Adapter, LoRAError, ModuleShapes, read_adapter
from .slots import LoraBatch, LoraLinearSlots


class ModelLora:
    def __init__(self, model: DecoderForCausalLM, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self._reads: dict[tuple[str, str], Future] = {}     # (name, path) -> its host copy (read or being read)
        self._unreported: list[tuple[tuple[str, str], Future]] = []   # reads not yet in a finished_reads() answer
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self.dtype = model.embed_tokens.weight.dtype        # the products run in the model's dtype
        self.batch = LoraBatch(model.embed_tokens.weight.device, max_loras)
        self.resident: dict[int, str] = {}                   # slot -> adapter name
        self.layers: list[tuple[int, LoraLinearSlots]] = []
        dense_mlp = all(isinstance(layer.mlp, DecoderMLP) for layer in model.layers)
        hybrid = isinstance(model, Qwen3_5ForCausalLM)
        self.shapes = _shapes(model.dims, dense_mlp, model.kinds if hybrid else None)
        for index, layer in enumerate(model.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None and hybrid:        # a linear-attention layer: its projections are not targets
                pass
            elif isinstance(attn, (GatedAttention if hybrid else DecoderAttention)):
                self._column(index, attn.qkv_proj, ["q_proj", "k_proj", "v_proj"])
                self._row(index, attn.o_proj, "o_proj")
            else:
                raise ValueError(f"enable_lora: {type(model).__name__} has layers LoRA cannot adapt")
            if dense_mlp:
                self._column(index, layer.mlp.gate_up_proj, ["gate_proj", "up_proj"])
                self._row(index, layer.mlp.down_proj, "down_proj")

    @classmethod
    def attach(cls, model: torch.nn.Module, max_loras: int, max_rank: int) -> ModelLora:
        """The slots on ``model``'s layers (ValueError naming the model when it has no LoRA support)."""
        if not isinstance(model, (DecoderForCausalLM, Qwen3_5ForCausalLM)):
            raise ValueError(f"enable_lora: {type(model).__name__} has no LoRA support (dense decoders and "
                             "Qwen3.5 hybrids only)")
        lora = cls(model, max_loras, max_rank)
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

    # -- host copies: read on this rank's reader thread, as the engine orders (wire.StepPlan.lora_reads) ----------
    def start_read(self, name: str, path: str) -> None:
        """Begin reading adapter ``name`` from ``path`` into host memory on the reader thread (the step goes on)."""
        key = (name, path)
        if key not in self._reads:
            future = self._reader.submit(_read_named, name, path, self.shapes, self.max_rank)
            self._reads[key] = future
            self._unreported.append((key, future))

    def drop(self, name: str, path: str) -> None:
        """Forget the host copy (a read still running finishes and is thrown away)."""
        self._reads.pop((name, path), None)

    def finished_reads(self, wait_s: float = 0.0) -> list[LoraRead]:
        """The reads finished since the last call (``error`` for one that failed: its copy is forgotten). With
        ``wait_s``, first waits up to that long for one to finish when none has (a plan with nothing to run)."""
        if not self._unreported:
            return []
        if wait_s > 0 and not any(future.done() for _, future in self._unreported):
            wait([future for _, future in self._unreported], timeout=wait_s, return_when=FIRST_COMPLETED)
        done = [(key, future) for key, future in self._unreported if future.done()]
        self._unreported = [(key, future) for key, future in self._unreported if not future.done()]
        reads = []
        for (name, path), future in done:
            error = future.exception()
            if error is not None and self._reads.get((name, path)) is future:
                del self._reads[(name, path)]
            reads.append(LoraRead(name, path, None if error is None else str(error)))
        return reads

    def load(self, slot: int, name: str, path: str) -> None:
        """Adapter ``name`` into ``slot`` of every layer (sharded like each layer), from its host copy (waiting
        for its read if it is still running), or read now when this rank holds none. LoRAError naming the
        adapter when its files cannot be read (the slot is then left empty)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot: {slot} is outside 0..{self.max_loras - 1}")
        future = self._reads.get((name, path))
        try:
            adapter = _read_named(name, path, self.shapes, self.max_rank) if future is None else future.result()
        except LoRAError:
            self.unload(slot)
            raise
        for index, slots in self.layers:
            slots.write(slot, index, adapter)
        self.batch.set_scale(slot, adapter.config.scale)
        self.resident[slot] = name

    def unload(self, slot: int) -> None:
        for _, slots in self.layers:
            slots.clear(slot)
        self.batch.set_scale(slot, 0.0)
        self.resident.pop(slot, None)


def _read_named(name: str, path: str, shapes: ModuleShapes, max_rank: int) -> Adapter:
    """``read_adapter``, with any failure (a file changed since the engine checked it) a LoRAError naming it."""
    try:
        return read_adapter(name, path, shapes, max_rank)
    except LoRAError:
        raise
    except Exception as exc:   # OSError, safetensors' own error types
        raise LoRAError(f"lora adapter {name!r}: {path} could not be read ({exc})") from None


def module_shapes(hf_config, max_model_len: int) -> ModuleShapes:
    """The target modules' shapes of the model ``hf_config`` describes (what the engine checks adapters
    against without loading the model); ValueError when the model has no LoRA support."""
    cls = model_class(hf_config)
    if issubclass(cls, Qwen3_5ForCausalLM):
        return _shapes(cls.dims_of(hf_config), not getattr(hf_config, "num_experts", None),
                       list(hf_config.layer_types))
    if not issubclass(cls, DecoderForCausalLM):
        raise ValueError(f"enable_lora: {cls.__name__} has no LoRA support (dense decoders and Qwen3.5 hybrids "
                         "only)")
    spec, dims = cls.arch_spec(hf_config, max_model_len), ModelDims.from_hf(hf_config)
    return _shapes(dims, spec.moe is None or not any(spec.moe_layers), None)


def _shapes(dims: ModelDims, dense_mlp: bool, layer_kinds: list[str] | None) -> ModuleShapes:
    """``layer_kinds``: a hybrid's layer types (its gated q_proj, and q/k/v/o in its full-attention layers only)."""
    if layer_kinds is None:
        return ModuleShapes.of_dims(dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads,
                                    dims.head_dim, dims.num_layers, dense_mlp)
    full = [i for i, kind in enumerate(layer_kinds) if kind == "full_attention"]
    return ModuleShapes.of_dims(dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads,
                                dims.head_dim, dims.num_layers, dense_mlp, gated_query=True, attention_layers=full)
