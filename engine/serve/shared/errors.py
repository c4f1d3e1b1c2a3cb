"""How the served engine says no: OpenAI's error object, and the one place an error becomes an HTTP status.

Every refusal on every route goes through :func:`status_of` (the way TGI keeps one error-to-status mapping): the
call path (:mod:`engine.serve.shared.calls`), the weight-sync routes, the API-key gate and the app's last-resort
handlers. :data:`STATUS` is the whole table, first match wins:

>>> [(kind.__name__, status) for kind, status, _ in STATUS]  # doctest: +NORMALIZE_WHITESPACE
[('Unauthenticated', 401), ('UnknownModel', 404), ('UnknownAdapter', 404), ('ClientGone', 499), ('EngineDead', 503),
 ('WeightSyncConflict', 409), ('WeightSyncFailed', 500), ('RequestTimedOut', 408),
 ('RequestTooLarge', 413), ('EngineError', 400), ('Exception', 500)]
>>> status_of(RequestTooLarge("stop.strings", 3, "holds too many")), status_of(RequestTooLarge("body", 9, "is big"))
(400, 413)
"""

from __future__ import annotations

from typing import Any

from engine.errors import EngineError, RequestError, RequestTimedOut, RequestTooLarge


class UnknownModel(RequestError):
    """``model`` names a model this server does not serve (404, as ``vllm serve`` answers)."""

    def __init__(self, name: Any, served: str) -> None:
        super().__init__("model", name, f"does not exist: this server serves {served!r}",
                         fix="send the served model's name (GET /v1/models lists it)")
        self.message = f"The model {name!r} does not exist: this server serves {served!r} (GET /v1/models)."

    def __str__(self) -> str:
        return self.message


class UnknownAdapter(RequestError):
    """A LoRA adapter name this server has not loaded, on vLLM's unload route (404 with vLLM's message)."""

    def __init__(self, name: Any, loaded: Any) -> None:
        super().__init__("lora_name", name, f"is not a loaded adapter (loaded: {', '.join(loaded) or 'none'})",
                         fix="name one that GET /v1/models lists with a parent")
        self.message = f"The lora adapter {name!r} cannot be found."

    def __str__(self) -> str:
        return self.message


class ClientGone(EngineError):
    """The client went away before its answer; the generation was cancelled (499, nginx's status for it)."""

    def __str__(self) -> str:
        return "client disconnected"


class Unauthenticated(EngineError):
    """A request without the server's API key (401)."""

    def __str__(self) -> str:
        return ("missing or invalid API key: send 'Authorization: Bearer <key>' (the server's --api-key / "
                "ENGINE_API_KEY)")


class EngineDead(EngineError):
    """The engine behind the server died (its engine core is gone): ``/health`` answers 503 with its report, so that
    a load balancer or a trainer's wait stops sending work."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the engine is dead: {reason}")


class WeightSyncConflict(EngineError):
    """A weight call the server's weight-sync state cannot take now (a push before any ``/init_communicator/``):
    409, naming the cause, before anything is started."""


class WeightSyncFailed(EngineError):
    """A background weight-sync call failed after its 200; the next weight call reports it (500)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"weight sync failed: {type(cause).__name__}: {cause}")


STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (Unauthenticated, 401, "authentication_error"),
    (UnknownModel, 404, "NotFoundError"),
    (UnknownAdapter, 404, "NotFoundError"),
    (ClientGone, 499, "invalid_request_error"),
    (EngineDead, 503, "server_error"),
    (WeightSyncConflict, 409, "conflict_error"),
    (WeightSyncFailed, 500, "server_error"),
    (RequestTimedOut, 408, "invalid_request_error"),
    (RequestTooLarge, 413, "invalid_request_error"),  # the body only (see status_of); a list over a limit is a 400
    (EngineError, 400, "invalid_request_error"),
    (Exception, 500, "internal_error"),
)
"""Error class -> (HTTP status, OpenAI error ``type``); the first class the error is an instance of wins."""


def status_of(err: BaseException) -> int:
    """The HTTP status of ``err`` (see :data:`STATUS`)."""
    return _entry(err)[0]


def _entry(err: BaseException) -> tuple[int, str]:
    for kind, status, name in STATUS:
        if isinstance(err, kind):
            if kind is RequestTooLarge and getattr(err, "field", None) != "body":
                continue
            return status, name
    raise AssertionError("unreachable: Exception matches every error")


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    """OpenAI's error object.

    >>> error_body("n is not supported", param="n")
    {'error': {'message': 'n is not supported', 'type': 'invalid_request_error', 'param': 'n', 'code': 400}}
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: BaseException, fields: Any = None, *, headers: dict[str, str] | None = None) -> Any:
    """The JSON response refusing ``err``: its status and type from :data:`STATUS`, its field named as the client
    sent it (``fields``: the surface's :class:`~engine.serve.shared.fields.FieldTable`; None: as raised)."""
    from fastapi.responses import JSONResponse

    if fields is not None and isinstance(err, EngineError):
        err = fields.rename(err)
    status, kind = _entry(err)
    return JSONResponse(error_body(str(err), kind=kind, param=getattr(err, "field", None), code=status), status,
                        headers=headers)
