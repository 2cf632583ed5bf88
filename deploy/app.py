"""``build_app(args) -> Application``: the Serve application (ingress -> engine deployment).

Used by ``serve run`` / ``serve deploy`` (``import_path: pagedray.deploy.app:build_app`` with
``args``), by the CLI and by tests. ``args`` keys (all optional):

=========================  =====================================================================
model                      ``"default"`` (embedded SmolLM2-135M-Instruct) or a HF model folder
served_model_name          the name clients pass as ``model`` (default: the model's folder name)
tensor_parallel_size       TP ranks per replica (one placement-group bundle each)
executor                   ``ray`` (default: one Ray worker actor per TP rank) or ``auto`` / ``local``
                           (TP=1: the model runs in the engine replica's own process)
threads_per_worker         torch threads per TP rank (default: the node's cores // TP size)
dtype / device             ``auto|float32|float16|bfloat16`` / ``auto|cpu|cuda``
block_size                 KV block size in tokens
kv_cache_gib               KV cache memory per rank on CPU (GiB)
gpu_memory_utilization     fraction of GPU memory the workers may use
num_blocks                 force an exact number of KV blocks (tests)
max_num_seqs               sequences per step
max_num_batched_tokens     tokens per step
max_model_len              context length (default: the model's)
enable_prefix_caching      reuse KV blocks of shared prompt prefixes
max_queued_requests        waiting requests per replica before 429
num_replicas               engine replicas (each a full TP group)
api_key                    require ``Authorization: Bearer <key>`` (all routes but /health)
max_body_bytes             request body limit (413 above it)
graceful_shutdown_s        on shutdown, how long Serve lets the engine's requests in flight finish
=========================  =====================================================================

Decisions:
- Unknown keys are errors (a typo in a YAML file must not be silently ignored); values are checked by
  building the ``EngineConfig`` here, so ``serve deploy`` fails at once with a message naming the field
  instead of crash-looping replicas.
- GPU vs CPU bundles: ``device: auto`` uses GPU bundles when the Ray cluster (or, without Ray, this
  machine) has a GPU.
- Serve's own per-replica concurrency caps are set well above the engine's admission bound
  (``max_num_seqs + max_queued_requests``): by that bound again (at least ``REJECTION_HEADROOM_MIN``)
  for requests that are being rejected, plus ``CONTROL_CALL_HEADROOM``. Overload is thus decided by
  the engine's bounded queue (a fast 429 with an OpenAI body), not by requests queueing inside
  Serve's routers: with the cap at the bound itself, a 10x burst waited in Serve's router backoff and
  its slowest 429 took 7 s instead of well under a second (benchmarks/reliability.py).
- The default executor is ``ray`` also at TP=1. Running the model in the replica's own process (vLLM's
  single-process layout) removes a process and a Ray call per step, but there the step thread shares
  the GIL with Serve's event loop (one streamed output per request per step), and on the 2-core CPU
  machine it served fewer tokens per second than a worker actor (the README's benchmark table, the
  ``pagedray-tp1-local`` row of benchmarks.serving). ``executor: local`` keeps that layout available.
"""

from __future__ import annotations

from pagedray.cluster.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pydantic import BaseModel, ConfigDict, ValidationError
from ray.serve import Application

from .api import DEFAULT_MAX_BODY_BYTES
from .engine_deployment import GRACEFUL_SHUTDOWN_S, SHUTDOWN_MARGIN_S, EngineDeployment, placement_bundles
from .ingress import OpenAIIngress

CONTROL_CALL_HEADROOM = 16  # health / stats / meta calls that must get through a saturated engine
REJECTION_HEADROOM_MIN = 256  # concurrent calls that are only being turned away (429), at least


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    model: str = "default"
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    executor: str = "ray"
    threads_per_worker: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    num_replicas: int = 1
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S


def parse_args(args: dict | None) -> AppArgs:
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
    return parsed


def engine_config(args: AppArgs) -> EngineConfig:
    """The EngineConfig of one replica (Ray executor: the TP workers sit in the replica's bundles)."""
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, executor=args.executor,
                                threads_per_worker=args.threads_per_worker),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting_requests=args.max_queued_requests),
    )


def wants_gpu(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def build_app(args: dict | None = None) -> Application:
    parsed = parse_args(args)
    config = engine_config(parsed)
    use_gpu, in_process = wants_gpu(parsed.device), not config.parallel.use_ray
    admission = parsed.max_num_seqs + parsed.max_queued_requests
    in_flight = admission + max(admission, REJECTION_HEADROOM_MIN) + CONTROL_CALL_HEADROOM
    engine = EngineDeployment.options(
        num_replicas=parsed.num_replicas,
        placement_group_bundles=placement_bundles(parsed.tensor_parallel_size, use_gpu, in_process),
        placement_group_strategy="PACK",
        ray_actor_options={"num_cpus": 1, "num_gpus": 1 if use_gpu and in_process else 0},
        max_ongoing_requests=in_flight,
        graceful_shutdown_timeout_s=parsed.graceful_shutdown_s,
    ).bind(config)
    ingress = OpenAIIngress.options(max_ongoing_requests=in_flight * parsed.num_replicas,
                                    graceful_shutdown_timeout_s=parsed.graceful_shutdown_s + SHUTDOWN_MARGIN_S).bind(
        engine, model=parsed.model, served_model_name=parsed.served_model_name, api_key=parsed.api_key,
        max_body_bytes=parsed.max_body_bytes)
    return ingress
