"""The app's two requests, a chat turn and a completion, streamed from a running engine for the page and the API.

llama_core checks every value (llama_core.serving.requests); its errors reach the user as gr.Error (on_page says
them with the page's labels), and a request left early (Stop, a closed page, a cancelled client) is cancelled in
the engine. The app's other modules call these as `streaming.replies(...)`, looked up at run time, so that a
test can put its own in their place.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, AsyncIterator, Iterator, Optional

import gradio as gr

from ..errors import LlamaError
from ..grammar import grammar_for
from ..serving import aio, requests
from ..serving.streams import TextEngine, TextStream, stream_chat, stream_completion
from ..tokenizer import StreamDecoder

# Least time between two updates of a streamed reply, on the page and through the API: each update costs the
# server about as much as a decode step, and the thread streaming a reply sleeps in between instead of waking
# for each token.
STREAM_UPDATE_SECONDS = 0.1
WAITING_NOTE_SECONDS = 1.0  # a chat turn says it waits for a slot once it has waited this long, and again as often
TOP_ALTERNATIVES = 5  # alternatives listed for each token of a completion shown with probabilities
ADVANCED = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "seed",
            "output_format", "output_grammar")


# -- errors: llama_core checks every value (the UI's sliders bound values, the API does not) -------------
def _error(message: str) -> gr.Error:
    return gr.Error(message, print_exception=False)


# The requests' field names (as the /chat and /complete API takes them) as the page labels their controls.
_LABELS = {"output_grammar": "the grammar box under Reply format", "output_format": "Reply format",
           "max_new_tokens": "Max new tokens", "max_seq_len": "the context length", "top_p": "Top-p", "top_k": "Top-k",
           "min_p": "Min-p", "repetition_penalty": "Repetition penalty", "presence_penalty": "Presence penalty",
           "frequency_penalty": "Frequency penalty"}


def on_page(message: str) -> str:
    """An error's message as the page says it: the controls by their labels, not the API's field names."""
    return re.sub(r"\b(" + "|".join(_LABELS) + r")\b", lambda m: _LABELS[m.group(1)], message)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Shows llama_core's errors (bad requests, a busy or failing engine) to the user instead of failing."""
    try:
        yield
    except LlamaError as exc:
        raise _error(str(exc)) from exc


# -- the two requests, shared by the UI and the API ----------------------------------------------------
@contextlib.contextmanager
def _streaming(stream: TextStream) -> Iterator[TextStream]:
    """Shows the stream's failures to the user; leaving early (Stop, a closed page, a cancelled client)
    cancels the request in the engine."""
    try:
        with _user_errors():
            yield stream
    finally:
        stream.cancel()


def client_of(request: Optional[gr.Request]) -> Optional[str]:
    """Who sends a request from the page or its Gradio API, for the engine's fair share among clients: the
    login under --auth, else the browser session (on a share link every user may come from one address)."""
    if request is None:
        return None
    if getattr(request, "username", None):
        return f"user:{request.username}"
    return f"session:{request.session_hash}" if getattr(request, "session_hash", None) else None


def start_chat(engine: TextEngine, message: Any, history: Any, system_prompt: Any, temperature: Any, top_p: Any,
               max_new_tokens: Any, client: Optional[str] = None, **controls: Any) -> TextStream:
    """Submits a chat turn; a message or system prompt with reserved tags gives a stream with a `refusal`.
    controls: the other sampling controls, named as in llama_core.SamplingParams."""
    with _user_errors():
        dialog = requests.chat_dialog(message, history, system_prompt)
        return stream_chat(engine, dialog, temperature, top_p, max_new_tokens, client=client,
                           **_with_grammar(controls))


def open_chat(engine: TextEngine, message: Any, history: Any, system_prompt: Any, temperature: Any, top_p: Any,
              max_new_tokens: Any, *advanced: Any, client: Optional[str] = None,
              reply_start: Optional[str] = None) -> TextStream:
    """The chat tab's turn: as start_chat, its controls in the tab's order (conversations.SETTINGS), and
    llama_core's errors raised as they are, for the tab to show inside the chat. reply_start: the reply's text
    so far, which the model goes on from (the stream is what follows it)."""
    dialog = requests.chat_dialog(message, history, system_prompt)
    if reply_start:
        dialog.append({"role": "assistant", "content": reply_start})
    return stream_chat(engine, dialog, temperature, top_p, max_new_tokens, client=client,
                       **_with_grammar(advanced_controls(advanced)))


async def replies(stream: TextStream, seconds: float = STREAM_UPDATE_SECONDS, waiting_after: Optional[float] = None
                  ) -> AsyncIterator[Optional[str]]:
    """The reply so far when it has grown, at most every `seconds`; at least once (the refusal for a refused
    chat, or an empty reply). With `waiting_after`, None after each `waiting_after` seconds the request still
    waits for a slot in the engine (every one busy), before its reply begins. Read on the event loop, which it
    never blocks (llama_core.serving.aio)."""
    reply, shown = stream.refusal or "", False
    with _streaming(stream):
        async for chunks in aio.batches(stream, seconds, idle=waiting_after):
            added = "".join(chunk.text for chunk in chunks)
            if added:
                reply += added
                yield reply
                shown = True
            elif not chunks and not shown and not stream.admitted:
                yield None
    if not shown:
        yield reply


