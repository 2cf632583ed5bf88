"""``build_app(args) -> Application``: the Serve application (ingress holding the engine, or ingress ->
engine deployment).

Used by ``serve run`` / ``serve deploy`` (``import_path: pagedray.deploy.app:build_app`` with
``args``), by the CLI and by tests. ``args`` keys (all optional) are the options of ``options.py``
(one list: names, types, defaults, help; docs/configuration.md's table shows them).

Decisions: docs/design/deploy.md, ``pagedray.deploy.serve.app``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedray.workers.contract.config import EngineConfig
from pydantic import BaseModel, ValidationError
from ray.serve import Application

from ..http.tenants import parse_tenants
from ..openai.reasoning import PARSER_ALIASES, REASONING_PARSERS
from ..openai.tool_parsers import TOOL_CALL_PARSERS
from ..routing.router import PREFIX_SUMMARY_BLOCKS
from .disaggregation import PREFILL_DEPLOYMENT_NAME
from .engine_deployment import ENGINE_DEPLOYMENT_NAME, SHUTDOWN_MARGIN_S, EngineDeployment, placement_bundles
from .ingress import OpenAIIngress
from .options import AppArgs, engine_config

ROUTERS = ("auto", "cache_aware", "serve")
CONTROL_CALL_HEADROOM = 16  # health / stats / meta calls that must get through a saturated engine
REJECTION_HEADROOM_MIN = 256  # concurrent calls that are only being turned away (429), at least


def parse_args(args: dict | None) -> BaseModel:
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "args"
        raise ValueError(f"{field}: {first['msg']}") from None
    if parsed.num_replicas < 1:
        raise ValueError(f"num_replicas: must be >= 1, got {parsed.num_replicas}")
    if parsed.max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes: must be >= 1024, got {parsed.max_body_bytes}")
    if not 0 < parsed.graceful_shutdown_s <= 3600:
        raise ValueError(f"graceful_shutdown_s: must be in (0, 3600] seconds, got {parsed.graceful_shutdown_s}")
    if parsed.request_router not in ROUTERS:
        raise ValueError(f"request_router: must be one of {sorted(ROUTERS)}, got {parsed.request_router!r}")
    if PARSER_ALIASES.get(parsed.reasoning_parser, parsed.reasoning_parser) not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS + tuple(PARSER_ALIASES))}, "
                         f"got {parsed.reasoning_parser!r}")
    if parsed.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser: must be one of auto, {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {parsed.tool_call_parser!r}")
    if parsed.router_max_imbalance < 0:
        raise ValueError(f"router_max_imbalance: must be >= 0, got {parsed.router_max_imbalance}")
    if parsed.engine_in_ingress is True and parsed.request_router == "cache_aware":
        raise ValueError("request_router: cache_aware routes between engine replicas; with engine_in_ingress "
                         "there is no engine deployment to route to")
    if parsed.autoscaling_config is not None:
        if "num_replicas" in parsed.model_fields_set:
            raise ValueError("num_replicas: give either num_replicas or autoscaling_config, not both")
        check_autoscaling(parsed.autoscaling_config)
    check_disaggregation(parsed)
    check_rebalancing(parsed)
    if parsed.models is not None and parsed.engine_in_ingress is True:
        raise ValueError("engine_in_ingress: with models, each model's engine runs in a deployment of its own")
    if parsed.models is not None and parsed.prefill_replicas:
        raise ValueError("prefill_replicas: not with models (disaggregation serves one model)")
    return parsed


# options of the whole app, not of one model of ``models``
APP_WIDE = ("api_key", "max_body_bytes", "graceful_shutdown_s", "engine_in_ingress", "tenants", "models",
            "prefill_replicas", "decode_replicas")


def parse_models(parsed: BaseModel) -> list[BaseModel]:
    """The parsed options of each entry of ``models`` (the models served beside the first; every option but the
    app-wide ones, defaults for those not given): ValueError naming ``models[i].field``."""
    entries = []
    for i, entry in enumerate(parsed.models or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"models[{i}]: must be an object of options with its 'model'")
        app_wide = sorted(set(entry) & set(APP_WIDE))
        if app_wide:
            raise ValueError(f"models[{i}].{app_wide[0]}: an option of the whole app, not of one model")
        try:
            entry_args = parse_args({**entry, "engine_in_ingress": False})
            engine_config(entry_args)           # the config dataclasses' own checks
            entries.append(entry_args)
        except ValueError as exc:
            raise ValueError(f"models[{i}].{exc}") from None
    names = [parsed.served_model_name or parsed.model] + [e.served_model_name or e.model for e in entries]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"models: two models would be served as {twice!r}; give each a served_model_name")
    return entries


def check_rebalancing(parsed: BaseModel) -> None:
    """``rebalance_threshold`` (``rebalance.py``): ValueError naming it when it is negative or cannot work."""
    if parsed.rebalance_threshold < 0:
        raise ValueError(f"rebalance_threshold: must be >= 0, got {parsed.rebalance_threshold}")
    if parsed.rebalance_threshold and parsed.request_router == "serve":
        raise ValueError("rebalance_threshold: needs request_router 'cache_aware' or 'auto' (its summaries give "
                         "each replica its peers' loads)")
    if parsed.rebalance_threshold and parsed.engine_in_ingress is True:
        raise ValueError("rebalance_threshold: moves requests between engine replicas; with engine_in_ingress "
                         "there is one engine per ingress and nothing to move them to")


def check_disaggregation(parsed: BaseModel) -> None:
    """Prefill/decode disaggregation's options (``disaggregation.py``): ValueError naming the one that conflicts."""
    if parsed.prefill_replicas < 0:
        raise ValueError(f"prefill_replicas: must be >= 0, got {parsed.prefill_replicas}")
    if parsed.decode_replicas is not None:
        if not parsed.prefill_replicas:
            raise ValueError("decode_replicas: only with prefill_replicas (else the engine replicas are num_replicas)")
        if parsed.decode_replicas < 1:
            raise ValueError(f"decode_replicas: must be >= 1, got {parsed.decode_replicas}")
        if "num_replicas" in parsed.model_fields_set or parsed.autoscaling_config is not None:
            raise ValueError("decode_replicas: give decode_replicas, num_replicas or autoscaling_config, one of them")
    if parsed.prefill_replicas and parsed.engine_in_ingress is True:
        raise ValueError("engine_in_ingress: prefill_replicas needs the engines in deployments of their own")


