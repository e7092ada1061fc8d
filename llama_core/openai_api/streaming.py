"""Reading text streams from the web server's event loop, cancelling them when the client goes away, and
sending a streamed reply's events as Server-Sent Events (event_stream).

The loop never blocks on a stream (llama_core.serving.aio). Several streams (the `n` choices of one request)
are merged into one sequence of (choice index, batch) items.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..serving import aio
from ..serving.events import StreamChunk
from ..serving.streams import TextStream

# Least time between two events of a streamed reply: tokens that arrive within it go out together, so the
# server does not wake up and write once per token for every client.
STREAM_BATCH_SECONDS = 0.02


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
    try:
        async for chunks in aio.batches(stream, seconds):
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


def event_stream(events: AsyncIterator[dict[str, Any]], done: bool = True) -> StreamingResponse:
    """Server-sent events; done: ending with `data: [DONE]` (the chat and completion routes; the Responses API
    names each event instead, and ends with response.completed)."""
    async def lines() -> AsyncIterator[bytes]:
        async for event in events:
            name = f"event: {event['type']}\n".encode() if not done and "type" in event else b""
            yield name + b"data: " + json.dumps(event).encode() + b"\n\n"
        if done:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
