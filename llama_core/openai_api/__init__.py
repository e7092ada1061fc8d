"""An OpenAI-compatible HTTP API (FastAPI) on a running engine, with Prometheus metrics; needs the app's
dependencies (FastAPI and pydantic come with Gradio, prometheus_client does not)."""

from .routes import create_api

__all__ = ["create_api"]
