"""The page's own head script, put into the HTML of the page itself, before Gradio's scripts.

Gradio adds a Blocks' `head` to the page only once its client has connected to the server, from the app's
config, after it has set up listeners of its own: one of them closes the page's connection to the server as soon
as the browser is about to leave, so that a user who then chose to stay (the browser asks while a reply streams)
had the reply frozen. Run first, the page's listener decides before Gradio's (llama_core/app/store.js).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def with_head_first(page: bytes, html: bytes) -> bytes:
    """The HTML page with `html` before its first script (after its <meta charset>, before Gradio's config and
    code); unchanged where it has no script."""
    at = page.find(b"<script")
    return page if at < 0 else page[:at] + html + page[at:]


class PageHead:
    """ASGI middleware: `html` first in the page served at `path` (GET, an HTML answer, not compressed)."""

    def __init__(self, app: Any, html: str, path: str = "/") -> None:
        self.app = app
        self.html = html.encode("utf-8")
        self.path = path

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") != self.path:
            await self.app(scope, receive, send)
            return
        start: dict = {}
        parts: list[bytes] = []

        async def held(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = {name.lower(): value for name, value in message.get("headers", ())}
                html = headers.get(b"content-type", b"").startswith(b"text/html")
                if not html or b"content-encoding" in headers:
                    start["passed"] = True
                    await send(message)
                else:
                    start.update(message)
                return
            if start.get("passed") or message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = with_head_first(b"".join(parts), self.html)
            headers = [(name, value) for name, value in start.get("headers", ()) if name.lower() != b"content-length"]
            await send(dict(start, headers=headers + [(b"content-length", str(len(body)).encode())]))
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, held)
