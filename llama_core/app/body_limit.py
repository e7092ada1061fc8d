"""A bound on request bodies, for the whole server (the OpenAI API and the page's Gradio routes): a body past
it is answered 413 before the app reads it, so that a few 100 MB posts cannot fill the web process. The bound
may depend on the request (`limit_for`): the web app gives one that has not logged in to a page that asks for a
login a small one (server.body_limit_for)."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional

MAX_BODY_BYTES = 8 * 1024 * 1024  # a request's text is at most 100,000 characters a field; an upload 4 MiB
SMALL_BODY_BYTES = 64 * 1024  # a login form, or the few ids Gradio's /cancel takes

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a declared Content-Length past the limit (`limit`, or limit_for(scope) where given) is
    refused at once; a body sent without one, or chunked (which the web server reads whatever Content-Length
    says: a request declaring 10 bytes sent 32 MB), is read up to the limit, then handed on whole or refused."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES,
                 limit_for: Optional[Callable[[dict], int]] = None) -> None:
        self.app = app
        self.limit = limit
        self.limit_for = limit_for

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit if self.limit_for is None else self.limit_for(scope)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and b"transfer-encoding" not in headers:  # chunked wins over a declared length
            if not declared.isdigit() or int(declared) > limit:
                await self._refuse(scope, send, limit)
                return
            await self.app(scope, receive, send)  # the server reads no more than it declared
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                await self._refuse(scope, send, limit)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, send: Send, limit: int) -> None:
        message = f"the request body is larger than this server takes ({limit:,} bytes)"
        if scope.get("path", "").startswith("/v1/"):  # the OpenAI API's shape
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": "request_too_large"}}
        else:
            body = {"detail": message}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})
