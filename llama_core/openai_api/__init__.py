"""An OpenAI-compatible HTTP API (FastAPI) on a running engine; needs the app's dependencies (FastAPI and
pydantic come with Gradio)."""

from .routes import create_api

__all__ = ["create_api"]
