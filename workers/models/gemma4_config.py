"""A Gemma 4 text config (transformers' ``Gemma4TextConfig``) read into ``Gemma4Layout``: what each layer builds,
with every config pagedray cannot run refused here, before any weight is read (ValueError naming the field).

Per layer (``LayerPlan``):

- its kind (``layer_types``: ``sliding_attention`` with ``sliding_window``, or ``full_attention``) and its head
  shape. The config is heterogeneous: ``per_layer_config`` overrides ``head_dim`` and ``num_key_value_heads`` on
  the full-attention layers (built from ``global_head_dim`` and, with ``attention_k_eq_v``,
  ``num_global_key_value_heads``), and transformers refuses ``config.head_dim`` on such a config; so every
  per-layer value is read through ``config.per_layer_config[i]``. Any other per-layer override is refused.
- ``k_eq_v``: with ``attention_k_eq_v`` a full-attention layer has no ``v_proj``; its values are the key
  projection before the key norm and rope.
- ``kv_source``: KV sharing (``num_kv_shared_layers``). The last that many layers compute no K/V: each reads the
  KV of the last earlier non-shared layer of its own kind (transformers' ``kv_sharing_modes``: that layer
  "stores", the shared ones "reuse"); a kind with no such producer is refused. In the paged cache a shared layer
  owns no KV row and reads its producer's (``Gemma4Layout.kv_slots``).
- its dense MLP's width: ``intermediate_size``, doubled on KV-shared layers with ``use_double_wide_mlp``.

Model-wide: per-layer input embeddings (PLE: ``hidden_size_per_layer_input`` > 0, a table of
``vocab_size_per_layer_input`` rows, which must cover the vocabulary: transformers would fail on a larger token
id), the routed experts beside every dense MLP (``enable_moe_block``: ``num_experts``, ``top_k_experts``,
``moe_intermediate_size``), ``final_logit_softcapping``, ``attention_bias``, and one rope per kind
(``rope_parameters[kind]``: ``default`` or ``proportional``; others refused).

Refused: an activation other than ``gelu_pytorch_tanh``; ``use_bidirectional_attention: "all"`` (``"vision"``
only changes image tokens, which a text model never sees); a head_dim outside what the attention kernels take
(``kernels.validation``: a multiple of 8 in [16, 512]; the released checkpoints' full layers use 512, which the
CPU C kernels do not take: those layers run the torch attention on CPU); a query head count not a multiple of a
layer's KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedray.kernels.validation import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

from ..layers.moe import MoESpec
from .llama import sliding_window_of

LOCAL, GLOBAL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "proportional")
PER_LAYER_FIELDS = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True)
class LayerPlan:
    kind: str                     # LOCAL or GLOBAL
    num_kv_heads: int             # all ranks together
    head_dim: int
    window: int | None            # sliding layers: keys within this many positions (itself included)
    k_eq_v: bool                  # no v_proj: the values are the key projection (before its norm and rope)
    kv_source: int | None         # a KV-shared layer: the layer whose KV it reads; None: its own
    intermediate_size: int        # the dense MLP's


@dataclass(frozen=True)
class Gemma4Layout:
    layers: tuple[LayerPlan, ...]
    ropes: dict                   # kind -> rope settings in RotaryEmbedding's form
    ple_size: int                 # hidden_size_per_layer_input (0: no per-layer inputs)
    ple_vocab: int                # vocab_size_per_layer_input
    moe: MoESpec | None           # the routed experts beside each dense MLP (enable_moe_block)
    final_softcap: float | None
    bias: bool                    # attention_bias: q/k/v/o projections with biases

    @property
    def kv_slots(self) -> list[int]:
        """Layer -> its row of the paged KV cache: the layers computing K/V in order; a shared layer its source's."""
        own = [i for i, plan in enumerate(self.layers) if plan.kv_source is None]
        slot = {layer: n for n, layer in enumerate(own)}
        return [slot[i if plan.kv_source is None else plan.kv_source] for i, plan in enumerate(self.layers)]

    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """(KV heads, head_dim), all ranks together, of each layer that holds KV, in cache-row order."""
        return tuple((plan.num_kv_heads, plan.head_dim) for plan in self.layers if plan.kv_source is None)


def layer_value(cfg, index: int, name: str):
    """``name`` of layer ``index``: its ``per_layer_config`` override, else the config's."""
    view = getattr(cfg, "per_layer_config", None)
    return getattr(cfg if view is None else view[index], name)


def _rope(cfg, kind: str) -> dict:
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(kind) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] not in ROPE_TYPES or "rope_theta" not in params:
        raise ValueError(f"model: rope_parameters[{kind!r}] {params} is not supported (rope_type one of "
                         f"{', '.join(ROPE_TYPES)}, with rope_theta)")
    return params


