"""ASGI middleware that rejects a request before it reaches a route: body size and API key. Its errors are OpenAI's
objects, Anthropic's on Anthropic's Messages routes, as those routes' own errors are."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from boundless.api.errors import anthropic_route, error_bytes, route_path

OPEN_PATHS = ("/health", "/version")  # (vLLM asks no key for either)


async def _send_error(
    scope: Scope, send: Send, status: int, message: str, code: str, headers: list | None = None
) -> None:
    body = error_bytes(status, message, code, anthropic=anthropic_route(scope))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """413 for a body over ``max_bytes``, whether it declares its length or streams it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(scope, send, 413, f"request body exceeds {self.max_bytes} bytes", "body_too_large")
            return
        # Read the whole body here so an undeclared oversized body is caught before any route runs.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(scope, send, 413, f"request body exceeds {self.max_bytes} bytes", "body_too_large")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as a server would report it

        await self.app(scope, replay, send)


class APIKeyAuth:
    """401 unless ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's), on every
    route but the open ones."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS:
            headers = dict(scope.get("headers", []))
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            keyed = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
            if not (bearer or keyed):
                await _send_error(
                    scope,
                    send,
                    401,
                    "missing or invalid API key",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)
