"""Serving many users: the continuous-batching engine (in this process or a child of its own), the one
request validator, and the token and text streams readers consume."""

from .engine import Engine
from .engine_process import EngineProcess
from .events import Admitted, Channel, Finished, PromptLogprobs, StreamChunk
from .requests import GenerationRequest, SamplingParams
from .streams import RequestFailedError, TextStream, TokenStream, stream_chat, stream_completion

__all__ = [
    "Admitted",
    "Channel",
    "Engine",
    "EngineProcess",
    "Finished",
    "GenerationRequest",
    "PromptLogprobs",
    "RequestFailedError",
    "SamplingParams",
    "StreamChunk",
    "TextStream",
    "TokenStream",
    "stream_chat",
    "stream_completion",
]