def _check_head(cfg, index: int, kind: str, heads: int, dim: int) -> None:
    field = "global_head_dim (per_layer_config)" if kind == GLOBAL else "head_dim"
    if not (MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM and dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"model: {field} {dim} of layer {index} ({kind}) is not supported: the attention kernels "
                         f"take a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if heads < 1 or cfg.num_attention_heads % heads:
        raise ValueError(f"model: num_attention_heads={cfg.num_attention_heads} is not a multiple of the "
                         f"{heads} KV heads of layer {index} ({kind}: num_key_value_heads / "
                         "num_global_key_value_heads)")


def _kv_sources(cfg, types: list[str]) -> list[int | None]:
    """transformers' KV sharing: the last ``num_kv_shared_layers`` layers read the last earlier layer of their kind."""
    layers, shared = len(types), cfg.num_kv_shared_layers or 0
    if not 0 <= shared < layers:
        raise ValueError(f"model: num_kv_shared_layers={shared} must be in [0, num_hidden_layers={layers})")
    first = layers - shared
    producer = {kind: i for i, kind in enumerate(types[:first])}        # the last of each kind wins
    missing = sorted({kind for kind in types[first:]} - set(producer))
    if missing:
        raise ValueError(f"model: num_kv_shared_layers={shared} leaves no earlier {missing} layer to share KV from")
    return [None if i < first else producer[kind] for i, kind in enumerate(types)]


def _moe(cfg) -> MoESpec | None:
    if not getattr(cfg, "enable_moe_block", False):
        return None
    experts, top_k, size = cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size
    if not experts or not top_k or not 0 < top_k <= experts or not size:
        raise ValueError(f"model: enable_moe_block needs num_experts, top_k_experts in [1, num_experts] and "
                         f"moe_intermediate_size; got {experts}, {top_k}, {size}")
    return MoESpec(experts, top_k, size, norm_topk_prob=True)


def _check_model_fields(cfg) -> None:
    act = getattr(cfg, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"model: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if getattr(cfg, "use_bidirectional_attention", None) not in (None, "vision"):
        raise ValueError("model: use_bidirectional_attention 'all' is not supported (causal attention only)")
    extra = set(getattr(cfg, "per_layer_attributes", None) or ()) - PER_LAYER_FIELDS
    if extra:
        raise ValueError(f"model: per_layer_config overrides {sorted(extra)} are not supported (only "
                         f"{sorted(PER_LAYER_FIELDS)})")
    ple = getattr(cfg, "hidden_size_per_layer_input", 0) or 0
    if ple and cfg.vocab_size_per_layer_input < cfg.vocab_size:
        raise ValueError(f"model: vocab_size_per_layer_input={cfg.vocab_size_per_layer_input} is smaller than "
                         f"vocab_size={cfg.vocab_size} (the per-layer embedding must cover every token)")
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None and not cap > 0:
        raise ValueError(f"model: final_logit_softcapping must be positive or null, got {cap!r}")


def read_layout(cfg, max_model_len: int) -> Gemma4Layout:
    """The layout of a Gemma 4 text config (module docstring); ValueError naming the field it cannot run."""
    _check_model_fields(cfg)
    types = list(cfg.layer_types)
    unknown = sorted(set(types) - {LOCAL, GLOBAL})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"model: layer_types must list {cfg.num_hidden_layers} of {LOCAL!r} / {GLOBAL!r}, got "
                         f"{unknown or len(types)}")
    window = sliding_window_of(cfg, max_model_len)
    sources = _kv_sources(cfg, types)
    double = bool(getattr(cfg, "use_double_wide_mlp", False))
    plans = []
    for i, (kind, source) in enumerate(zip(types, sources)):
        heads, dim = layer_value(cfg, i, "num_key_value_heads"), layer_value(cfg, i, "head_dim")
        _check_head(cfg, i, kind, heads, dim)
        width = cfg.intermediate_size * (2 if double and source is not None else 1)
        if source is not None and (heads, dim) != (plans[source].num_kv_heads, plans[source].head_dim):
            raise ValueError(f"model: layer {i} reads layer {source}'s KV (num_kv_shared_layers) but its "
                             f"(num_key_value_heads, head_dim) {(heads, dim)} differ from that layer's")
        plans.append(LayerPlan(kind, heads, dim, window if kind == LOCAL else None,
                               bool(getattr(cfg, "attention_k_eq_v", False)) and kind == GLOBAL, source, width))
    for kind in set(types):
        dims = sorted({plan.head_dim for plan in plans if plan.kind == kind})
        if len(dims) > 1:
            raise ValueError(f"model: the {kind} layers have head_dim {dims} (per_layer_config); one rope per kind "
                             "needs one head_dim per kind")
    cap = getattr(cfg, "final_logit_softcapping", None)
    return Gemma4Layout(tuple(plans), {kind: _rope(cfg, kind) for kind in set(types)},
                        getattr(cfg, "hidden_size_per_layer_input", 0) or 0,
                        getattr(cfg, "vocab_size_per_layer_input", 0) or 0, _moe(cfg),
                        None if cap is None else float(cap), bool(getattr(cfg, "attention_bias", False)))