async def complete(engine: TextEngine, prompt: Any, temperature: Any, top_p: Any, max_new_tokens: Any, echo: Any,
                   show_probabilities: Any, seconds: float = STREAM_UPDATE_SECONDS, client: Optional[str] = None,
                   **controls: Any) -> AsyncIterator[tuple[str, list[dict], dict]]:
    """Streams a completion as (text, tokens, stats) at most every `seconds`, as /complete does; the last
    update has the final stats (one more update follows the text when the end came after it). With
    show_probabilities each generated token also lists the model's most likely alternatives. Runs on the
    event loop, which it never blocks (llama_core.serving.aio)."""
    def start() -> tuple[str, bool, bool, TextStream]:  # (the prompt, echo, show_probabilities, its stream)
        with _user_errors():
            text = requests.completion_prompt(prompt)
            echoed, probabilities = requests.flag(echo, "echo"), requests.flag(show_probabilities, "show_probabilities")
            return text, echoed, probabilities, stream_completion(
                engine, text, temperature, top_p, max_new_tokens, prompt_logprobs=echoed and probabilities,
                top_logprobs=TOP_ALTERNATIVES if probabilities else 0, client=client, **_with_grammar(controls))

    prompt_text, echoed, probabilities, stream = await aio.submitted(
        start, aio.preparing_size(aio.text_size(prompt), asks_grammar(controls)))
    text, generated, prompt_tokens = "", [], []

    def update(chunks: list) -> tuple[str, list[dict], dict]:
        nonlocal text, prompt_tokens
        for chunk in chunks:
            text += chunk.text
            if probabilities and chunk.token != -1:
                generated.append({"token": chunk.text, "probability": math.exp(chunk.logprob), "generated": True,
                                  "alternatives": _alternatives(engine, chunk.top_logprobs)})
            elif probabilities and generated:  # text held back to the end (an incomplete character)
                generated[-1]["token"] += chunk.text
        if stream.prompt_logprobs and not prompt_tokens:  # echo with probabilities: set with the first token
            prompt_tokens = _prompt_tokens(engine, prompt_text, stream.prompt_logprobs)
        return (prompt_text + text if echoed else text), prompt_tokens + generated, request_stats(stream)

    with _streaming(stream):
        final_shown = False
        async for chunks in aio.batches(stream, seconds):
            final_shown = stream.finish_reason is not None
            yield update(chunks)
        if not final_shown:  # the end came after the last text: one more update with the final stats
            yield update([])


def _alternatives(engine: TextEngine, top_logprobs: Optional[list[tuple[int, float]]]) -> list[dict]:
    return [{"token": engine.tokenizer.token_text(token), "probability": math.exp(logprob)}
            for token, logprob in top_logprobs or []]


def _prompt_tokens(engine: TextEngine, prompt: str, logprobs: list[float]) -> list[dict]:
    """The prompt's tokens after BOS as text pieces, each with its probability given the ones before."""
    tokenizer = engine.tokenizer
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(t) for t in tokenizer.encode(prompt, bos=True, eos=False)[1:]]
    if pieces:
        pieces[-1] += decoder.flush()
    return [{"token": p, "probability": math.exp(lp), "generated": False} for p, lp in zip(pieces, logprobs)]


def request_stats(stream: TextStream) -> dict:
    return dict(prompt_tokens=stream.prompt_tokens, generated_tokens=stream.generated_tokens,
                max_seq_len=stream.max_seq_len, tokens_per_second=round(stream.tokens_per_second, 1),
                finish_reason=stream.finish_reason, dropped_pairs=stream.dropped_pairs, cached_tokens=stream.cached_tokens,
                accepted_tokens=stream.accepted_tokens)


def advanced_controls(values: tuple) -> dict[str, Any]:
    """The Advanced accordion's values as the requests' controls (the stop box holds one string per line)."""
    controls = dict(zip(ADVANCED, values))
    controls["stop"] = [line for line in (controls["stop"] or "").splitlines() if line]
    return controls


def asks_grammar(controls: dict[str, Any]) -> bool:
    """Whether the requests' controls hold the reply to a grammar (a Reply format other than text): such a
    request is prepared off the event loop (aio.preparing_size)."""
    return controls.get("output_format") not in (None, "", "text")


def _with_grammar(controls: dict[str, Any]) -> dict[str, Any]:
    """Sampling controls from the requests' controls: output_format and output_grammar made into the grammar
    they name. Raises InvalidRequestError for a format its box does not fit."""
    output_format, spec = controls.pop("output_format", None), controls.pop("output_grammar", None)
    return dict(controls, grammar=grammar_for(output_format or "text", spec or ""))

