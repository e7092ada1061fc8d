"""Text in, text out on a running Engine: the chat and completion streams an app serves."""

from __future__ import annotations

import time
from typing import Iterator, Optional

from . import dialog as chat_format
from .engine import Engine, TokenStream
from .errors import InvalidRequestError
from .generation import StreamChunk
from .tokenizer import StreamDecoder


DEFAULT_MAX_NEW_TOKENS = 256


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
    ) -> None:
        self._tokens = tokens
        self._decoder = decoder
        self.prompt_tokens = prompt_tokens
        self.max_seq_len = max_seq_len
        self.dropped_pairs = dropped_pairs
        self.refusal = refusal
        self.generated_tokens = 0
        self._started = time.perf_counter()
        self._first_token_at: Optional[float] = None
        self._finished_at: Optional[float] = None

    @property
    def finish_reason(self) -> Optional[str]:
        return "refused" if self.refusal is not None else self._tokens.finish_reason

    @property
    def prompt_logprobs(self) -> Optional[list[float]]:
        return None if self._tokens is None else self._tokens.prompt_logprobs

    @property
    def seconds_to_first_token(self) -> Optional[float]:
        return None if self._first_token_at is None else self._first_token_at - self._started

    @property
    def tokens_per_second(self) -> float:
        """Decode speed after the first token (the first one's wait is prefill and queueing)."""
        if self._first_token_at is None or self.generated_tokens < 2:
            return 0.0
        end = self._tokens.finished_at or self._finished_at or time.perf_counter()
        return (self.generated_tokens - 1) / max(end - self._first_token_at, 1e-9)

    def cancel(self) -> None:
        if self._tokens is not None:
            self._tokens.cancel()

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunks in self.batches():
            yield from chunks

    def batches(self, seconds: float = 0.0) -> Iterator[list[StreamChunk]]:
        """The chunks in lists, at most one list per `seconds` (see TokenStream.batches): for a reader that
        updates a display periodically and need not wake up for every token. Text held back for a whole
        character comes at the end, as a chunk of token -1, in the last list; when the request's end
        arrives with its last tokens, `finish_reason` is set before that list is yielded."""
        if self._tokens is None:
            return
        try:
            for batch in self._tokens.batches(seconds):
                if self._first_token_at is None:
                    self._first_token_at = time.perf_counter()
                self.generated_tokens += len(batch)
                chunks = [StreamChunk(c.token, c.logprob, self._decoder.push(c.token)) for c in batch]
                if self._tokens.finish_reason is not None:
                    chunks += self._tail()
                yield chunks
            if tail := self._tail():  # the end came alone; a flushed decoder has nothing more
                yield tail
        finally:
            self._finished_at = self._tokens.finished_at or time.perf_counter()
            if self._tokens.finish_reason is None:
                self.cancel()

    def _tail(self) -> list[StreamChunk]:
        tail = self._decoder.flush()
        return [StreamChunk(-1, 0.0, tail)] if tail else []


def stream_completion(
    engine: Engine,
    prompt: str,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_new_tokens: Optional[int] = None,
    prompt_logprobs: bool = False,
) -> TextStream:
    """Submits a plain-text prompt (BOS prepended) to the engine and returns its reply stream.
    max_new_tokens None means DEFAULT_MAX_NEW_TOKENS, or less where the context is shorter."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise InvalidRequestError("prompt is empty: type some text to continue")
    tokenizer = engine.llama.tokenizer
    prompt_tokens = tokenizer.encode(prompt, bos=True, eos=False)
    max_new_tokens = _default_max_new_tokens(engine, max_new_tokens)
    tokens = engine.submit(prompt_tokens, max_new_tokens, temperature, top_p, prompt_logprobs)
    return TextStream(tokens, StreamDecoder(tokenizer, prompt_tokens), len(prompt_tokens), engine.llama.max_seq_len)


def stream_chat(
    engine: Engine,
    dialog: chat_format.Dialog,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_new_tokens: Optional[int] = None,
) -> TextStream:
    """Submits a dialog (ending with the user's message) and returns the assistant's reply stream.

    A dialog holding a special tag is not run: the stream is empty and its `refusal` is UNSAFE_ERROR.
    Old (user, assistant) pairs are dropped to fit the context; `dropped_pairs` says how many.
    """
    if chat_format.has_special_tags(dialog):
        return TextStream(None, None, 0, engine.llama.max_seq_len, refusal=chat_format.UNSAFE_ERROR)
    max_new_tokens = _default_max_new_tokens(engine, max_new_tokens)
    engine.check_parameters(max_new_tokens, temperature, top_p)
    fitted = engine.llama.prepare_chat(dialog, max_new_tokens)
    tokens = engine.submit(fitted.prompt_tokens, max_new_tokens, temperature, top_p)
    decoder = StreamDecoder(engine.llama.tokenizer)  # the reply's text, as chat_completion's content reads
    return TextStream(tokens, decoder, len(fitted.prompt_tokens), engine.llama.max_seq_len, fitted.dropped_pairs)


def _default_max_new_tokens(engine: Engine, max_new_tokens: Optional[int]) -> int:
    if max_new_tokens is None:
        return min(DEFAULT_MAX_NEW_TOKENS, engine.llama.max_seq_len - 1)
    return max_new_tokens
