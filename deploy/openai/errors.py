"""HTTP error mapping: every failure leaves the server as an OpenAI-style JSON body.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}``.

Mapping (decided here, used by http/routes.py and by the SSE path):
- ``APIError`` (raised by validation): its own status (400 / 401 / 404 / 413).
- ``ValueError``: 400 ``invalid_request_error``; when the message starts with ``"<field>: "`` (the
  convention of SamplingParams and the configs) the field becomes ``param``.
- ``QueueFullError``: 429 ``rate_limit_error`` with a ``Retry-After`` header (seconds).
- ``EngineDrainingError`` / ``EngineDeadError``: 503 ``service_unavailable``.
- An engine error (``EngineError``: e.g. a request whose sample failed, finish_reason "error"): 500
  ``internal_error`` with the engine's short message.
- Anything else: 500 ``internal_error`` with a fixed message; the exception goes to the log (a client
  never sees a traceback, a path or another request's text).

Exceptions raised inside the engine replica arrive wrapped by Ray (``RayTaskError``); Ray makes the
wrapper a subclass of the original class, so ``isinstance`` still works, but the message then holds a
traceback; ``engine_error_message`` digs out the original exception's text.
"""

from __future__ import annotations

import json
import logging
import re

from pagedray.cluster.outputs import EngineDeadError, EngineDrainingError, EngineError, QueueFullError

logger = logging.getLogger(__name__)
INTERNAL_ERROR_MESSAGE = "internal error (the server log has the details)"

RETRY_AFTER_S = 1
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")


class APIError(Exception):
    """A client-visible error with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        # picklable with all fields (it crosses Ray when raised through a DeploymentHandle)
        return (APIError, (self.status, self.message, self.err_type, self.param, self.code, self.headers))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code}}


    def body_bytes(self) -> bytes:
        """``body()`` as JSON bytes, for the layers below FastAPI (raw HTTP, plain ASGI)."""
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_api_key() -> APIError:
    """401 for a missing or wrong ``Authorization: Bearer`` key (the routes and Serve's guarded paths)."""
    return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error", code="invalid_api_key", headers={"www-authenticate": "Bearer"})


def _original(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the user exception here
    return cause if isinstance(cause, BaseException) else exc


def engine_error_message(exc: BaseException) -> str:
    return str(_original(exc)) or type(_original(exc)).__name__


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception from validation or the engine to an APIError (see the module docstring)."""
    if isinstance(exc, APIError):
        return exc
    original = _original(exc)
    message = engine_error_message(exc)
    if isinstance(original, QueueFullError):
        return APIError(429, message or "the request queue is full; retry later", "rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(original, (EngineDrainingError, EngineDeadError)):
        code = "engine_draining" if isinstance(original, EngineDrainingError) else "engine_dead"
        return APIError(503, message, "service_unavailable", code=code)
    if isinstance(original, ValueError):
        match = _FIELD_PREFIX.match(message)
        return bad_request(message, param=match.group(1) if match else None)
    if isinstance(original, EngineError):   # the engine's own messages: fixed or short, nothing internal
        return APIError(500, message, "internal_error")
    logger.error("internal error answered with a 500", exc_info=exc)
    return APIError(500, INTERNAL_ERROR_MESSAGE, "internal_error")


def health_reason(exc: BaseException) -> str:
    """The reason /health gives for ``exc``: the engine's own fixed message ("engine dead: ...", "draining",
    a rank being rebuilt, a stalled step), or a fixed text for anything else (logged, never shown)."""
    original = _original(exc)
    if isinstance(original, EngineError):
        return engine_error_message(exc)
    logger.warning("health check failed", exc_info=exc)
    return "engine unavailable (the server log has the details)"
