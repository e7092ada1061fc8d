"""Writing a reply in the OpenAI API's shape: a request's choices (its streams) as one chat.completion or
text_completion object, or as the chunks of its event stream, with usage and logprobs as OpenAI gives them.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request

from ..serving.events import StreamChunk
from ..serving.streams import TextEngine, TextStream
from ..tokenizer import StreamDecoder
from . import tools
from .errors import from_llama_error
from .streaming import Batch, merged_batches

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}


class Reply:
    """One request's choices, read together: the whole reply as one JSON object, or as events."""

    object_name = ""
    chunk_object_name = ""  # a streamed event's object
    id_prefix = ""

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool) -> None:
        """streams: the choices, those of each prompt together (per_prompt of them)."""
        self.engine, self.model_id, self.streams, self.include_usage = engine, model_id, streams, include_usage
        self.per_prompt = per_prompt
        self.unwritten: list[list[StreamChunk]] = [[] for _ in streams]  # each choice's chunks held back
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        # Every choice of one prompt shares its prompt: it counts once, as the OpenAI API counts it.
        firsts = self.streams[:: self.per_prompt]
        prompt = sum(s.prompt_tokens for s in firsts)
        completion = sum(s.generated_tokens for s in self.streams)
        accepted = sum(s.accepted_tokens for s in self.streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
                # drafts from prompt lookup, in the fields OpenAI gives predicted outputs
                "completion_tokens_details": {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens":
                                              sum(s.drafted_tokens for s in self.streams) - accepted}}

    def finish_reason(self, index: int) -> str:
        return FINISH_REASONS.get(self.streams[index].finish_reason or "stop", "stop")

    def header(self, streamed: bool = False) -> dict[str, Any]:
        # no fingerprint of the backend's configuration is kept: null, as vLLM sends it
        return {"id": self.id, "object": self.chunk_object_name if streamed else self.object_name,
                "created": self.created, "model": self.model_id, "system_fingerprint": None}

    def token_text(self, token: int, first: bool = False) -> str:
        """A token's text as the API gives it: its piece, leading space kept unless it is the first of a text
        (SentencePiece does not write it there, so the tokens spell the text); a byte piece of an ASCII character
        (<0x0A>) as that character, as vLLM gives it; another byte piece, a part of a character, as <0xNN>
        (its `bytes` say which byte)."""
        text = self.engine.tokenizer.token_text(token)
        byte = _byte_piece(text)
        text = chr(byte) if byte is not None and byte < 0x80 else text
        return text[1:] if first and text.startswith(" ") else text

    def written(self, index: int, chunks: list[StreamChunk]) -> list[StreamChunk]:
        """A choice's last chunks less those that wrote nothing of its text, only a stop string (or a dialog
        tag): the text leaves it out, so its tokens and logprobs do too (as the Python API's results)."""
        if self.streams[index].finish_reason != "stop":
            return chunks
        return chunks[:_writing_end(chunks)]

    def to_send(self, batch: Batch) -> list[StreamChunk]:
        """A streamed batch's chunks to send now: those held back before, then the batch's, less those at its
        end that have written nothing yet (a stop string may be all they write: they wait for the text they
        write, or the end, so a stream lists the tokens the whole reply lists)."""
        chunks, self.unwritten[batch.index] = self.unwritten[batch.index] + batch.chunks, []
        if batch.done:
            return self.written(batch.index, chunks)
        end = _writing_end(chunks)
        self.unwritten[batch.index] = chunks[end:]
        return chunks[:end]

    async def whole(self, request: Request) -> dict[str, Any]:
        parts: list[list[StreamChunk]] = [[] for _ in self.streams]
        async for batch in merged_batches(self.streams, request):
            if batch.error is not None:
                raise from_llama_error(batch.error, ())
            parts[batch.index] += batch.chunks
        return {**self.header(), **self.whole_body(parts), "usage": self.usage()}

    async def events(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        async for event in self.first_events():
            yield event
        async for batch in merged_batches(self.streams, request):
            if batch.error is not None:
                yield from_llama_error(batch.error, ()).body()
                return
            for event in self.event(batch):
                yield event
        if self.include_usage:
            yield {**self.header(streamed=True), "choices": [], "usage": self.usage()}

    async def first_events(self) -> AsyncIterator[dict[str, Any]]:
        return
        yield

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        raise NotImplementedError

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        """The chunks a batch of one choice's stream sends (none where it has nothing to say yet)."""
        raise NotImplementedError

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        event = {**self.header(streamed=True), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event


class ChatReply(Reply):
    """A chat completion's choices: messages (or tool calls), and logprobs as the chat API gives them."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool, logprobs: bool, functions: Sequence[tools.Function] = ()) -> None:
        """functions: the tools a choice may call; a choice that is a call comes back as tool_calls (streamed:
        a choice whose text starts with "{" is held back to its end, then sent as its call)."""
        super().__init__(engine, model_id, streams, per_prompt, include_usage)
        self.logprobs = logprobs
        self.entries = [0] * len(streams)  # logprobs entries each choice has sent
        self.functions = list(functions)
        self.held: list[Optional[list[StreamChunk]]] = [[] if functions else None for _ in streams]

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        choices = []
        for i, chunks in enumerate(parts):
            chunks = self.written(i, chunks)
            text = "".join(c.text for c in chunks)
            message, finish = {"role": "assistant", "content": text, "refusal": None}, self.finish_reason(i)
            call = self._call(i, text)
            if call is not None:
                message = {**message, "content": None, "tool_calls": [tools.tool_call(call)]}
                finish = "tool_calls" if call.complete else finish
            elif tools.is_call(text, self.functions):  # cut short before its function could be told
                message = {**message, "content": ""}
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(i, chunks),
                            "finish_reason": finish})
        return {"choices": choices}

    async def first_events(self) -> AsyncIterator[dict[str, Any]]:
        for i, held in enumerate(self.held):
            if held is None:  # with tools, the role comes with the first delta: content, or null and a call
                yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        chunks = self.to_send(batch)
        held, role = self.held[batch.index], {}
        if held is not None:  # with tools: text before its first character is known to start no call is held
            held += chunks
            text = "".join(c.text for c in held)
            if not batch.done and tools.may_be_call(text):
                return []
            self.held[batch.index], role = None, {"role": "assistant"}
            call = self._call(batch.index, text) if batch.done else None
            if call is not None:  # the call, then its end alone, as OpenAI sends them (clients finish a call so)
                delta = {**role, "content": None, "tool_calls": [{"index": 0, **tools.tool_call(call)}]}
                finish = "tool_calls" if call.complete else self.finish_reason(batch.index)
                return [self._chunk(batch.index, delta, self._logprobs(batch.index, held), None),
                        self._chunk(batch.index, {}, None, finish)]
            if batch.done and tools.is_call(text, self.functions):  # cut short before its function could be told
                return [self._chunk(batch.index, {**role, "content": ""}, self._logprobs(batch.index, held), None),
                        self._chunk(batch.index, {}, None, self.finish_reason(batch.index))]
            chunks = held
        text = "".join(c.text for c in chunks)
        logprobs = self._logprobs(batch.index, chunks)
        finish = self.finish_reason(batch.index) if batch.done else None
        if text or role or (logprobs and logprobs["content"]):  # with the end: text held back to it
            return [self._chunk(batch.index, {**role, "content": text}, logprobs, finish)]
        return [self._chunk(batch.index, {}, None, finish)] if batch.done else []

    def _call(self, index: int, text: str) -> Optional[tools.Call]:
        return tools.call_made(text, self.functions, self.streams[index].finish_reason)

    def _chunk(self, index: int, delta: dict, logprobs: Optional[dict], finish: Optional[str]) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def token_logprobs(self, index: int, chunks: list[StreamChunk]) -> list[dict[str, Any]]:
        """The chunks' tokens as logprobs entries ({token, logprob, bytes, top_logprobs}), as the chat API and
        the Responses API's output_text give them (this reply made with logprobs)."""
        return self._logprobs(index, chunks)["content"]

    def _logprobs(self, index: int, chunks: list[StreamChunk]) -> Optional[dict[str, Any]]:
        if not self.logprobs:
            return None
        content = []
        for c in chunks:
            if c.token < 0:
                continue
            first = self.entries[index] == 0
            self.entries[index] += 1
            top = [self._entry(t, lp, first) for t, lp in (c.top_logprobs or [])]
            content.append({**self._entry(c.token, c.logprob, first), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _entry(self, token: int, logprob: float, first: bool) -> dict[str, Any]:
        text = self.token_text(token, first)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(_token_bytes(text))}


class CompletionReply(Reply):
    """A completion's choices: texts (after their echoed prompts, with echo), and logprobs as the completions API
    gives them."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool, top: Optional[int], echoed: Optional[list[str | list[int]]],
                 scoring: bool = False) -> None:
        """scoring: echo with max_tokens 0: each choice is its prompt alone (the token drawn after it unsent)."""
        super().__init__(engine, model_id, streams, per_prompt, include_usage)
        self.top = top  # None: no logprobs; else alternatives per token
        self.echoed = echoed  # each choice's prompt (text, or token ids) with echo, else None
        self.scoring = scoring
        self.offsets = [0] * len(streams)  # characters of text each choice has sent
        self.unechoed = set(range(len(streams))) if echoed else set()

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.scoring:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def finish_reason(self, index: int) -> str:
        return "length" if self.scoring else super().finish_reason(index)

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        return {"choices": [self._choice(i, self.written(i, chunks), self.finish_reason(i))
                            for i, chunks in enumerate(parts)]}

    def written(self, index: int, chunks: list[StreamChunk]) -> list[StreamChunk]:
        return [] if self.scoring else super().written(index, chunks)

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        chunks = [] if self.scoring else self.to_send(batch)
        choice = self._choice(batch.index, chunks, self.finish_reason(batch.index) if batch.done else None)
        if not choice["text"] and not (choice["logprobs"] and choice["logprobs"]["tokens"]) and not batch.done:
            return []
        return [self.chunk(choice)]

    def _choice(self, index: int, chunks: list[StreamChunk], finish: Optional[str]) -> dict[str, Any]:
        """The choice's text and logprobs in chunks, after its echoed prompt if that was not sent yet (the
        prompt's log-probabilities arrive with the first token)."""
        head, head_logprobs = self._echo(index) if index in self.unechoed else ("", None)
        self.unechoed.discard(index)
        logprobs = self._logprobs(index, chunks)
        if logprobs is not None and head_logprobs is not None:
            logprobs = {key: head_logprobs[key] + logprobs[key] for key in logprobs}
        return {"index": index, "text": head + "".join(c.text for c in chunks), "logprobs": logprobs,
                "finish_reason": finish}

    def _echo(self, index: int) -> tuple[str, Optional[dict[str, list]]]:
        """The echoed prompt of a choice and, with logprobs, its tokens' log-probabilities and the most likely
        tokens at each (logprobs of them): a text prompt's first one given BOS (which is not echoed), a
        token-id prompt's first one null, as nothing precedes it."""
        prompt = self.echoed[index]
        tokenizer = self.engine.tokenizer
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        self.offsets[index] = len(text)
        if self.top is None:
            return text, None
        tokens = tokenizer.encode(prompt, bos=False, eos=False) if isinstance(prompt, str) else prompt
        stream, lead = self.streams[index], [] if isinstance(prompt, str) else [None]
        values = lead + list(stream.prompt_logprobs or []) + [None] * len(tokens)
        tops = lead + list(stream.prompt_top_logprobs or []) + [None] * len(tokens)
        decoder, offsets, at = StreamDecoder(tokenizer), [], 0
        for token in tokens:
            offsets.append(at)
            at += len(decoder.push(token))
        first = next((i for i, t in enumerate(tokens) if t != tokenizer.bos_id), None)  # the first to write text
        return text, {"tokens": [self.token_text(t, i == first) for i, t in enumerate(tokens)],
                      "token_logprobs": [_logprob(v) for v in values[: len(tokens)]],
                      "top_logprobs": [self._top(*at, first=i == first) for i, at in enumerate(zip(tops, tokens, values))],
                      "text_offset": offsets}

    def _top(self, alternatives: Optional[list[tuple[int, float]]], token: int,
             logprob: Optional[float], first: bool = False) -> Optional[dict[str, float]]:
        """A position's most likely tokens as OpenAI gives them, their text to their log-probability, with the
        token chosen there added where it is not among them ("up to logprobs+1" entries, as OpenAI and vLLM).
        Two tokens with one text (a character's piece and its byte piece: `f` and <0x66>) are one entry, the more
        likely one's: the less likely, later in alternatives, does not overwrite it."""
        if self.top is None or alternatives is None:
            return None
        top: dict[str, Optional[float]] = {}
        for t, lp in alternatives:
            top.setdefault(self.token_text(t, first), _logprob(lp))
        if token not in (t for t, _ in alternatives):
            top.setdefault(self.token_text(token, first), _logprob(logprob))
        return top

    def _logprobs(self, index: int, chunks: list[StreamChunk]) -> Optional[dict[str, list]]:
        if self.top is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for c in chunks:
            if c.token >= 0:
                tokens.append(self.token_text(c.token))
                values.append(_logprob(c.logprob))
                tops.append(self._top(c.top_logprobs or [], c.token, c.logprob))
                offsets.append(self.offsets[index])
            self.offsets[index] += len(c.text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _writing_end(chunks: list[StreamChunk]) -> int:
    """How many of chunks it takes to reach the last that wrote text: those after it wrote nothing yet."""
    end = len(chunks)
    while end and chunks[end - 1].token >= 0 and not chunks[end - 1].text:
        end -= 1
    return end


def _logprob(value: Optional[float]) -> Optional[float]:
    """A log-probability JSON can carry: -inf (a token sampling ruled out) as OpenAI's -9999.0."""
    if value is None or math.isnan(value):
        return None
    return max(value, -9999.0)


def _byte_piece(text: str) -> Optional[int]:
    """The byte a byte-fallback piece (<0xE2>) stands for, or None for any other text."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            pass
    return None


def _token_bytes(text: str) -> bytes:
    """A token's bytes: a byte-fallback piece (<0xE2>) is that one byte."""
    byte = _byte_piece(text)
    return text.encode("utf-8") if byte is None else bytes([byte])
