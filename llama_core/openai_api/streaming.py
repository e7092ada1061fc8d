"""Reading text streams from the web server's event loop, and cancelling them when the client goes away.

The loop never blocks on a stream: the engine's thread wakes it when tokens arrive (TextStream.listen) and
it takes what came (TextStream.poll); a stream that can only be read blocking is read in a worker thread.
Several streams (the `n` choices of one request) are merged into one sequence of (choice index, batch) items.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

import anyio
from fastapi import Request

from ..serving.events import StreamChunk
from ..serving.streams import TextStream

# Least time between two events of a streamed reply: tokens that arrive within it go out together, so the
# server does not wake up and write once per token for every client.
STREAM_BATCH_SECONDS = 0.02
_READER_THREADS = 1024  # streams read at once; more wait for a thread

_limiter: Optional[anyio.CapacityLimiter] = None


@dataclass
class Batch:
    """What one choice's stream produced since the last batch; `done` with its last batch (or alone)."""

    index: int
    chunks: list[StreamChunk]
    done: bool = False
    error: Optional[Exception] = None


async def merged_batches(streams: Sequence[TextStream], request: Optional[Request] = None,
                         seconds: float = STREAM_BATCH_SECONDS) -> AsyncIterator[Batch]:
    """The streams' batches as they come, each tagged with its stream's index; every stream ends with one
    Batch whose `done` is set (its `error` holds a RequestFailedError if the request failed). Streams still
    running when the iteration stops, or when the request's client disconnects, are cancelled."""
    queue: asyncio.Queue[Batch] = asyncio.Queue()
    readers = [asyncio.create_task(_read(i, stream, queue, seconds)) for i, stream in enumerate(streams)]
    watcher = asyncio.create_task(_cancel_on_disconnect(request, streams)) if request is not None else None
    try:
        remaining = len(streams)
        while remaining:
            batch = await queue.get()
            remaining -= batch.done
            yield batch
    finally:
        for stream in streams:
            if stream.finish_reason is None:
                stream.cancel()
        for task in readers + ([watcher] if watcher else []):
            task.cancel()


async def _read(index: int, stream: TextStream, queue: asyncio.Queue, seconds: float) -> None:
    """Puts stream's batches on queue as they come, then one marking its end."""
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()

    def wake() -> None:  # in the engine's thread, after each event: one wake-up until the loop has looked
        if not arrived.is_set():
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
                loop.call_soon_threadsafe(arrived.set)

    if not stream.listen(wake):
        await _read_in_thread(index, stream, queue, seconds)
        return
    next_at = 0.0
    try:
        while True:
            pause = next_at - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            arrived.clear()
            chunks, ended = stream.poll()
            if chunks:
                next_at = loop.time() + seconds
                await queue.put(Batch(index, chunks))
            if ended:
                break
            if not chunks:
                await arrived.wait()
    except Exception as exc:  # the request failed in the engine: the others go on
        await queue.put(Batch(index, [], done=True, error=exc))
        return
    await queue.put(Batch(index, [], done=True))


async def _read_in_thread(index: int, stream: TextStream, queue: asyncio.Queue, seconds: float) -> None:
    """_read for a stream whose reader must block (its engine runs turns only for its readers): each batch is
    awaited in a worker thread."""
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(_READER_THREADS)
    batches = stream.batches(seconds)
    try:
        while True:
            chunks = await anyio.to_thread.run_sync(next, batches, None, abandon_on_cancel=True, limiter=_limiter)
            if chunks is None:
                break
            await queue.put(Batch(index, chunks))
    except Exception as exc:  # the request failed in the engine: the others go on
        await queue.put(Batch(index, [], done=True, error=exc))
        return
    await queue.put(Batch(index, [], done=True))


async def _cancel_on_disconnect(request: Request, streams: Sequence[TextStream]) -> None:
    """Waits for the client to disconnect (the server reports the end of a finished response the same way,
    when there is nothing left to cancel), then cancels the streams still running."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass
    for stream in streams:
        if stream.finish_reason is None:
            stream.cancel()
