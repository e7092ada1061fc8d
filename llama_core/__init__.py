"""llama_core: Llama-2 inference in PyTorch.

The names below load on first use (PEP 562), so `import llama_core` and its light modules (the command
lines' argument checks, llama_core.resources) cost milliseconds: torch is imported by the first name that
needs it, not by the package.
"""

from .lazy_exports import lazy_exports

# name -> the module defining it
_MODULES = {
    "ModelArgs": ".config",
    "Dialog": ".dialog",
    "Message": ".dialog",
    "Role": ".dialog",
    "UNSAFE_ERROR": ".dialog",
    "CheckpointError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "ContextLengthError": ".errors",
    "DialogError": ".errors",
    "EngineUnavailableError": ".errors",
    "InvalidRequestError": ".errors",
    "LlamaError": ".errors",
    "ServerBusyError": ".errors",
    "ChatPrediction": ".generation",
    "CompletionPrediction": ".generation",
    "Llama": ".generation",
    "Grammar": ".grammar",
    "LoadedModel": ".loader",
    "ModelInfo": ".loader",
    "load": ".loader",
    "DEFAULT_CKPT_DIR": ".resources",
    "ModelRunner": ".runner",
    "Engine": ".serving",
    "EngineLostError": ".serving",
    "EngineProcess": ".serving",
    "GenerationRequest": ".serving",
    "GrammarFailedError": ".serving",
    "RequestFailedError": ".serving",
    "SamplingParams": ".serving",
    "StreamChunk": ".serving",
    "TextStream": ".serving",
    "TokenStream": ".serving",
    "stream_chat": ".serving",
    "stream_completion": ".serving",
    "StreamDecoder": ".tokenizer",
    "Tokenizer": ".tokenizer",
}

__all__ = sorted(_MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