def check_autoscaling(config: dict) -> int:
    """ValueError naming the field unless Serve accepts ``config`` as an AutoscalingConfig; its max_replicas."""
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:   # Serve's model would ignore them: a typo must not pass silently
        raise ValueError(f"autoscaling_config: unknown keys {unknown}")
    try:
        return AutoscalingConfig(**config).max_replicas
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "".join(f".{part}" for part in first["loc"])
        raise ValueError(f"autoscaling_config{field}: {first['msg']}") from None


def router_config(parsed: BaseModel, most_replicas: int, block_size: int) -> dict:
    """The engine deployment's ``request_router_config`` option, or none for Serve's default router."""
    from ray.serve.config import RequestRouterConfig

    from ..routing.router import ROUTING_STATS_PERIOD_S, CacheAwareRouter

    cache_aware = parsed.request_router == "cache_aware" or (parsed.request_router == "auto" and most_replicas > 1)
    if not cache_aware:
        return {}
    return {"request_router_config": RequestRouterConfig(
        request_router_class=CacheAwareRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_router_kwargs={"block_size": block_size, "max_imbalance": parsed.router_max_imbalance})}


def engine_in_ingress(parsed: BaseModel, most_replicas: int) -> bool:
    """The layout: ``engine_in_ingress`` when given, else in the ingress exactly when there is one engine
    replica to route to (no ``autoscaling_config`` that can add more, no cache-aware router asked for)."""
    if parsed.engine_in_ingress is not None:
        return parsed.engine_in_ingress
    return most_replicas == 1 and parsed.autoscaling_config is None and parsed.request_router != "cache_aware"


