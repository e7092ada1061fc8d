"""llama_core: Llama-2 inference in PyTorch."""

from .config import ModelArgs
from .dialog import Dialog, Message, Role, UNSAFE_ERROR
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ContextLengthError,
    DialogError,
    InvalidRequestError,
    LlamaError,
    ServerBusyError,
)
from .generation import ChatPrediction, CompletionPrediction, Llama
from .loader import DEFAULT_CKPT_DIR, LoadedModel, ModelInfo, load
from .runner import ModelRunner
from .serving import (
    Engine,
    EngineProcess,
    GenerationRequest,
    RequestFailedError,
    SamplingParams,
    StreamChunk,
    TextStream,
    TokenStream,
    stream_chat,
    stream_completion,
)
from .tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "ChatPrediction",
    "CheckpointError",
    "CompletionPrediction",
    "CheckpointNotFoundError",
    "ContextLengthError",
    "DEFAULT_CKPT_DIR",
    "Dialog",
    "DialogError",
    "Engine",
    "EngineProcess",
    "GenerationRequest",
    "InvalidRequestError",
    "Llama",
    "LlamaError",
    "LoadedModel",
    "Message",
    "ModelArgs",
    "ModelInfo",
    "ModelRunner",
    "RequestFailedError",
    "SamplingParams",
    "Role",
    "ServerBusyError",
    "StreamChunk",
    "StreamDecoder",
    "TextStream",
    "TokenStream",
    "Tokenizer",
    "UNSAFE_ERROR",
    "load",
    "stream_chat",
    "stream_completion",
]
