"""Streams of a request's output: `TokenStream` (token ids as the engine makes them) and `TextStream`
(their text), and the chat and completion requests an app serves, text in and text out."""

from __future__ import annotations

import queue
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from .. import dialog as chat_format
from ..errors import ContextLengthError, DialogError, EngineUnavailableError, InvalidRequestError, LlamaError
from ..tokenizer import StreamDecoder, Tokenizer
from .events import Admitted, Channel, EventQueue, Finished, PromptLogprobs, StreamChunk
from .requests import (SamplingParams, check_max_new_tokens, completion_prompt, sampling_params, token_ids,
                       whole_number)
from .stops import StopMatcher

DEFAULT_MAX_NEW_TOKENS = 256


class RequestFailedError(LlamaError, RuntimeError):
    """A request failed inside the engine (e.g. out of memory); the engine keeps serving the others."""


class GrammarFailedError(RequestFailedError, InvalidRequestError):
    """A request's reply could not go on in its grammar (past llguidance's limits on a grammar's work, or where
    nothing the grammar allows may be written): the request's doing, not the engine's."""


class EngineLostError(RequestFailedError, EngineUnavailableError):
    """A request was under way when the engine's process stopped; it may be sent again once the engine is back."""


def _failure(done: Finished) -> RequestFailedError:
    return {"grammar": GrammarFailedError, "engine": EngineLostError}.get(done.failure, RequestFailedError)(done.message)


class Driver(Protocol):
    """An engine as a stream's reader sees it: either its own loop runs, or the reader runs its turns."""

    @property
    def running(self) -> bool: ...

    def pump(self) -> bool:
        """Runs one engine turn in the calling thread unless the engine's own loop runs; whether it did."""


class RequestMeter(Protocol):
    """What counts the replies a server streams (its metrics: llama_core.openai_api.metrics), told by each reply's
    text stream as its reader reads it."""

    def first_token(self, seconds: float) -> None:
        """A reply's first token was read, `seconds` after its request was submitted."""

    def request_ended(self, reason: str, seconds: float, generated_tokens: int) -> None:
        """A reply ended, `seconds` after its request was submitted: reason is its finish_reason, or "cancelled"
        where its reader left it before its end; generated_tokens, the tokens it was given."""


