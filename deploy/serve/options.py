"""The options of a served model: build_app's ``args`` (``AppArgs``, also the keys of ``serve.yaml``),
the flags of ``pagedray serve`` and ``pagedray generate`` and the ``EngineConfig`` of a replica
(``engine_config``) all come from ``OPTIONS``.

``OPTIONS`` is generated: one engine option per field of the config dataclasses
(``pagedray.workers.contract.config``: name, type, default and help, from the field's
``metadata["help"]``), so a new config field is an arg and a flag at once, followed by the Serve-only
options listed here. ``NOT_OPTIONS`` lists the engine settings that are deliberately not served, with
why. Tests check that every config field is reachable from ``LLM(...)``, the CLI and the YAML args, and
that docs/configuration.md's table lists each option.

Decisions: docs/design/deploy.md, ``pagedray.deploy.serve.options``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from dataclasses import dataclass

from pagedray.workers.contract.config import SECTIONS as _SECTIONS
from pagedray.workers.contract.config import EngineConfig
from pydantic import BaseModel, ConfigDict, create_model

from ..http.guard import DEFAULT_MAX_BODY_BYTES

DEFAULT_MAX_IMBALANCE = 8   # router_max_imbalance's default (build_app hands it to the router)
GRACEFUL_SHUTDOWN_S = 20.0


@dataclass(frozen=True)
class Option:
    name: str                  # build_app arg; CLI flag --name-with-dashes
    help: str
    config: str | None = None  # "section.field" (or "field" of EngineConfig) for engine options
    kind: type | None = None   # Serve options only: int, float, str, bool, dict (a JSON object on the CLI)
    default: object = None     # Serve options, or a served default that differs from the engine's
    optional: bool = False     # Serve options only: None allowed

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SERVED_DEFAULTS = {"parallel.executor": "ray"}
NOT_OPTIONS = {
    "parallel.placement_strategy": "in Serve the replica's placement group is always PACK (build_app); "
                                   "the setting only applies to an engine that creates its own group",
    "scheduler.tenants": "served as the Serve option 'tenants', which also maps API keys to tenants "
                         "(deploy/http/tenants.py)",
}
SERVE_OPTIONS = (
    Option("served_model_name", "the model name clients pass (default: the model folder's name)",
           kind=str, optional=True),
    Option("num_replicas", "engine replicas (each a full TP group)", kind=int, default=1),
    Option("prefill_replicas", "prefill/decode disaggregation: engine replicas that only run prompts (0: off). A "
           "prompt runs there to its first token, and the request goes on in a decode replica (num_replicas of "
           "them) with the prompt's KV blocks moved over (deploy/serve/disaggregation.py)", kind=int, default=0),
    Option("decode_replicas", "prefill/decode disaggregation: the decode replicas (default: num_replicas)", kind=int,
           optional=True),
    Option("api_key", "require 'Authorization: Bearer KEY' (all routes but /health)", kind=str, optional=True),
    Option("max_body_bytes", "request body limit (413 above it)", kind=int, default=DEFAULT_MAX_BODY_BYTES),
    Option("graceful_shutdown_s", "on shutdown, how long in-flight requests may finish", kind=float,
           default=GRACEFUL_SHUTDOWN_S),
    Option("engine_in_ingress", "run the engine (scheduler, KV block allocator) in the ingress replica: one "
           "process and one Ray stream per request fewer; TP workers stay Ray actors (app.py). Unset: on when "
           "the app has one replica (no autoscaling_config, request_router not cache_aware)", kind=bool,
           optional=True),
    Option("request_router", "how the ingress picks an engine replica: 'cache_aware' (the replica holding the "
           "longest cached prefix of the prompt, within router_max_imbalance of the least load), 'serve' "
           "(Serve's default, power of two choices) or 'auto' (cache_aware with more than one replica)",
           kind=str, default="auto"),
    Option("router_max_imbalance", "cache_aware routing: requests in flight above the least-loaded replica "
           "that a replica holding the prompt's prefix may have and still be chosen", kind=int,
           default=DEFAULT_MAX_IMBALANCE),
    Option("rebalance_threshold", "several engine replicas: a replica whose requests (running + waiting) exceed the "
           "least-loaded replica's by more than this moves half the difference there, running requests with their "
           "KV blocks, streams going on token for token (deploy/serve/rebalance.py; 0: off). Needs the cache_aware "
           "router", kind=int, default=0),
    Option("reasoning_parser", "chat: split <think>...</think> (or gpt-oss' harmony analysis channel) into "
           "reasoning_content: 'auto' ('harmony' when the chat template has <|channel|>, else 'think' when it has "
           "both tags), 'think' (also 'qwen3', 'deepseek_r1'), 'harmony' or 'none'", kind=str, default="auto"),
    Option("tool_call_parser", "chat with tools: the model's tool-call format, 'auto' (read off a chat template "
           "that renders tools; 'hermes' for one that does not: the server's own tool prompt asks for Hermes "
           "blocks), 'hermes', 'llama3_json', 'mistral', 'pythonic', 'qwen3_xml' (Qwen3-Coder, Qwen3.5 / 3.6: "
           "<function=...><parameter=...>) or 'harmony' (gpt-oss)", kind=str, default="auto"),
    Option("autoscaling_config", "Serve's autoscaling of the engine replicas (min_replicas, max_replicas, "
           "target_ongoing_requests, upscale_delay_s, ...; replaces num_replicas)", kind=dict, optional=True),
    Option("models", "more models behind the same API, each an object of this model's options ({model, "
           "served_model_name, task, num_replicas, tensor_parallel_size, ...}: all but the app-wide api_key, "
           "max_body_bytes, graceful_shutdown_s, engine_in_ingress, tenants, prefill/decode_replicas); each gets "
           "its own engine deployment, and a request goes to the model its 'model' names (the first one without "
           "a name). CLI: --model A --model B, or a JSON list", kind=list, optional=True),
    Option("tenants", "fair share among tenants: {name: {api_keys: [...], weight, max_kv_fraction, "
           "max_queued_requests}}; every route then needs a tenant's key or api_key (tenant 'default'); each "
           "engine replica admits and preempts by weighted share and enforces the quotas (429 naming them)",
           kind=dict, optional=True),
)


def config_paths() -> list[str]:
    """Every engine setting as ``section.field`` (or ``field`` of EngineConfig), in declaration order."""
    paths = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SECTIONS:
            paths += [f"{f.name}.{g.name}" for g in dataclasses.fields(_SECTIONS[f.name])]
        else:
            paths.append(f.name)
    return paths


def _engine_option(path: str) -> Option:
    return Option(path.rpartition(".")[2], _config_field(path).metadata["help"], path,
                  default=SERVED_DEFAULTS.get(path))


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


OPTIONS = tuple(_engine_option(path) for path in config_paths() if path not in NOT_OPTIONS) + SERVE_OPTIONS


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
    return next(t for t in (bool, int, float, str, dict, list) if annotation in (t, t | None))


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


DOC_BEGIN = ("<!-- the options table: generated from OPTIONS by `python -m pagedray.deploy.serve.options "
             "docs/configuration.md`; edit the help texts, not this table -->")
DOC_END = "<!-- end of the generated options table -->"


def _doc_value(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def options_markdown() -> str:
    """The options table of docs/configuration.md: every option with its default, where it is set (engine
    options: ``LLM(...)`` keywords too) and its help text."""
    rows = ["| option | default | set in | what it does |", "|---|---|---|---|"]
    for option in OPTIONS:
        where = "serve, CLI" if option.config is None else "serve, CLI, `LLM`"
        help_text = option.help.replace("|", "\\|")
        rows.append(f"| `{option.name}` | {_doc_value(option_default(option))} | {where} | {help_text} |")
    return "\n".join(rows)


def write_options_doc(path: str | pathlib.Path) -> bool:
    """Replaces the generated table in ``path`` (between DOC_BEGIN and DOC_END); True when it changed."""
    path = pathlib.Path(path)
    text = path.read_text()
    head, begin, rest = text.partition(DOC_BEGIN)
    _, end, tail = rest.partition(DOC_END)
    if not begin or not end:
        raise ValueError(f"path: {path} has no generated options table (the two marker comments)")
    new = f"{head}{DOC_BEGIN}\n{options_markdown()}\n{DOC_END}{tail}"
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    print("updated" if write_options_doc(sys.argv[1]) else "unchanged", sys.argv[1])
