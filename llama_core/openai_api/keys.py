"""API keys: who a request's client is (its key, by its place in the list, or its address where no keys are set),
and a request without a valid key refused from its headers alone, before anything reads its body.

FastAPI reads and parses a request's body before it runs the route's dependencies: checked there, an 8 MiB
body sent with no key held the web server's event loop for seconds (every user's page and API with it) before
its 401. KeyCheck checks the key as the request arrives instead."""

from __future__ import annotations

import hmac
from typing import Any, Callable, Optional, Sequence

from fastapi import Request
from starlette.datastructures import Headers

from .errors import APIError

BEARER = {"WWW-Authenticate": "Bearer"}  # a 401's challenge (RFC 6750): the scheme a key is sent in


class ApiKeys:
    """The keys a server takes (none: every client is let in, named by its address)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys = [key.encode() for key in keys]

    def client(self, headers: Headers, address: Optional[tuple[str, int]]) -> str:
        """The engine's name for the client sending these headers from `address`: "key:N" (the key by its place
        in the list: no secret in the engine) or, where no keys are set, "address:HOST". Raises APIError (401)
        for a missing or unknown key."""
        if not self._keys:
            return f"address:{address[0] if address else 'unknown'}"
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "no API key given: send it as the header 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key", headers=BEARER)
        held = next((i for i, key in enumerate(self._keys) if hmac.compare_digest(given.strip().encode(), key)), None)
        if held is None:
            raise APIError(401, "the API key given is not valid for this server", code="invalid_api_key",
                           headers=BEARER)
        return f"key:{held}"

    async def authorized(self, request: Request) -> None:  # async: no worker thread for a header check
        """A route's dependency: the request's client, in request.state.client (KeyCheck has named it already
        where it runs; a request that reached the route without it is checked here)."""
        if getattr(request.state, "client", None) is None:
            request.state.client = self.client(request.headers, request.client)


class KeyCheck:
    """ASGI middleware: a request for a route that `guarded(scope)` says needs a key is checked before the app
    sees it; refused, it gets its 401 without its body read; let in, its client is in its state."""

    def __init__(self, app: Any, keys: ApiKeys, guarded: Callable[[dict], bool]) -> None:
        self.app, self.keys, self.guarded = app, keys, guarded

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.guarded(scope):
            try:
                client = self.keys.client(Headers(scope=scope), scope.get("client"))
            except APIError as exc:
                refusal = exc.response()
                refusal.headers["connection"] = "close"  # its body, if it sent one, is not read
                await refusal(scope, receive, send)
                return
            scope.setdefault("state", {})["client"] = client
        await self.app(scope, receive, send)
