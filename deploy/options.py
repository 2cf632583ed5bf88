"""The options of a served model, listed once (``OPTIONS``).

From this list come build_app's ``args`` (``AppArgs``, also the keys of ``serve.yaml``), the flags of
``pagedray serve`` and ``pagedray generate`` and the ``EngineConfig`` of a replica (``engine_config``).
An engine option names its field in ``pagedray.cluster.config`` (``config``, ``section.field``) and
takes its default and its validation from there; a Serve option (``config`` None) exists only in
deploy/. ``NOT_OPTIONS`` lists the engine settings that are deliberately not served options, with why;
a test checks that every engine setting is one or the other, and that the README lists every option.

Decisions:
- The option name is the config field's name, except ``max_queued_requests`` (the engine's
  ``max_waiting_requests``: the name the README and YAML files have used since the first release).
- Served defaults differ from the engine's in one place: ``executor`` is ``ray`` (app.py says why).
- Importing this module imports neither Ray nor Serve (the CLI builds its parser from it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedray.cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pydantic import BaseModel, ConfigDict, create_model

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
GRACEFUL_SHUTDOWN_S = 20.0
_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "parallel": ParallelConfig,
             "scheduler": SchedulerConfig}


@dataclass(frozen=True)
class Option:
    name: str                  # build_app arg; CLI flag --name-with-dashes
    help: str
    config: str | None = None  # "section.field" (or "field" of EngineConfig) for engine options
    kind: type | None = None   # Serve options only: int, float, str, bool
    default: object = None     # Serve options, or a served default that differs from the engine's
    optional: bool = False     # Serve options only: None allowed

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS = (
    Option("model", "'default' (embedded SmolLM2-135M-Instruct) or a Hugging Face model folder", "model.model"),
    Option("tokenizer", "a separate tokenizer folder (default: the model folder)", "model.tokenizer"),
    Option("dtype", "auto | float32 | float16 | bfloat16 (auto: fp32 on CPU, bf16 on CUDA)", "model.dtype"),
    Option("device", "auto | cpu | cuda", "model.device"),
    Option("max_model_len", "longest prompt + output (default: the model's)", "model.max_model_len"),
    Option("block_size", "KV block size in tokens (8, 16, 32, 64)", "cache.block_size"),
    Option("kv_cache_gib", "KV cache memory per rank on CPU, GiB", "cache.kv_cache_gib"),
    Option("gpu_memory_utilization", "fraction of GPU memory for weights + activations + KV",
           "cache.gpu_memory_utilization"),
    Option("num_blocks", "force an exact number of KV blocks", "cache.num_blocks"),
    Option("enable_prefix_caching", "reuse KV blocks of shared prompt prefixes", "cache.enable_prefix_caching"),
    Option("watermark", "fraction of KV blocks kept free when admitting (avoids instant preemption)",
           "cache.watermark"),
    Option("tensor_parallel_size", "tensor-parallel ranks per replica", "parallel.tensor_parallel_size"),
    Option("executor", "ray (a Ray worker actor per TP rank) | local (TP=1: the model in the engine "
           "replica's process)", "parallel.executor", default="ray"),
    Option("ray_transport", "actor (plain actor calls) | compiled (Ray compiled graph: faster per step, "
           "busy-polls while idle)", "parallel.ray_transport"),
    Option("threads_per_worker", "torch threads per TP rank on CPU (default: cores // TP size)",
           "parallel.threads_per_worker"),
    Option("max_rank_restarts", "TP-group rebuilds after a rank dies (0: fail in-flight requests instead)",
           "parallel.max_rank_restarts"),
    Option("max_num_seqs", "sequences per step", "scheduler.max_num_seqs"),
    Option("max_num_batched_tokens", "tokens per step (chunked prefill)", "scheduler.max_num_batched_tokens"),
    Option("policy", "fcfs | priority", "scheduler.policy"),
    Option("max_queued_requests", "requests waiting for admission per replica; beyond it HTTP 429",
           "scheduler.max_waiting_requests"),
    Option("step_timeout_s", "a step running longer marks the engine unhealthy (2x: streams end)",
           "step_timeout_s"),
    Option("seed", "engine seed of unseeded sampling", "seed"),
    Option("served_model_name", "the model name clients pass (default: the model folder's name)",
           kind=str, optional=True),
    Option("num_replicas", "engine replicas (each a full TP group)", kind=int, default=1),
    Option("api_key", "require 'Authorization: Bearer KEY' (all routes but /health)", kind=str, optional=True),
    Option("max_body_bytes", "request body limit (413 above it)", kind=int, default=DEFAULT_MAX_BODY_BYTES),
    Option("graceful_shutdown_s", "on shutdown, how long in-flight requests may finish", kind=float,
           default=GRACEFUL_SHUTDOWN_S),
)

NOT_OPTIONS = {
    "parallel.placement_strategy": "in Serve the replica's placement group is always PACK (build_app); "
                                   "the setting only applies to an engine that creates its own group",
}


def _config_field(path: str) -> dataclasses.Field:
    section, _, name = path.rpartition(".")
    owner = _SECTIONS[section] if section else EngineConfig
    return next(f for f in dataclasses.fields(owner) if f.name == name)


def _annotation(field: dataclasses.Field) -> object:
    """The field's type from its string annotation (config.py uses ``from __future__ import annotations``)."""
    kinds = {"str": str, "int": int, "float": float, "bool": bool}
    text = str(field.type).replace(" ", "")
    base = kinds[text.split("|")[0]]
    return base | None if text.endswith("|None") else base


def option_type(option: Option) -> object:
    if option.config is None:
        return option.kind | None if option.optional else option.kind
    return _annotation(_config_field(option.config))


def option_default(option: Option) -> object:
    if option.config is None or option.default is not None:
        return option.default
    return _config_field(option.config).default


def cli_type(option: Option) -> type:
    """The plain type an argparse flag converts to (bool: a --flag/--no-flag pair)."""
    annotation = option_type(option)
    return next(t for t in (bool, int, float, str) if annotation in (t, t | None))


def engine_options() -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if o.config is not None)


def build_app_args_model() -> type[BaseModel]:
    fields = {o.name: (option_type(o), option_default(o)) for o in OPTIONS}
    return create_model("AppArgs", __config__=ConfigDict(extra="forbid", strict=True, protected_namespaces=()),
                        **fields)


AppArgs = build_app_args_model()


def engine_config(args: BaseModel) -> EngineConfig:
    """The EngineConfig of one replica from parsed args (each engine option into its config field)."""
    sections: dict[str, dict] = {name: {} for name in _SECTIONS}
    top: dict[str, object] = {}
    for option in engine_options():
        section, _, name = option.config.rpartition(".")
        (sections[section] if section else top)[name] = getattr(args, option.name)
    return EngineConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()}, **top)


def llm_kwargs(values: dict) -> dict:
    """``LLM(...)`` keyword arguments (config field names) from option values given by name."""
    by_name = {o.name: o for o in engine_options()}
    return {by_name[name].config.rpartition(".")[2]: value for name, value in values.items() if name in by_name}
