"""A bound on request bodies, for the whole server (the OpenAI API and the page's Gradio routes): a body past
it is answered 413 before the app reads it, so that a few 100 MB posts cannot fill the web process. The bound
may depend on the request (`limit_for`): the web app gives one that has not logged in to a page that asks for a
login a small one (server.body_limit_for). A JSON body is also bounded in the lists and objects it holds, which
the app's JSON parsing and Gradio's handling of a value build and walk on the event loop."""

from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable, Optional

from starlette.concurrency import run_in_threadpool

MAX_BODY_BYTES = 8 * 1024 * 1024  # a request's text is at most 100,000 characters a field; an upload 4 MiB
SMALL_BODY_BYTES = 64 * 1024  # a login form, or the few ids Gradio's /cancel takes
# The page's events carry the whole conversation store (the browser's storage for the app holds ~5 M
# characters, ~3.7 MB of it as JSON), a merge of two tabs' changes two of them, one as a JSON string (its quotes
# escaped): up to ~12 MB. Two near-full stores past 8 MiB were refused, and the other tab's change was lost.
PAGE_BODY_BYTES = 16 * 1024 * 1024
# Lists and objects in a JSON body: one every 16 bytes of the largest body. A store of conversations holds one
# every ~150 bytes (two a message; ~35 where every message is "hi"). 8 MiB of nested empty lists, 3.2 million,
# held the event loop over 5 s in Gradio (it walks a value on the loop); 520,000 of them, 2 s.
MAX_JSON_CONTAINERS = MAX_BODY_BYTES // 16
_BACKSLASH = b"\\"
_JSON_STRING = re.compile(rb'"[^"]*"')  # a string once its escapes are gone


def json_containers(body: bytes) -> int:
    """How many lists and objects a JSON text opens (brackets inside its strings not counted); well past
    MAX_JSON_CONTAINERS only where the text holds that many brackets at all."""
    brackets = body.count(b"[") + body.count(b"{")
    if brackets <= MAX_JSON_CONTAINERS:
        return brackets
    # The escapes go first, left to right as JSON reads them (an escaped backslash, then an escaped quote):
    # a string is then the text between two quotes, found in one pass. (A pattern reading the escapes took
    # time as the square of a run of escaped quotes with no closing one: 0.6 MB held the event loop 10 s.)
    unescaped = body.replace(_BACKSLASH * 2, b"").replace(_BACKSLASH + b'"', b"")
    unquoted = _JSON_STRING.sub(b"", unescaped)
    return unquoted.count(b"[") + unquoted.count(b"{")

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a declared Content-Length past the limit (`limit`, or limit_for(scope) where given) is
    refused at once; a body sent without one, or chunked (which the web server reads whatever Content-Length
    says: a request declaring 10 bytes sent 32 MB), is read up to the limit, then handed on whole or refused.
    A JSON body holding more than MAX_JSON_CONTAINERS lists and objects (any body but an upload's) is refused
    once read."""

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
        # JSON, or read as JSON: FastAPI reads a body without a Content-Type as JSON (an upload's is not)
        is_json = not headers.get(b"content-type", b"").lower().startswith(b"multipart/")
        if declared is not None and b"transfer-encoding" not in headers:  # chunked wins over a declared length
            if not declared.isdigit() or int(declared) > limit:
                await self._refuse(scope, send, limit)
                return
            if not is_json or int(declared) <= MAX_JSON_CONTAINERS:  # too short to hold too many
                await self.app(scope, receive, send)  # the server reads no more than it declared
                return
        elif scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
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
        if is_json and size > MAX_JSON_CONTAINERS:
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
            containers = await run_in_threadpool(json_containers, body)  # its strings left out: 0.6 s for 8 MiB
            if containers > MAX_JSON_CONTAINERS:
                await self._refuse(scope, send, limit, f"the request's JSON holds {containers:,} lists and objects; "
                                                       f"this server takes at most {MAX_JSON_CONTAINERS:,}")
                return

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, send: Send, limit: int, message: str = "") -> None:
        message = message or f"the request body is larger than this server takes ({limit:,} bytes)"
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