class TokenStream:
    """The tokens of one request, as they are produced. Iterate to receive `StreamChunk`s (text empty);
    iteration raises RequestFailedError if the request failed. Leaving the iteration early cancels it, as
    does dropping the stream unread (its request would otherwise hold a slot until its last token).

    With a driver whose loop is not running, reading runs the engine's turns in the reader's thread."""

    def __init__(self, channel: Channel, prompt_len: int, driver: Optional[Driver] = None) -> None:
        self._channel = channel
        self._driver = driver
        self.prompt_len = prompt_len
        self.finish_reason: Optional[str] = None  # "eos", "stop", "length", "cancelled" or "error"
        self.prompt_logprobs: Optional[list[float]] = None  # with prompt_logprobs=True: tokens 1..n-1
        self.prompt_top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # and with top_logprobs
        self.admitted = False  # the request has a slot: it is no longer waiting for one
        self.cached_tokens = 0  # prompt tokens found in the engine's KV cache (known before the first chunk)
        self.drafted_tokens = 0  # tokens prompt lookup drafted and the model checked (known at the end)
        self.accepted_tokens = 0  # of those, the ones kept: part of the reply, several a step
        self.finished_at: Optional[float] = None  # time.perf_counter() when the engine ended the request
        self.meter: Optional[RequestMeter] = None  # told of the reply a TextStream reads from this stream
        self._failure: Optional[RequestFailedError] = None  # for poll: raised once the chunks before it are read
        weakref.finalize(self, _cancel_dropped, channel)

    def cancel(self) -> None:
        """Stops the request in the engine; nothing to do once the engine has ended it. Safe anywhere, a
        finalizer included (a model process's cancel goes over the pipe from a thread of its own)."""
        if not self._channel.finished.is_set():
            self._channel.cancelled.set()

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunks in self.batches():
            yield from chunks

    def batches(self, seconds: float = 0.0) -> Iterator[list[StreamChunk]]:
        """The chunks in lists: whatever has arrived, waiting for at least one, and at most one list per
        `seconds` (the first at once). A reader that shows text a few times a second then wakes up that
        often, not once per token. When the request's end arrives with its last chunks, `finish_reason`
        is set before that last list is yielded. A stream read to its end before yields nothing more (or raises
        its failure again)."""
        if self.finish_reason is not None:
            if self._failure is not None:
                raise self._failure
            return
        events, next_at = self._channel.events, 0.0
        try:
            while True:
                pause = next_at - time.monotonic()
                if pause > 0 and (self._driver is None or self._driver.running):
                    self._channel.finished.wait(pause)  # tokens don't wake the reader; the end does
                chunks, done = self._taken([self._next_event()] + _drained(events))
                if chunks:  # the pause runs from the last list yielded: news of admission does not delay the first token
                    next_at = time.monotonic() + seconds
                    yield chunks
                if done is not None:
                    if done.reason == "error":
                        self._failure = _failure(done)
                        raise self._failure
                    return
        finally:
            if self.finish_reason is None:
                self.cancel()

    def listen(self, listener: Callable[[], None]) -> bool:
        """Has listener called (in the engine's thread) whenever an event for this stream arrives, for a reader
        that polls instead of blocking; False, doing nothing, where events cannot be awaited so (a reader
        that runs the engine's turns itself must read with batches)."""
        events = self._channel.events
        if not isinstance(events, EventQueue) or (self._driver is not None and not self._driver.running):
            return False
        events.listener = listener
        return True

    def poll(self) -> tuple[list[StreamChunk], bool]:
        """What has arrived, without waiting: (chunks, whether the request has ended; `finish_reason` is then
        set). Raises RequestFailedError if the request failed (after returning the chunks that came before)."""
        if self._failure is not None:
            raise self._failure
        chunks, done = self._taken(_drained(self._channel.events))
        if done is not None and done.reason == "error":
            self._failure = _failure(done)
            if not chunks:
                raise self._failure
            return chunks, False
        return chunks, done is not None

    def _taken(self, items: list[Any]) -> tuple[list[StreamChunk], Optional[Finished]]:
        """The chunks among the events items, the others noted; the request's end if it came with them."""
        chunks, done = [], None
        for item in items:
            self.admitted = True  # anything of the request ends its wait (Admitted first, where it got a slot)
            if isinstance(item, StreamChunk):
                chunks.append(item)
            elif isinstance(item, PromptLogprobs):
                self.prompt_logprobs, self.prompt_top_logprobs = item.values, item.alternatives
            elif isinstance(item, Admitted):
                self.cached_tokens = item.cached_tokens
            else:
                done = item
                self.finish_reason, self.finished_at = item.reason, item.at
                self.drafted_tokens, self.accepted_tokens = item.drafted_tokens, item.accepted_tokens
        return chunks, done

    def _next_event(self) -> Any:
        events = self._channel.events
        while True:
            try:
                return events.get_nowait()
            except queue.Empty:
                pass
            if self._driver is None or not self._driver.pump():
                return events.get()


def _cancel_dropped(channel: Channel) -> None:
    """Cancels the request of a stream dropped unread (a finalizer may run inside anything: so may the
    channel's cancelled.set())."""
    if not channel.finished.is_set():
        channel.cancelled.set()


def _drained(events: Any) -> list[Any]:
    """Every event waiting in the queue events, without blocking."""
    items = []
    while True:
        try:
            items.append(events.get_nowait())
        except queue.Empty:
            return items


