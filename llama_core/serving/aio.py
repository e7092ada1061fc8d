"""Starting and reading requests from an asyncio event loop (the web server's) without blocking it.

A stream's events wake the loop (TextStream.listen) and it takes what came (TextStream.poll); a stream that
can only be read blocking (its engine runs turns only for its readers) is read in a worker thread. A short
request is tokenized and queued on the loop itself, sooner than a worker thread could start; a long one in a
worker thread, so that the loop serving everyone else is never held up for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import anyio

from .events import StreamChunk
from .streams import TextStream

# Requests with at most this much text are tokenized and queued on the event loop (about 1 ms at most).
INLINE_SUBMIT_CHARACTERS = 4_000
_READER_THREADS = 1024  # streams read in worker threads at once; more wait for a thread

_limiter: Optional[anyio.CapacityLimiter] = None
T = TypeVar("T")


def text_size(*values: Any) -> int:
    """How many characters a request's values hold (a value that is not text: as printed), to choose where
    to submit it."""
    return sum(len(str(value)) for value in values)


def preparing_size(characters: float, costly: bool) -> float:
    """What submitted() should take a request to be: its characters, or, where preparing it costs more than its
    text says (it holds its reply to a grammar; it goes on from a long stored conversation), too long for the loop
    however short it is. Building a grammar costs what the grammar asks, not its length: 13 characters,
    a{2000}{2000}, took 2.6 s to refuse; twenty short patterns 7 s to accept."""
    return math.inf if costly else characters


async def submitted(submit: Callable[[], T], characters: float) -> T:
    """submit() (tokenizing and queueing a request of `characters` of text, or preparing it), on the loop when
    it is short, else in a worker thread."""
    if characters <= INLINE_SUBMIT_CHARACTERS:
        return submit()
    return await anyio.to_thread.run_sync(submit)


async def batches(stream: TextStream, seconds: float = 0.0, idle: Optional[float] = None
                  ) -> AsyncIterator[list[StreamChunk]]:
    """As TextStream.batches, awaited: the chunks in lists, at most one list per `seconds` (the first at once);
    raises RequestFailedError if the request failed. Leaving early leaves the stream running: cancel it.
    With `idle`, an empty list after each `idle` seconds with nothing new (where the stream wakes the loop:
    TextStream.listen), for a reader that shows the wait (stream.admitted: for a slot, or for its first token)."""
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()

    def wake() -> None:  # in the engine's thread, after each event: one wake-up until the loop has looked
        if not arrived.is_set():
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
                loop.call_soon_threadsafe(arrived.set)

    if not stream.listen(wake):
        async for chunks in _batches_in_thread(stream, seconds):
            yield chunks
        return
    next_at = 0.0
    while True:
        pause = next_at - loop.time()
        if pause > 0:
            await asyncio.sleep(pause)
        arrived.clear()
        chunks, ended = stream.poll()
        if chunks:
            next_at = loop.time() + seconds
            yield chunks
        if ended:
            return
        if not chunks and idle is None:
            await arrived.wait()
        elif not chunks:
            try:
                await asyncio.wait_for(arrived.wait(), idle)
            except asyncio.TimeoutError:
                yield []


async def _batches_in_thread(stream: TextStream, seconds: float) -> AsyncIterator[list[StreamChunk]]:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(_READER_THREADS)
    blocking = stream.batches(seconds)
    while True:
        chunks = await anyio.to_thread.run_sync(next, blocking, None, abandon_on_cancel=True, limiter=_limiter)
        if chunks is None:
            return
        yield chunks
