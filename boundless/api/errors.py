"""Errors as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from boundless.api.schemas import INVALID_FUNCTION_PARAMETERS
from boundless.cluster.client import InstanceCallError
from boundless.engine.async_engine import SHUTTING_DOWN, EngineDeadError, QueueFullError, ShuttingDownError
from boundless.engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
# Anthropic's error types by status: the Messages API's errors (``anthropic_error``).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# OpenAI's error codes that a request schema's validator gives as its error's type; any other invalid field's code
# is invalid_value.
VALIDATOR_CODES = frozenset({INVALID_FUNCTION_PARAMETERS})


class APIError(Exception):
    """An error to return to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": _encodable(message),
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": None if param is None else _encodable(param),
            "code": code,
        }
    }


def _encodable(text: str) -> str:
    # A message may quote the client's text, lone surrogates included; the response must still encode as UTF-8.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


ANTHROPIC_ROUTE = "/v1/messages"  # (and below it: count_tokens)


def route_path(scope: Scope) -> str:
    """The request's path as the routes name it: without the ``--root-path`` prefix that uvicorn puts before it (a
    server behind a proxy under ``/llm`` is called at ``/llm/v1/...``, as Starlette's routing reads it)."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def anthropic_route(scope: Scope) -> bool:
    """Whether the request is to Anthropic's Messages routes, whose errors are Anthropic's objects."""
    path = route_path(scope)
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def route_error_response(
    scope: Scope, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error the app gives on any route (no such route or method, an unexpected failure): Anthropic's object on
    the Messages routes, OpenAI's elsewhere."""
    if anthropic_route(scope):
        return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    return error_response(status, message, code=code, headers=headers)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error as Anthropic's API gives it (the Messages routes'): ``{"type": "error", "error": {"type",
    "message"}}``, its type by status."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _encodable(message)}}


def error_bytes(status: int, message: str, code: str | None = None, anthropic: bool = False) -> bytes:
    """An error object's bytes: OpenAI's, or with ``anthropic`` Anthropic's (:func:`anthropic_error`)."""
    body = anthropic_error(status, message) if anthropic else error_body(status, message, code=code)
    return json.dumps(body).encode()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """The message, param and code of a body's first error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), None, "invalid_value"
    param = _error_param(tuple(first.get("loc", ())), getattr(exc, "body", None), first.get("type") == "missing")
    return _field_message(first, param), param, _field_code(first)


def _field_message(error: Any, param: str | None) -> str:
    message = error.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix for ValueError
    return f"{param or 'body'}: {message}"


def _field_code(error: Any) -> str:
    return error["type"] if error.get("type") in VALIDATOR_CODES else "invalid_value"


def part_error(exc: ValidationError, where: str, part: Any) -> APIError:
    """The first error of a part of the body validated on its own (``part``, at ``where`` in the body, e.g.
    ``tools.0``), answered as the body's own would be: the param the path to the field, the code its validator's."""
    first = exc.errors()[0]
    inner = _error_param(tuple(first["loc"]), part, first["type"] == "missing")
    param = f"{where}.{inner}" if inner else where
    return APIError(400, _field_message(first, param), param, _field_code(first))


def _error_param(loc: tuple, body: Any, missing: bool) -> str | None:
    """The request path that a pydantic error location points at, e.g. ``messages.0.content``.

    The location also names the branches of unions (``str``, ``list[int]``); walking the body along it keeps
    only the keys and indices the client wrote. ``missing``: the last key is a required field that is absent.
    """
    if loc[:1] in (("query",), ("path",), ("header",)):  # a URL's parameter (``?limit=abc``): its name
        return ".".join(str(part) for part in loc[1:]) or None
    parts = loc[1:] if loc[:1] == ("body",) else loc
    path: list[str] = []
    node = body
    for k, part in enumerate(parts):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
            path.append(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            path.append(str(part))
        elif missing and k == len(parts) - 1:
            path.append(str(part))
    return ".".join(path) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        # (An adapter the engine no longer holds, one a restarted engine could not load again: OpenAI's 404 for a
        # model not served, as the server's own check answers one it never listed.)
        return error_response(404 if exc.code == "model_not_found" else 400, str(exc), exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(QueueFullError)
    async def _busy(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(
            429, str(exc), code="queue_full", headers={"Retry-After": str(max(1, round(exc.retry_after_s)))}
        )

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_unavailable")

    @app.exception_handler(ShuttingDownError)
    async def _shutting_down(_: Request, exc: ShuttingDownError) -> JSONResponse:
        return error_response(503, str(exc), code="server_shutting_down")

    @app.exception_handler(InstanceCallError)
    async def _instance_failed(_: Request, exc: InstanceCallError) -> JSONResponse:
        # The call alone failed on an instance; its message says which and with what exception.
        return error_response(500, str(exc), code="instance_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # (No such route or method: on Anthropic's paths, e.g. GET /v1/messages, its error object, as its routes')
        message = exc.detail if isinstance(exc.detail, str) else "error"
        return route_error_response(request.scope, exc.status_code, message, headers=getattr(exc, "headers", None))

    app.add_middleware(UnexpectedErrors)


def _unexpected(exc: Exception, scope: Scope) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return route_error_response(scope, 500, f"internal error: {type(exc).__name__}")


class _AnswersBeforeResponse:
    """An ASGI layer that runs the app noting whether its response has begun, and hands an exception of ``caught`` to
    :meth:`_handle` with that: a response not begun can still be answered with an error object."""

    caught: type[BaseException]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except self.caught as exc:
            await self._handle(exc, started, scope, receive, send)

    async def _handle(self, exc: BaseException, started: bool, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class UnexpectedErrors(_AnswersBeforeResponse):
    """A 500 error object for an exception no handler took, the connection kept open.

    Starlette's own last resort (``ServerErrorMiddleware``) re-raises after answering, and uvicorn then
    closes the connection, so a keep-alive client's next call on it fails. This one, just inside it,
    answers and returns. A response already under way is cut off: only closing the connection tells the
    client it is incomplete.
    """

    caught = Exception

    async def _handle(self, exc: BaseException, started: bool, scope: Scope, receive: Receive, send: Send) -> None:
        if started:
            raise exc
        assert isinstance(exc, Exception)
        await _unexpected(exc, scope)(scope, receive, send)


class CancelledRequests(_AnswersBeforeResponse):
    """The outermost layer: a request uvicorn cancels, its graceful shutdown timed out with the request still running
    (the server ends those it can first: ``launch.Server``) or its body still arriving, logs one line, not a
    traceback; one whose response has not begun still gets its 503 error object, one under way is cut off."""

    caught = asyncio.CancelledError

    async def _handle(self, exc: BaseException, started: bool, scope: Scope, receive: Receive, send: Send) -> None:
        log.warning("%s %s cancelled: the server is shutting down", scope.get("method"), scope.get("path"))
        if not started:
            await route_error_response(scope, 503, SHUTTING_DOWN, code="server_shutting_down")(scope, receive, send)
