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
from .generation import DEFAULT_CKPT_DIR, Llama, StreamChunk
from .tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ContextLengthError",
    "DEFAULT_CKPT_DIR",
    "Dialog",
    "DialogError",
    "InvalidRequestError",
    "Llama",
    "LlamaError",
    "Message",
    "ModelArgs",
    "Role",
    "ServerBusyError",
    "StreamChunk",
    "StreamDecoder",
    "Tokenizer",
    "UNSAFE_ERROR",
]
