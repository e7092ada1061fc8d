"""Requests to the API from web pages on this machine (a chat front-end at http://localhost:3000, say), allowed
as the page's own Gradio routes allow them: Starlette's CORSMiddleware for the API's paths alone, answering
origins on localhost. Keys travel in the Authorization header, never in cookies, so no credentials are allowed."""

from __future__ import annotations

from typing import Any

from starlette.middleware.cors import CORSMiddleware

API_PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/health")
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


class LocalOrigins:
    """ASGI middleware: the API's paths answer cross-origin requests (preflights too) from pages on localhost;
    every other path goes on as it is (Gradio's page answers its own)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.cors = CORSMiddleware(app, allow_origin_regex=LOCAL_ORIGINS, allow_methods=["GET", "POST", "DELETE"],
                                   allow_headers=["*"], expose_headers=["Retry-After"])

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(API_PATHS):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