def wants_gpu(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class ModelEngine:
    """One model's engine replicas as build_app lays them out."""

    config: EngineConfig
    replica: dict            # its deployment's options: replicas, placement, max_ongoing_requests
    most_replicas: int
    in_flight: int           # calls one replica takes at once


def model_engine(parsed: BaseModel, tenants: tuple) -> ModelEngine:
    """The engine config and replica options of one model's parsed args (``tenants``: the app's)."""
    config = engine_config(parsed)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, tenants=tenants))
    use_gpu, in_process = wants_gpu(parsed.device), not config.parallel.use_ray
    admission = parsed.max_num_seqs + parsed.max_queued_requests
    in_flight = admission + max(admission, REJECTION_HEADROOM_MIN) + CONTROL_CALL_HEADROOM
    scaling = parsed.autoscaling_config
    count = parsed.decode_replicas or parsed.num_replicas
    replicas = {"num_replicas": count} if scaling is None else {"autoscaling_config": scaling}
    most_replicas = count if scaling is None else check_autoscaling(scaling)
    replica = dict(
        **replicas,
        placement_group_bundles=placement_bundles(parsed.tensor_parallel_size, use_gpu, in_process),
        placement_group_strategy="PACK",
        ray_actor_options={"num_cpus": 1, "num_gpus": 1 if use_gpu and in_process else 0},
        max_ongoing_requests=in_flight,
    )
    return ModelEngine(config, replica, most_replicas, in_flight)


def engine_deployment(parsed: BaseModel, engine: ModelEngine, name: str) -> Application:
    """The engine deployment of one model: its replicas, routed by the cache-aware router when it has a choice."""
    routing = router_config(parsed, engine.most_replicas, engine.config.cache.block_size)
    summary_blocks = PREFIX_SUMMARY_BLOCKS if routing else 0   # Serve's own router reads no prefix summary
    return EngineDeployment.options(**engine.replica, name=name, graceful_shutdown_timeout_s=parsed.graceful_shutdown_s,
                                    **routing).bind(engine.config, prefix_summary_blocks=summary_blocks,
                                                    rebalance_threshold=parsed.rebalance_threshold)


def build_app(args: dict | None = None) -> Application:
    parsed = parse_args(args)
    more = parse_models(parsed)
    tenants, tenant_keys = parse_tenants(parsed.tenants)
    first = model_engine(parsed, tenants)
    config = first.config
    ingress_args = dict(model=parsed.model, served_model_name=parsed.served_model_name, api_key=parsed.api_key,
                        max_body_bytes=parsed.max_body_bytes, reasoning_parser=parsed.reasoning_parser,
                        tool_call_parser=parsed.tool_call_parser, tenant_keys=tenant_keys)
    if not parsed.prefill_replicas and not more and engine_in_ingress(parsed, first.most_replicas):
        return OpenAIIngress.options(**first.replica, graceful_shutdown_timeout_s=parsed.graceful_shutdown_s).bind(
            config, **ingress_args, ingress_replicas=first.most_replicas)
    engine = engine_deployment(parsed, first, ENGINE_DEPLOYMENT_NAME)
    if parsed.prefill_replicas:
        prefill_routing = router_config(parsed, parsed.prefill_replicas, config.cache.block_size)
        ingress_args["prefill_engine"] = EngineDeployment.options(
            **{**first.replica, "num_replicas": parsed.prefill_replicas, "autoscaling_config": None},
            name=PREFILL_DEPLOYMENT_NAME, graceful_shutdown_timeout_s=parsed.graceful_shutdown_s, **prefill_routing,
        ).bind(config, prefix_summary_blocks=PREFIX_SUMMARY_BLOCKS if prefill_routing else 0)
    in_flight = first.in_flight * first.most_replicas
    if more:
        ingress_args["models"] = []
        for i, model_args in enumerate(more, start=1):
            layout = model_engine(model_args, tenants)
            in_flight += layout.in_flight * layout.most_replicas
            ingress_args["models"].append({
                "engine": engine_deployment(model_args, layout, f"{ENGINE_DEPLOYMENT_NAME}-{i}"),
                "model": model_args.model, "served_model_name": model_args.served_model_name,
                "reasoning_parser": model_args.reasoning_parser, "tool_call_parser": model_args.tool_call_parser})
    return OpenAIIngress.options(max_ongoing_requests=in_flight,
                                 graceful_shutdown_timeout_s=parsed.graceful_shutdown_s + SHUTDOWN_MARGIN_S).bind(
        engine, **ingress_args)