class TextStream:
    """One request's reply as text pieces. Iterate for `StreamChunk`s whose `text` is the newly completed
    text; afterwards `generated_tokens`, `tokens_per_second` and `finish_reason` describe the run.

    A refused request (special tags in a chat) yields nothing; `refusal` holds the reply to show.
    """

    def __init__(
        self,
        tokens: Optional[TokenStream],
        decoder: Optional[StreamDecoder],
        prompt_tokens: int,
        max_seq_len: int,
        dropped_pairs: int = 0,
        refusal: Optional[str] = None,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokens = tokens
        self._decoder = decoder
        self._stops = StopMatcher(stop)
        self.prompt_tokens = prompt_tokens
        self.max_seq_len = max_seq_len
        self.dropped_pairs = dropped_pairs
        self.refusal = refusal
        self.generated_tokens = 0
        self._started = time.perf_counter()
        self._first_token_at: Optional[float] = None
        self._finished_at: Optional[float] = None
        self._meter = None if tokens is None else tokens.meter
        self._metered = False  # whether the meter was told of the reply's end

    @property
    def finish_reason(self) -> Optional[str]:
        """"eos", "stop" (a stop string), "length", "cancelled", "error", "refused", or None while running."""
        if self.refusal is not None:
            return "refused"
        return "stop" if self._stops.stopped else self._tokens.finish_reason

    @property
    def prompt_logprobs(self) -> Optional[list[float]]:
        return None if self._tokens is None else self._tokens.prompt_logprobs

    @property
    def prompt_top_logprobs(self) -> Optional[list[list[tuple[int, float]]]]:
        """With prompt_logprobs and top_logprobs: the most likely tokens at prompt positions 1..n-1."""
        return None if self._tokens is None else self._tokens.prompt_top_logprobs

    @property
    def admitted(self) -> bool:
        """Whether the request has a slot in the engine, as far as its reader has read: False while it waits for
        one (every slot busy). A refused request has none to wait for: True."""
        return self._tokens is None or self._tokens.admitted

    @property
    def cached_tokens(self) -> int:
        """How many of the prompt's tokens the engine found in its KV cache rather than computed (0 until known)."""
        return 0 if self._tokens is None else self._tokens.cached_tokens

    @property
    def drafted_tokens(self) -> int:
        """How many tokens prompt lookup drafted for the reply and the model checked (0 until the end)."""
        return 0 if self._tokens is None else self._tokens.drafted_tokens

    @property
    def accepted_tokens(self) -> int:
        """How many of the drafted tokens the reply kept (0 until the end)."""
        return 0 if self._tokens is None else self._tokens.accepted_tokens

    @property
    def seconds_to_first_token(self) -> Optional[float]:
        return None if self._first_token_at is None else self._first_token_at - self._started

    @property
    def tokens_per_second(self) -> float:
        """Decode speed after the first token (the first one's wait is prefill and queueing). Where the tokens
        after it came with it (drafted, or a grammar's forced tokens), every token over the whole request;
        0.0 before any token."""
        if self._first_token_at is None:
            return 0.0
        end = self._tokens.finished_at or self._finished_at or time.perf_counter()
        decoding = end - self._first_token_at
        if self.generated_tokens >= 2 and decoding > 1e-3:
            return (self.generated_tokens - 1) / decoding
        return self.generated_tokens / max(end - self._started, 1e-6)

    def cancel(self) -> None:
        if self._tokens is not None:
            self._tokens.cancel()
            if self.finish_reason is None:
                self._ended("cancelled")

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunks in self.batches():
            yield from chunks

    def batches(self, seconds: float = 0.0) -> Iterator[list[StreamChunk]]:
        """The chunks in lists, at most one list per `seconds` (see TokenStream.batches): for a reader that
        updates a display periodically and need not wake up for every token. Text held back for a whole
        character, or because it could begin a stop string, comes at the end, as a chunk of token -1, in the
        last list; when the request's end arrives with its last tokens, `finish_reason` is set before that
        list is yielded. The text of a stop string and what follows it never appears. A stream read to its end
        before yields nothing more."""
        if self._tokens is None or self._stops.stopped:
            return
        try:
            for batch in self._tokens.batches(seconds):
                chunks = self._decoded(batch)
                yield chunks
                if self._stops.stopped:
                    return
            if tail := self._tail():  # the end came alone; a flushed decoder has nothing more
                yield tail
        finally:
            self._finished_at = self._tokens.finished_at or time.perf_counter()
            if self._tokens.finish_reason is None:
                self.cancel()
            self._ended(self.finish_reason or "cancelled")

    def listen(self, listener: Callable[[], None]) -> bool:
        """As TokenStream.listen: listener is called whenever news of this request arrives, for a reader that
        polls; False where it must read with batches instead. A refused request has nothing to wait for."""
        return self._tokens is None or self._tokens.listen(listener)

    def poll(self) -> tuple[list[StreamChunk], bool]:
        """What batches would yield next, without waiting: (chunks, possibly none; whether the reply has
        ended). Raises RequestFailedError if the request failed. Read until it ends, or cancel()."""
        if self._tokens is None:
            return [], True
        try:
            batch, ended = self._tokens.poll()
        except RequestFailedError:
            self._ended("error")
            raise
        chunks = self._decoded(batch) if batch else []
        ended = ended or self._stops.stopped
        if ended:
            if not chunks and not self._stops.stopped:
                chunks = self._tail()  # the end came alone
            self._finished_at = self._tokens.finished_at or time.perf_counter()
            self._ended(self.finish_reason)
        return chunks, ended

    def _decoded(self, batch: list[StreamChunk]) -> list[StreamChunk]:
        """A batch of the token stream as text chunks, up to a stop string, the held-back text added at the end."""
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
            if self._meter is not None:
                self._meter.first_token(self._first_token_at - self._started)
        chunks = []
        for c in batch:
            chunks.append(StreamChunk(c.token, c.logprob, self._stops.feed(self._decoder.push(c.token)), c.top_logprobs))
            if self._stops.stopped:
                self._tokens.cancel()  # the engine stops at the same token; this is for a late end
                break
        self.generated_tokens += len(chunks)
        if self.finish_reason is not None:
            chunks += self._tail()
        return chunks

    def _ended(self, reason: str) -> None:
        """Tells the meter, once, that the reply ended (read to its end, failed, or left by its reader)."""
        if self._meter is None or self._metered:
            return
        self._metered = True
        ended_at = self._finished_at or time.perf_counter()
        self._meter.request_ended(reason, ended_at - self._started, self.generated_tokens)

    def _tail(self) -> list[StreamChunk]:
        tail = self._stops.feed(self._decoder.flush())
        tail += self._stops.flush()
        return [StreamChunk(-1, 0.0, tail)] if tail else []


class TextEngine(Protocol):
    """What the text streams need of an engine (Engine, or EngineProcess in another process)."""

    tokenizer: Tokenizer

    @property
    def info(self) -> Any: ...

    @property
    def capacity(self) -> int: ...

    @property
    def client_capacity(self) -> int: ...

    def stats(self, seconds: float = ...) -> Optional[dict[str, int]]:
        """Its counters (Engine.stats), or None where its model process does not answer within seconds."""

    def submit(self, prompt_tokens: list[int], max_new_tokens: int, temperature: float = 0.6, top_p: float = 0.9,
               prompt_logprobs: bool = False, logprobs: bool = True, *, params: Optional[SamplingParams] = None,
               prediction_tokens: tuple[int, ...] | list[int] = (), standalone_text: bool = False,
               client: Optional[str] = None, **controls: Any) -> TokenStream: ...


def vocabulary(engine: TextEngine) -> int:
    """How many token ids a request may name (0 to this - 1): the model's and the tokenizer's, the fewer."""
    return min(engine.info.args.vocab_size, engine.tokenizer.n_words)


def stream_completion(
    engine: TextEngine,
    prompt: str | Sequence[int],
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_new_tokens: Optional[int] = None,
    prompt_logprobs: bool = False,
    *,
    client: Optional[str] = None,
    **controls: Any,
) -> TextStream:
    """Submits a prompt to the engine and returns its reply stream: plain text (BOS prepended), or token ids
    (taken as they are, as the OpenAI API takes them). max_new_tokens None means DEFAULT_MAX_NEW_TOKENS, or
    less where the context is shorter; the other sampling controls (top_k, min_p, penalties, stop, seed,
    top_logprobs...) are keywords as in SamplingParams. client: who sends it, for fair admission (see
    Engine.submit)."""
    if isinstance(prompt, (list, tuple)):
        prompt_tokens = token_ids(prompt, vocabulary(engine))
    else:
        prompt_tokens = engine.tokenizer.encode(completion_prompt(prompt), bos=True, eos=False)
    params = sampling_params(temperature, top_p, **controls)
    max_new_tokens = _default_max_new_tokens(engine, max_new_tokens)
    tokens = engine.submit(prompt_tokens, max_new_tokens, prompt_logprobs=prompt_logprobs, params=params,
                           client=client)
    decoder = StreamDecoder(engine.tokenizer, prompt_tokens)
    return TextStream(tokens, decoder, len(prompt_tokens), engine.info.max_seq_len, stop=params.stop)


def stream_chat(
    engine: TextEngine,
    dialog: chat_format.Dialog,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_new_tokens: Optional[int] = None,
    *,
    drop_old_turns: bool = True,
    prediction: Optional[str] = None,
    client: Optional[str] = None,
    **controls: Any,
) -> TextStream:
    """Submits a dialog (ending with the user's message, or with the start of the assistant's reply, which the
    reply then continues: its text is what follows) and returns the assistant's reply stream. The reply
    also ends where the model starts writing a dialog tag ([INST], [/INST], <<SYS>>, <</SYS>>), as at a stop
    string; other sampling controls are keywords as in stream_completion. prediction: the reply as the
    caller expects it (e.g. a file to be edited a little): with prompt lookup, the engine drafts from it, so
    the reply, the same either way, comes sooner where the prediction is right. client: who sends it, for
    fair admission (see Engine.submit).

    A dialog holding a special tag is not run: the stream is empty and its `refusal` is UNSAFE_ERROR.
    Old (user, assistant) pairs are dropped to fit the context, keeping room for the reply; `dropped_pairs`
    says how many. With drop_old_turns False the whole dialog is the prompt, or ContextLengthError when it
    leaves no room for a reply; a reply then ends where the context does.
    """
    max_seq_len = engine.info.max_seq_len
    params = sampling_params(temperature, top_p, **controls).with_stop(chat_format.SPECIAL_TAGS)
    if chat_format.has_special_tags(dialog):
        return TextStream(None, None, 0, max_seq_len, refusal=chat_format.UNSAFE_ERROR)
    max_new_tokens = check_max_new_tokens(_default_max_new_tokens(engine, max_new_tokens), max_seq_len)
    fitted = _fitted_chat(engine, dialog, max_new_tokens, drop_old_turns)
    predicted = engine.tokenizer.encode(prediction, bos=False, eos=False) if prediction else ()
    # the reply's text, as chat_completion's content reads; where the dialog holds its start, what follows that
    standalone = not chat_format.ends_in_reply(dialog)
    tokens = engine.submit(fitted.prompt_tokens, max_new_tokens, params=params, prediction_tokens=predicted,
                           standalone_text=standalone, client=client)
    decoder = StreamDecoder(engine.tokenizer, () if standalone else fitted.prompt_tokens)
    if not standalone:
        start = dialog[-1]["content"]
        decoder = AfterStart(decoder, start[len(start.rstrip()):])
    return TextStream(tokens, decoder, len(fitted.prompt_tokens), max_seq_len, fitted.dropped_pairs, stop=params.stop)


class AfterStart:
    """The text of a reply that continues a start given ending in white space (`given`): the Llama-2 layout
    leaves that white space out, and the model writes it again, as the space before its next word. What the
    reply writes of it first is the caller's already, and is left out (once the reply writes anything else,
    nothing more is)."""

    def __init__(self, decoder: StreamDecoder, given: str) -> None:
        self.decoder = decoder
        self.given = given

    def push(self, token: int) -> str:
        return self._after_given(self.decoder.push(token))

    def flush(self) -> str:
        return self._after_given(self.decoder.flush())

    def _after_given(self, text: str) -> str:
        kept = 0
        while self.given and kept < len(text):
            if text[kept] != self.given[0]:
                self.given = ""
                break
            kept, self.given = kept + 1, self.given[1:]
        return text[kept:]


def _fitted_chat(engine: TextEngine, dialog: chat_format.Dialog, max_new_tokens: int,
                 drop_old_turns: bool) -> chat_format.FittedDialog:
    max_seq_len = engine.info.max_seq_len
    if drop_old_turns:
        return chat_format.prepare_chat(engine.tokenizer, max_seq_len, dialog, max_new_tokens)
    fitted = chat_format.FittedDialog(chat_format.encode_dialog(engine.tokenizer, dialog), 0)
    if len(fitted.prompt_tokens) >= max_seq_len:
        raise ContextLengthError(
            f"the messages take {len(fitted.prompt_tokens):,} tokens, but the model's context is {max_seq_len:,}: "
            f"shorten them to at most {max_seq_len - 1:,} tokens to leave room for a reply"
        )
    return fitted


@dataclass
class ChatPrompt:
    """What the model is given for a chat turn, as stream_chat would submit it."""

    text: str  # the prompt in the Llama-2 layout, BOS and EOS written as <s> and </s>
    prompt_tokens: list[int]
    dropped: chat_format.Dialog  # the oldest (user, assistant) messages left out to fit the context
    dropped_tokens: int  # how many more tokens the whole dialog would take
    reply_room: int  # tokens kept free for the reply
    max_seq_len: int


def chat_prompt(engine: TextEngine, dialog: chat_format.Dialog, max_new_tokens: Optional[int] = None, *,
                drop_old_turns: bool = True) -> ChatPrompt:
    """The prompt stream_chat would submit for this dialog (same checks, same fitting), without running it.

    Raises:
        DialogError: the dialog is malformed or holds a reserved chat-format tag (stream_chat refuses it).
        ContextLengthError: the last message (with the system prompt) does not fit.
    """
    max_seq_len = engine.info.max_seq_len
    if chat_format.has_special_tags(dialog):
        raise DialogError(chat_format.UNSAFE_ERROR)
    max_new_tokens = check_max_new_tokens(_default_max_new_tokens(engine, max_new_tokens), max_seq_len)
    fitted = _fitted_chat(engine, dialog, max_new_tokens, drop_old_turns)
    first_kept = (1 if dialog[0]["role"] == "system" else 0) + 2 * fitted.dropped_pairs
    system = list(dialog[: first_kept - 2 * fitted.dropped_pairs])
    prompt_len = len(fitted.prompt_tokens)
    dropped_tokens = len(chat_format.encode_dialog(engine.tokenizer, dialog)) - prompt_len if fitted.dropped_pairs else 0
    reply_room = chat_format.reply_room(max_seq_len, max_new_tokens) if drop_old_turns else max_seq_len - prompt_len
    return ChatPrompt(chat_format.dialog_text(system + list(dialog[first_kept:])), fitted.prompt_tokens,
                      list(dialog[len(system) : first_kept]), dropped_tokens, reply_room, max_seq_len)


def _default_max_new_tokens(engine: TextEngine, max_new_tokens: Any) -> Any:
    if max_new_tokens is None:
        return min(DEFAULT_MAX_NEW_TOKENS, engine.info.max_seq_len - 1)
    return whole_number(max_new_tokens)
