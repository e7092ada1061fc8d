"""What an engine tells a request's reader, and the channel it travels through."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")


@dataclass
class StreamChunk:
    """One generated token as it streams: its id, log-probability and the text it completes (empty until
    a text stream decodes it; token -1 carries text held back to the end), and with top_logprobs asked for,
    the model's most likely tokens at this position as (token id, log-probability), most likely first."""

    token: int
    logprob: float
    text: str = ""
    top_logprobs: Optional[list[tuple[int, float]]] = None


@dataclass(frozen=True)
class Admitted:
    """The request has a slot: cached_tokens of its prompt's first tokens were already in the KV cache (a
    chat's earlier turns, a shared system prompt) and are not computed again. Comes before the first chunk."""

    cached_tokens: int


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens 1..n-1, each given the ones before it, and with top_logprobs the
    most likely tokens at each of those positions ((token id, log-probability), most likely first); comes
    before the first chunk."""

    values: list[float]
    alternatives: Optional[list[list[tuple[int, float]]]] = None


@dataclass(frozen=True)
class Finished:
    """The request's end: reason is one of FINISH_REASONS ("stop": a stop string was reached); message
    explains an "error"; at is when the engine ended it (time.perf_counter()); drafted_tokens: tokens prompt
    lookup drafted for it and the model checked, accepted_tokens of which it kept (its reply has them);
    failure: what an "error" came of where that is known: "grammar", the request's own grammar could not be
    followed (past llguidance's limits, or nothing it allows could be written); "engine", the engine's process
    stopped (the request may be sent again once it is back)."""

    reason: str
    message: str = ""
    at: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    failure: str = ""


class EventSink(Protocol):
    def put(self, item: Any) -> None: ...


class EventQueue(queue.Queue):
    """A request's events as its reader takes them. A reader that does not block on it (an event loop) sets
    `listener`: called after each event is put, in the thread that put it."""

    def __init__(self) -> None:
        super().__init__()
        self.listener: Optional[Callable[[], None]] = None

    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        super().put(item, block, timeout)
        listener = self.listener
        if listener is not None:
            listener()


@dataclass
class Channel:
    """Connects a request inside an engine with its reader: the engine puts events and sets `finished` with
    the last one; the reader sets `cancelled` to stop the request."""

    events: Any = field(default_factory=EventQueue)  # an EventSink; an EventQueue where a reader gets them
    # Its set() may run inside anything: a stream's finalizer, or its iterator closed by the garbage collector
    # (at any allocation, a send holding a lock included). It must not wait on a lock other code holds.
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
