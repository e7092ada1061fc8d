"""Serving many users: the continuous-batching engine (in this process or a child of its own), the one
request validator, and the token and text streams readers consume.

The names below load on first use (see llama_core.lazy_exports): `llama_core.serving.requests`, the
request checks, imports without torch.
"""

from ..lazy_exports import lazy_exports

# name -> the module defining it
_MODULES = {
    "Engine": ".engine",
    "EngineProcess": ".engine_process",
    "Admitted": ".events",
    "Channel": ".events",
    "Finished": ".events",
    "PromptLogprobs": ".events",
    "StreamChunk": ".events",
    "GenerationRequest": ".requests",
    "SamplingParams": ".requests",
    "ChatPrompt": ".streams",
    "EngineLostError": ".streams",
    "GrammarFailedError": ".streams",
    "RequestFailedError": ".streams",
    "TextStream": ".streams",
    "TokenStream": ".streams",
    "chat_prompt": ".streams",
    "stream_chat": ".streams",
    "stream_completion": ".streams",
}

__all__ = sorted(_MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
