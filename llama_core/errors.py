"""The exceptions a caller of llama_core can cause, each with a message that names what was wrong."""


class LlamaError(Exception):
    """Base class of every error llama_core raises on purpose."""


class CheckpointNotFoundError(LlamaError, FileNotFoundError):
    """A checkpoint directory, params file, weight shard or tokenizer file does not exist."""


class CheckpointError(LlamaError, ValueError):
    """A checkpoint exists but cannot be used: unreadable, truncated, or its parts don't fit together."""


class InvalidRequestError(LlamaError, ValueError):
    """A generation request is malformed: bad prompts or sampling parameters."""


class DialogError(InvalidRequestError):
    """A chat dialog is malformed (roles, order, content types)."""


class ContextLengthError(InvalidRequestError):
    """A prompt does not fit in the model's context window."""


class ServerBusyError(LlamaError, RuntimeError):
    """The serving engine's queue is full; the request may be retried later."""

    @classmethod
    def full(cls, running: int, waiting: int) -> "ServerBusyError":
        """The refusal of an engine with this many requests running and waiting."""
        return cls(f"server busy: {running} requests running and {waiting} waiting; try again shortly")

    @classmethod
    def client_full(cls, held: int) -> "ServerBusyError":
        """The refusal of a request whose client already holds `held` requests, the most one client may."""
        return cls(f"server busy: this client already has {held} requests running and waiting, the most one client "
                   "may hold at once (the rest of the queue is kept for other clients); try again when one ends")


class EngineUnavailableError(LlamaError, RuntimeError):
    """The engine does not take requests now: its process is restarting after a crash, or has stopped."""
