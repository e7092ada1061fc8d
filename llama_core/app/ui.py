"""The web app's interface: chat, text completion with token probabilities, and the model's facts.

Interface only: callbacks pass what the user sent to llama_core, which checks it (llama_core.serving.requests)
and streams the reply from a running engine that batches concurrent requests and cancels abandoned ones.
`build_demo(engine, prompts)` makes the Gradio Blocks; llama_core.app.server serves them and
llama_core.app.cli (`llama-chat`, `python app.py`) starts it all.

API (gradio_client), both streaming; bad input raises gr.Error naming the problem (AppError in the client),
and max_new_tokens null means llama_core's default:
  /chat(message, history, system_prompt, temperature, top_p, max_new_tokens) -> str
      Yields the assistant's reply so far. history: earlier {"role": "user"|"assistant", "content"} messages,
      alternating and ending with a reply; content a string or a list of Gradio text parts.
  /complete(prompt, temperature, top_p, max_new_tokens, echo, show_probabilities) -> (str, list, dict)
      Yields (text, tokens, stats): text so far (after the prompt with echo); tokens, with show_probabilities,
      [{"token": text, "probability": p, "generated": bool}] (with echo the prompt's tokens come first),
      else []; stats: prompt_tokens, generated_tokens, max_seq_len, tokens_per_second, finish_reason.
"""

from __future__ import annotations

import collections
import colorsys
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Optional

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry or version checks
if importlib.util.find_spec("matplotlib") is None:
    # Gradio tries to import matplotlib twice for every streamed update; without it each try searches the
    # import path again (0.1 ms per update). Record it as missing, so the tries fail at once.
    sys.modules["matplotlib"] = None
import anyio  # noqa: E402
import gradio as gr  # noqa: E402

from ..errors import ContextLengthError, LlamaError  # noqa: E402
from ..grammar import grammar_for  # noqa: E402
from ..loader import ModelInfo  # noqa: E402
from ..prompt_library import PromptLibrary  # noqa: E402
from ..serving import aio, requests  # noqa: E402
from ..serving.streams import TextEngine, TextStream, stream_chat, stream_completion  # noqa: E402
from ..tokenizer import StreamDecoder  # noqa: E402
from . import branches, conversations  # noqa: E402

APP_DIR = Path(__file__).resolve().parent  # page.css and page.js: package data beside this file
THEME = gr.themes.Default(primary_hue="amber", secondary_hue="stone")  # local fonts only: works offline
# Least time between two updates of a streamed reply, on the page and through the API: each update costs the
# server about as much as a decode step, and the thread streaming a reply sleeps in between instead of waking
# for each token.
STREAM_UPDATE_SECONDS = 0.1
# Conversations are kept in the browser's localStorage under this key. Gradio encrypts them with the secret; a
# fixed one lets them survive a server restart (it guards nothing: the data is the user's own, in their browser).
STORAGE_KEY, STORAGE_SECRET = "llama-core-conversations", "llama-core-conversations-v1"
# The page's question before Clear or Delete; while a reply streams (the chatbot's own trash button is not disabled
# then), it says to stop first instead, and nothing is cleared.
ASK_UNLESS_STREAMING = """() => {
  const stop = document.getElementById("chat-stop");
  if (stop && stop.checkVisibility()) { alert("A reply is still coming: Stop it first."); return false; }
  return confirm(%s);
}"""
CLEAR_QUESTION = "Clear this chat? Its messages, every version of them, are removed; this cannot be undone."
DELETE_QUESTION = "Delete this chat? It and every version of its messages are removed; this cannot be undone."
STOPPED_STATS = "Stopped: the reply above was cut short."  # under a reply Stop ended
TOP_ALTERNATIVES = 5  # alternatives listed for each token of a completion shown with probabilities
ADVANCED = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "seed",
            "output_format", "output_grammar")
OUTPUT_FORMATS = [("Text", "text"), ("JSON", "json"), ("JSON schema", "json_schema"), ("Regular expression", "regex"),
                  ("Lark grammar", "lark")]
CSS = (APP_DIR / "page.css").read_text(encoding="utf-8")

# Run once the page loads: a change in a stale tab, leaving mid-reply, Escape, a message a reload cut off (page.js).
PAGE_JS = (APP_DIR / "page.js").read_text(encoding="utf-8").replace("STORAGE_KEY", json.dumps(STORAGE_KEY))
# Run in the page's head, before the app mounts: the conversations' store shared by the app's tabs (store.js).
PAGE_HEAD = "<script>%s</script>" % (APP_DIR / "store.js").read_text(encoding="utf-8").replace(
    "STORAGE_KEY", json.dumps(STORAGE_KEY))

PROBABILITY_LABELS = [f"{i / 100:.2f}" for i in range(101)]
PROBABILITY_COLORS = {  # red (unlikely) through amber to green (likely)
    label: "#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hls_to_rgb(float(label) / 3, 0.78, 0.75))
    for label in PROBABILITY_LABELS
}


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
              max_new_tokens: Any, *advanced: Any, client: Optional[str] = None) -> TextStream:
    """The chat tab's turn: as start_chat, its controls in the tab's order (conversations.SETTINGS), and
    llama_core's errors raised as they are, for the tab to show inside the chat."""
    dialog = requests.chat_dialog(message, history, system_prompt)
    return stream_chat(engine, dialog, temperature, top_p, max_new_tokens, client=client,
                       **_with_grammar(_advanced(advanced)))


async def replies(stream: TextStream, seconds: float = STREAM_UPDATE_SECONDS) -> AsyncIterator[str]:
    """The reply so far when it has grown, at most every `seconds`; at least once (the refusal for a refused
    chat, or an empty reply). Read on the event loop, which it never blocks (llama_core.serving.aio)."""
    reply, shown = stream.refusal or "", False
    with _streaming(stream):
        async for chunks in aio.batches(stream, seconds):
            added = "".join(chunk.text for chunk in chunks)
            if added:
                reply += added
                yield reply
                shown = True
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

    prompt_text, echoed, probabilities, stream = await aio.submitted(start, aio.text_size(prompt))
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


def prompt_size_line(engine: TextEngine, prompt: Any) -> str:
    """The completion prompt's size in tokens (BOS included) against the model's context, or what is wrong."""
    try:
        prompt = requests.text(prompt, "prompt")
    except LlamaError as exc:
        return f"Prompt: {exc}."
    if not prompt:
        return "Prompt: empty."
    tokens, max_seq_len = len(engine.tokenizer.encode(prompt, bos=True, eos=False)), engine.info.max_seq_len
    if tokens >= max_seq_len:
        return (f"Prompt: **{tokens:,} tokens**, but the model holds {max_seq_len:,} in all: shorten it by at "
                f"least {tokens - max_seq_len + 1:,} tokens to leave room for any continuation.")
    return (f"Prompt: **{tokens:,} tokens** (BOS included) of the model's {max_seq_len:,}; room for "
            f"{max_seq_len - tokens:,} more.")


def marked_completion(prompt: str, generated: str) -> list[tuple[str, Optional[str]]]:
    """The prompt as plain text and the generated text marked, for a gr.HighlightedText."""
    return [(prompt, None)] + ([(generated, "generated")] if generated else [])


def alternatives_table(token: dict) -> str:
    """A generated token's most likely alternatives, as a Markdown table (empty for a prompt token)."""
    rows = token.get("alternatives") or []
    if not rows:
        return ""
    head = f"**{_markdown_cell(token['token'])}** ({token['probability']:.1%}) · the model's most likely tokens here:\n\n"
    return head + "| token | probability |\n|---|---|\n" + "\n".join(
        f"| {_markdown_cell(row['token'])} | {row['probability']:.1%} |" for row in rows)


def _markdown_cell(text: str) -> str:
    shown = text.replace("\n", "↵").replace("|", "\\|").replace("`", "'")
    return f"`{shown}`" if shown.strip() else f"`{shown or '∅'}`"


def stats_line(stats: dict) -> str:
    """The line shown under a reply: speed, tokens, context used, and whether old exchanges were dropped."""
    if stats["finish_reason"] == "refused":
        return "Refused: the message holds reserved chat-format tags."
    drafted = f" ({stats['accepted_tokens']} of them drafted ahead)" if stats.get("accepted_tokens") else ""
    speed = f"{stats['tokens_per_second']:.1f} tokens/s · " if stats["tokens_per_second"] > 0 else ""  # none to measure
    generated, used = stats["generated_tokens"], stats["prompt_tokens"] + stats["generated_tokens"]
    line = (f"{speed}{generated} token{'' if generated == 1 else 's'} generated{drafted} · context "
            f"{used} / {stats['max_seq_len']} tokens "
            f"({stats['prompt_tokens']} prompt" + (f", {stats['cached_tokens']} of them cached" if stats.get("cached_tokens") else "")
            + ")")
    if stats["finish_reason"] == "length":
        line += " · stopped: the context is full" if used >= stats["max_seq_len"] else " · stopped at the token limit"
    elif stats["finish_reason"] in ("eos", "stop") and not generated:
        line += " · nothing written: the model ended at once"
    if stats["dropped_pairs"]:
        line += (f"\n\n**Note:** the {stats['dropped_pairs']} oldest exchange(s) were left out to fit the "
                 f"{stats['max_seq_len']}-token context: the model no longer sees them.")
    return line


# -- the interface ---------------------------------------------------------------------------------------
def _highlights(tokens: list[dict]) -> list[tuple[str, str]]:
    """(text, probability label) pairs; a newline shows as ↵ so that its token keeps a visible chip."""
    return [(t["token"].replace("\n", "↵\n"), PROBABILITY_LABELS[round(100 * t["probability"])])
            for t in tokens if t["token"]]


def model_facts(info: ModelInfo) -> str:
    args = info.args
    # Meta's params.json does not state the trained context: say so rather than show an assumed 4,096.
    trained_for = f"{args.max_seq_len:,}" if args.max_seq_len is not None else "not stated by the checkpoint"
    rows = [
        # Names only: the page must not show the server's disk layout.
        ("Checkpoint", f"`{os.path.basename(os.path.normpath(str(info.ckpt_dir)))}`"),
        ("Tokenizer", f"`{os.path.basename(str(info.tokenizer_path))}` ({args.vocab_size:,} pieces)"),
        ("Parameters", f"{info.parameter_count:,}"),
        ("Layers · width · heads (kv)", f"{args.n_layers} · {args.dim} · {args.n_heads} ({args.n_kv_heads})"),
        ("dtype · device", f"{info.weights} · {info.device}"),
        *([("CPU products", info.cpu_products)] if info.cpu_products else []),
        ("Memory", f"weights {_size(info.weights_bytes)} · KV cache {_size(info.kv_cache_bytes)}"
                   + (f" in {info.kv_cache_dtype}" if info.kv_cache_dtype else "")),
        ("Context (max_seq_len)", f"{info.max_seq_len:,} tokens (trained for {trained_for})"),
        ("Batch (max_batch_size)", f"{info.max_batch_size} requests decoded together"),
        ("Load time", f"{info.load_seconds:.2f} s"),
    ]
    return "| Model | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _sampling_controls(info: ModelInfo, prefix: str) -> list[gr.components.Component]:
    """Temperature, top-p and max new tokens, then the Advanced accordion's controls in ADVANCED order. Temperature
    and top-p start as the checkpoint's generation_config.json says, else at Llama-2's 0.6 and 0.9."""
    max_seq_len, stated = info.max_seq_len, info.generation_config
    temperature = 0.6 if stated.temperature is None else min(stated.temperature, 2.0)
    top_p = 0.9 if stated.top_p is None else stated.top_p
    basic = [
        gr.Slider(0, 2, value=temperature, step=0.05, label="Temperature", info="0 is greedy",
                  elem_id=f"{prefix}-temperature"),
        gr.Slider(0, 1, value=top_p, step=0.01, label="Top-p", info="keep the most likely tokens holding this "
                  "much probability (0: the most likely only)", elem_id=f"{prefix}-top-p"),
        gr.Slider(1, max_seq_len - 1, value=min(256, max(1, max_seq_len // 4)), step=1, label="Max new tokens",
                  elem_id=f"{prefix}-max-new-tokens"),
    ]
    with gr.Accordion("Advanced", open=False, elem_id=f"{prefix}-advanced"):
        advanced = [
            gr.Slider(0, 200, value=0, step=1, label="Top-k", info="keep only the k most likely tokens; 0 is off",
                      elem_id=f"{prefix}-top-k"),
            gr.Slider(0, 1, value=0, step=0.01, label="Min-p", info="drop tokens less likely than this share of "
                      "the most likely one; 0 is off", elem_id=f"{prefix}-min-p"),
            gr.Slider(0.5, 2, value=1, step=0.05, label="Repetition penalty", info="above 1 discourages tokens "
                      "already in the prompt or reply; 1 is off", elem_id=f"{prefix}-repetition-penalty"),
            gr.Slider(-2, 2, value=0, step=0.1, label="Presence penalty", info="above 0 discourages any token the "
                      "reply already used", elem_id=f"{prefix}-presence-penalty"),
            gr.Slider(-2, 2, value=0, step=0.1, label="Frequency penalty", info="above 0 discourages tokens by how "
                      "often the reply used them", elem_id=f"{prefix}-frequency-penalty"),
            gr.Textbox(label="Stop strings", lines=2, info="one per line (at most 4): the reply ends before the "
                       "first", elem_id=f"{prefix}-stop-strings"),
            gr.Number(None, label="Seed", precision=0, info="the same seed and settings give the same reply; empty "
                      "is random", elem_id=f"{prefix}-seed"),
            gr.Dropdown(OUTPUT_FORMATS, value="text", label="Reply format", info="JSON: any JSON object; the others "
                        "follow the box below", elem_id=f"{prefix}-output-format"),
            gr.Textbox(label="JSON schema, regular expression or Lark grammar", lines=3, max_lines=12,
                       placeholder='{"type": "object", "properties": {"name": {"type": "string"}}}',
                       elem_id=f"{prefix}-output-grammar"),
        ]
    return basic + advanced


def _advanced(values: tuple) -> dict[str, Any]:
    """The Advanced accordion's values as the requests' controls (the stop box holds one string per line)."""
    controls = dict(zip(ADVANCED, values))
    controls["stop"] = [line for line in (controls["stop"] or "").splitlines() if line]
    return controls


def _with_grammar(controls: dict[str, Any]) -> dict[str, Any]:
    """Sampling controls from the requests' controls: output_format and output_grammar made into the grammar
    they name. Raises InvalidRequestError for a format its box does not fit."""
    output_format, spec = controls.pop("output_format", None), controls.pop("output_grammar", None)
    return dict(controls, grammar=grammar_for(output_format or "text", spec or ""))


class _Turns:
    """The chat's turns (a message sent, and its reply) by the id in the page's pending state: the one respond
    that runs a turn (a second trigger of the same pending, Enter while a reply streams, finds it taken), its
    stream, the Stops asked of it, and the one finish that keeps it. A reply asked to stop ends itself, so that
    what its page showed is what is saved (one writer). Used on the event loop only."""

    KEPT = 1024  # turns remembered, the oldest over forgotten first (a running one never)

    def __init__(self) -> None:
        self._states: collections.OrderedDict[str, str] = collections.OrderedDict()  # "running", "ended", "settled"
        self._streams: dict[str, TextStream] = {}
        self._stops: dict[str, bool] = {}  # turn -> whether the message box was empty at the Stop

    def claim(self, turn: Optional[str]) -> bool:
        """Whether the caller runs this turn: the first to ask does, if no Stop settled it before."""
        if turn is None:
            return True
        if turn in self._states:
            return False
        self._states[turn] = "running"
        while len(self._states) > self.KEPT:
            oldest = next((t for t, state in self._states.items() if state != "running"), None)
            if oldest is None:
                break
            del self._states[oldest]
            self._stops.pop(oldest, None)
        return True

    def running(self, turn: Optional[str], stream: TextStream) -> None:
        if turn is not None:
            self._streams[turn] = stream
            if turn in self._stops:  # stopped while it was being submitted
                stream.cancel()

    def end(self, turn: Optional[str]) -> None:
        self._streams.pop(turn, None)
        if self._states.get(turn) == "running":
            self._states[turn] = "ended"

    def stop(self, turn: Any, box_empty: bool) -> bool:
        """Asks the turn to end; True where it had not begun: it is over now (no respond will run it, no
        finish keep it), and the caller puts the page back."""
        if type(turn) is not str:
            return False
        if turn not in self._states:
            self._states[turn] = "settled"
            return True
        if self._states[turn] == "running":
            self._stops[turn] = box_empty
            stream = self._streams.get(turn)
            if stream is not None:  # ends it in the engine now, whether or not text is coming
                stream.cancel()
        return False

    def stopped(self, turn: Optional[str]) -> bool:
        return turn in self._stops

    def box_empty_at_stop(self, turn: Optional[str]) -> bool:
        return self._stops.get(turn, True)

    def settle(self, turn: Optional[str]) -> bool:
        """Whether the caller (a finish) keeps the turn: once, after its respond ended."""
        if turn is None or self._states.get(turn, "ended") != "ended":
            return turn is None
        self._states[turn] = "settled"
        self._stops.pop(turn, None)
        return True


def build_demo(engine: TextEngine, prompts: PromptLibrary) -> gr.Blocks:
    """The app on a running engine: Chat, Completion and Model tabs, and the /chat and /complete API."""
    info = engine.info
    generating = dict(concurrency_id="generate", concurrency_limit=2 * info.max_batch_size)  # the engine batches
    defaults: dict[str, Any] = {}  # the chat controls' initial values, as conversations.SETTINGS names them
    bounds: dict[str, tuple] = {}  # the sliders' (minimum, maximum, step), by the same names
    ui = dict(api_visibility="private")
    turns = _Turns()

    # The API's two routes run on the server's event loop (async): no worker thread between a request and
    # the engine, or between a token and its client.
    async def chat(message: str, history: list[dict], system_prompt: str, temperature: float, top_p: float,
                   max_new_tokens: int, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0, stop: Optional[list[str]] = None,
                   seed: Optional[int] = None, output_format: str = "text", output_grammar: str = "",
                   request: gr.Request = None) -> AsyncIterator[str]:
        """Streams the assistant's reply to message after history: yields the reply so far. output_format:
        text, json (any JSON object), json_schema, regex or lark, the last three held to output_grammar."""
        stream = await aio.submitted(
            lambda: start_chat(engine, message, history, system_prompt, temperature, top_p, max_new_tokens,
                               top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, stop=stop,
                               seed=seed, output_format=output_format, output_grammar=output_grammar,
                               client=client_of(request)),
            aio.text_size(message, history, system_prompt, output_grammar))
        async for reply in replies(stream):
            yield reply

    async def complete_api(prompt: str, temperature: float, top_p: float, max_new_tokens: int, echo: bool,
                           show_probabilities: bool, top_k: int = 0, min_p: float = 0.0,
                           repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, stop: Optional[list[str]] = None,
                           seed: Optional[int] = None, output_format: str = "text", output_grammar: str = "",
                           request: gr.Request = None) -> AsyncIterator[tuple[str, list[dict], dict]]:
        """Streams a completion of prompt: yields (text, tokens with probabilities, stats). output_format: as
        for /chat."""
        async for update in complete(engine, prompt, temperature, top_p, max_new_tokens, echo, show_probabilities,
                                     top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, stop=stop,
                                     seed=seed, output_format=output_format, output_grammar=output_grammar,
                                     client=client_of(request)):
            yield update

    # -- the chat tab: conversations kept in the browser (llama_core.app.conversations) ------------------
    def settings_of(values: tuple) -> dict[str, Any]:
        return dict(zip(conversations.SETTINGS, values))

    def loaded(store: Any) -> dict:
        return conversations.loaded_store(store, prompts.system_prompt, defaults)

    def button_states(conversation: dict, busy: bool, title: bool = False, notice: bool = False) -> list:
        """Send and Stop swap in place; the others only when they have something to do, and New chat, Delete
        and the title box not while a reply streams (into this conversation). title: the box shows the
        conversation's title too. notice: a turn's notice shows, which Retry sends again and Undo takes away."""
        has_messages = bool(conversation["messages"]) and not busy
        titled = {"value": conversation["title"]} if title else {}
        return [gr.update(visible=not busy), gr.update(visible=busy), gr.update(interactive=has_messages or notice),
                gr.update(interactive=has_messages or notice), gr.update(interactive=has_messages),
                gr.update(interactive=not busy), gr.update(interactive=not busy),
                gr.update(interactive=not busy, **titled)]

    def branch_states(conversation: dict, at: Optional[int] = None) -> list:
        """The branch bar for message `at` of those shown (by default branches.branch_point): which
        version it is, ‹ and › to flip, and Retry this reply for a reply."""
        messages = conversation["messages"]
        if at not in range(len(messages)):
            at = branches.branch_point(conversation)
        if at is None:
            return [None, gr.update(visible=False)] + [gr.skip()] * 4
        version, versions = branches.branch_position(conversation, at)
        who = "Reply" if messages[at]["role"] == "assistant" else "Message"
        label = f"{who} {at // 2 + 1} · version {version} / {versions}"
        return [at, gr.update(visible=True), label, gr.update(interactive=version > 1),
                gr.update(interactive=version < versions), gr.update(interactive=who == "Reply")]

    def view(store: dict, shown: Optional[list[dict]] = None, stats: Optional[str] = None,
             at: Optional[int] = None) -> list:
        """Every view_outputs update for the store's active conversation."""
        conversation = conversations.active(store)
        settings = dict(defaults, **conversation["settings"])
        return [store, conversation["messages"] if shown is None else shown,
                conversation["stats"] if stats is None else stats, conversation["system_prompt"],
                *[settings[name] for name in conversations.SETTINGS],
                gr.update(choices=conversations.choices(store), value=store["active"], interactive=True),
                *button_states(conversation, busy=False, title=True), *branch_states(conversation, at),
                gr.update(visible=False), gr.update(visible=False, value=None)]  # a prompt shown, a file exported:
        # both out of date

    def unchanged(extra: int = 0) -> list:
        return [gr.skip()] * (len(view_outputs) + extra)

    def restore(store: Any):
        """The page as the browser's store has it. The store is written back only where reading it changed it
        (a new one, or one left from an older version): any write tells the app's other tabs they are stale."""
        kept = loaded(store)
        return [gr.skip() if kept == store else kept, *view(kept)[1:]]

    def begin(message: str, store: Any, pending: Optional[dict]):
        """Shows the user's message at once and marks a reply as under way; a message sent while one streams
        (Enter in the box) waits in the box."""
        if pending is not None or not message.strip():
            return [gr.skip()] * len(begin_outputs)
        conversation = conversations.active(loaded(store))
        return beginning(conversation, message, len(conversation["messages"]), box="")

    def beginning(conversation: dict, message: str, keep: int, box: Any = gr.skip()) -> list:
        """begin_outputs for a reply to `message` after the conversation's first `keep` messages."""
        return [conversation["messages"][:keep] + [{"role": "user", "content": message}], box, "",
                {"message": message, "keep": keep, "turn": uuid.uuid4().hex}, gr.update(interactive=False),
                *button_states(conversation, busy=True), gr.update(visible=False), gr.update(visible=False)]

    def begin_retry(store: Any, pending: Optional[dict], shown: Any, at: Optional[int] = None):
        """A new reply to the message before reply `at` (by default the last reply), kept beside the old one;
        on a turn's notice, the turn sent again."""
        conversation = conversations.active(loaded(store))
        refused = conversations.refused_turn(shown, conversation["messages"])
        if pending is None and refused is not None and at in (None, len(shown) - 1):
            return beginning(conversation, refused, len(conversation["messages"]), box="")
        at = len(conversation["messages"]) - 1 if at is None else at
        if pending is not None or at not in range(1, len(conversation["messages"]), 2):
            return [gr.skip()] * len(begin_outputs)
        return beginning(conversation, conversation["messages"][at - 1]["content"], at - 1)

    def begin_edit(store: Any, pending: Optional[dict], shown: Any, edit: gr.EditData):
        """A message edited in place: the reply to it starts a branch beside the old exchange (a turn refused
        or failed, edited, is sent again)."""
        if pending is not None:
            return [gr.skip()] * len(begin_outputs)
        conversation = conversations.active(loaded(store))
        try:
            message = requests.text(edit.value, "message").rstrip("\n")  # Enter in the edit box adds a newline
        except LlamaError:
            message = ""
        refused = (conversations.refused_turn(shown, conversation["messages"]) is not None
                   and edit.index == len(conversation["messages"]))
        if (edit.index not in range(0, len(conversation["messages"]), 2) and not refused) or not message.strip():
            return [conversation["messages"]] + [gr.skip()] * (len(begin_outputs) - 1)  # the page shows it: undo
        return beginning(conversation, message, edit.index, box="" if refused else gr.skip())

    def select_message(store: Any, pending: Optional[dict], selected: gr.SelectData):
        if pending is not None or selected is None or type(selected.index) is not int:  # not the page's click
            return [gr.skip()] * 6
        return branch_states(conversations.active(loaded(store)), selected.index)

    def flip(at: Optional[int], store: Any, pending: Optional[dict], step: int):
        if pending is not None or at is None:
            return unchanged()
        store = loaded(store)
        conversation = branches.flipped(conversations.active(store), at, step)
        return view(conversations.with_conversation(store, conversation), at=at)

    async def respond(request: gr.Request, pending: Optional[dict], store: Any, system_prompt: str, *controls):
        """Streams the reply to the pending message; `finish` then keeps it in the conversation (as the store
        is then: what was changed while it streamed stays). A turn that is refused or fails is not kept: the
        chat shows why and how to fix it below the message, the message goes back to the box, and the
        conversation goes on from its last good state. Runs on the server's event loop, as the API's routes do."""
        if pending is None:
            yield [gr.skip()] * 4
            return
        turn = pending.get("turn")
        if not turns.claim(turn):  # another respond runs this turn, or a Stop ended it before it began
            yield [gr.skip()] * 4
            return
        try:
            async with contextlib.aclosing(_turn_updates(pending, store, system_prompt, controls,
                                                         client_of(request))) as updates:
                async for update in updates:
                    yield update
        finally:
            turns.end(turn)

    async def _turn_updates(pending: dict, store: Any, system_prompt: str, controls: tuple, client: Optional[str]):
        store = await anyio.to_thread.run_sync(loaded, store)  # checking a long store: off the loop
        message, keep, turn = pending["message"], pending["keep"], pending.get("turn")
        conversation = conversations.active(store)
        history, left_out = conversations.model_history(conversation["messages"][:keep])
        shown = conversation["messages"][:keep] + [{"role": "user", "content": message}]
        reply, notice, stream, stopped = "", None, None, False
        try:
            stream = await aio.submitted(lambda: open_chat(engine, message, history, system_prompt, *controls,
                                                           client=client),
                                         aio.text_size(message, history, system_prompt))
        except ContextLengthError:
            notice = conversations.context_notice(engine.tokenizer, info.max_seq_len, message, system_prompt,
                                                  controls[2])
        except LlamaError as exc:
            notice = f"This message was not sent: {on_page(str(exc))}."
        if stream is not None and stream.refusal is not None:
            notice = (conversations.REFUSED_SYSTEM_NOTICE if conversations.has_reserved_tags(system_prompt)
                      else conversations.REFUSED_NOTICE)
        elif stream is not None:
            turns.running(turn, stream)
            try:
                async with contextlib.aclosing(replies(stream)) as updates:
                    async for update in updates:
                        if turns.stopped(turn):
                            break
                        reply = update
                        yield [shown + [{"role": "assistant", "content": reply}]] + [gr.skip()] * 3
            except gr.Error as exc:
                notice = f"The reply failed: {on_page(exc.message)} Send the message again."
            finally:
                stream.cancel()
            stopped = turns.stopped(turn)  # the reply as shown is the answer; none yet: the conversation as it
            if stopped and not reply:  # was, and a message just sent back in the box (unless one is typed there)
                fresh = keep == len(conversation["messages"]) and turns.box_empty_at_stop(turn)
                yield [conversation["messages"], conversation["stats"], None, message if fresh else gr.skip()]
                return
            notice = None if stopped else notice
        if notice is not None:
            yield [shown + [{"role": "assistant", "content": conversations.NOTICE_MARK + notice}], "", {"notice": True},
                   message]
            return
        stats = STOPPED_STATS if stopped else stats_line(request_stats(stream))
        if left_out:
            stats += f"\n\n**Note:** {left_out} earlier exchange(s) holding reserved chat-format tags were left out."
        done = conversations.with_exchange(conversation, keep, message, reply, stats)
        yield [done["messages"], stats, {"id": conversation["id"], "keep": keep, "message": message, "reply": reply,
                                         "stats": stats, "conversation": done}, gr.skip()]

    def show_prompt(message: str, store: Any, system_prompt: str, max_new_tokens: Any):
        """The exact prompt the next turn would give the model, and what of the history does not fit."""
        messages = conversations.active(loaded(store))["messages"]
        return gr.update(visible=True, open=True), conversations.prompt_preview(engine, message, messages,
                                                                                system_prompt, max_new_tokens)

    def finish(store: Any, finished: Optional[dict], pending: Optional[dict]):
        """After a reply: it kept in its conversation as the store is now (settings, system prompt or title
        changed while it streamed stay); then nothing pending, and the buttons for the conversation as it is
        (no branch bar under a turn's notice). Once a turn: a second trigger's finish changes nothing, and one
        whose begin started nothing (Enter while a reply streams: pending is not yet, or no longer, set)
        leaves the page alone (it cleared pending and the buttons while the reply streamed)."""
        if pending is None or not turns.settle(pending.get("turn")):
            return [gr.skip()] * len(finish_outputs)
        store = loaded(store)
        if finished is not None and "reply" in finished:
            store = conversations.with_reply_kept(store, finished)
        conversation = conversations.active(store)
        notice = finished is not None and "notice" in finished
        branch = [None, gr.update(visible=False)] + [gr.skip()] * 4 if notice else branch_states(conversation)
        listed = gr.update(choices=conversations.choices(store), value=store["active"], interactive=True)
        return [store, None, None, listed,
                *button_states(conversation, busy=False, title=True, notice=notice), *branch]

    async def stop_reply(pending: Optional[dict], store: Any, box: Any):
        """Asks the reply under way to end: respond then keeps the reply as it showed it (or, before any, puts
        a message just sent back in the box, unless one is typed there), and finish saves it. A turn still
        waiting for its respond to start (Gradio's queue) ends here. On the event loop, as respond runs."""
        box_empty = not (type(box) is str and box.strip())
        if pending is None or not turns.stop(pending.get("turn"), box_empty):
            return unchanged(2)
        store = loaded(store)
        fresh = box_empty and pending["keep"] == len(conversations.active(store)["messages"])
        return view(store) + [pending["message"] if fresh else gr.skip(), None]

    def undo(store: Any, pending: Optional[dict], shown: Any):
        """The last exchange taken back, its message back in the box; a turn's notice only goes (its message is
        in the box already)."""
        store = loaded(store)
        conversation = conversations.active(store)
        if pending is None and conversations.refused_turn(shown, conversation["messages"]) is not None:
            return view(store) + [gr.skip()]
        if pending is not None or not conversation["messages"]:
            return unchanged(1)
        message = conversation["messages"][-2]["content"]
        return view(conversations.with_conversation(store, branches.undone(conversation))) + [message]

    def clear_chat(store: Any, pending: Optional[dict], confirmed: bool):
        """The conversation's messages, every version, gone once the page's dialog confirmed it (the chatbot's
        own trash button has emptied the chat on the page already: not confirmed, it shows them again)."""
        store = loaded(store)
        if pending is not None or not confirmed:  # the store as it was: not written, no other tab told
            return [gr.skip(), *view(store)[1:]] if pending is None else unchanged()
        return view(conversations.with_conversation(store, branches.cleared(conversations.active(store))))

    def new_chat(store: Any, pending: Optional[dict], prompt: str, *controls):
        store = loaded(store)
        if pending is not None:
            return unchanged()
        if conversations.is_new(conversations.active(store)):  # this one: the store is not written
            shown = [gr.skip(), *view(store)[1:]]
        else:
            shown = view(conversations.with_conversation(
                store, conversations.new_conversation(prompt, settings_of(controls))))
        # The page shows these already: an update would undo a control changed while New chat ran.
        at = view_outputs.index(system_prompt)
        for i, value in enumerate((prompt, *controls), start=at):
            if shown[i] == value:
                shown[i] = gr.skip()
        return shown

    def switch(chosen: Any, store: Any, pending: Optional[dict]):
        return unchanged() if pending is not None else view(conversations.switched(loaded(store), chosen))

    def rename(title: Any, store: Any):
        """The title typed (Enter, or leaving the box); the same title writes nothing (nor moves its chat up)."""
        store = loaded(store)
        kept = conversations.renamed(store, title)
        if conversations.active(kept)["title"] == conversations.active(store)["title"]:
            return gr.skip(), gr.skip(), conversations.active(store)["title"]
        return kept, gr.update(choices=conversations.choices(kept), value=kept["active"]), \
            conversations.active(kept)["title"]

    def delete(store: Any, pending: Optional[dict], confirmed: bool):
        if pending is not None or not confirmed:
            return unchanged()
        return view(conversations.deleted(loaded(store), prompts.system_prompt, defaults))

    def save_settings(name: str, store: Any, system_prompt: Any, *controls):
        """Saves what was typed or chosen into the conversation, when control `name` (the system prompt or a
        setting) changed it. The values come as the page holds them (the event skips Gradio's checks, which
        would refuse a slider's box typed past its range, and log it): a number outside its slider's range is
        saved at the nearest end, and the box shows it; an emptied box keeps the value it had. Where `name`
        holds the value saved already, the page set it (a load, a switch) and nothing is written: the controls
        after it may not be shown yet (their old values were saved: a seed and a reply format lost on reload),
        and the app's other tabs are not told they are stale."""
        store = loaded(store)
        conversation = conversations.active(store)
        settings = dict(defaults, **conversation["settings"])
        kept = [conversations.kept_setting(setting, value, settings[setting], bounds.get(setting))
                for setting, value in zip(conversations.SETTINGS, controls)]
        prompt = conversations.kept_setting("system_prompt", system_prompt, conversation["system_prompt"])
        shown = [gr.skip() if value == typed else value for value, typed in zip(kept, controls)]  # a box's fix
        if name == "system_prompt" and prompt == conversation["system_prompt"] or \
                name != "system_prompt" and kept[conversations.SETTINGS.index(name)] == settings[name]:
            return [gr.skip(), *shown]
        saved = dict(conversation, system_prompt=prompt, settings=settings_of(kept))
        return [conversations.with_conversation(store, saved) if saved != conversation else gr.skip(), *shown]

    def export(store: Any, kind: str):
        return gr.update(value=exports.write(conversations.active(loaded(store)), kind), visible=True)

    def import_file(data: Optional[bytes], store: Any, pending: Optional[dict]):
        if pending is not None or data is None:
            return unchanged()
        store = loaded(store)
        try:
            conversation = conversations.from_json(data)
        except conversations.ConversationFileError as exc:
            return view(store, stats=f"**Not imported:** {exc}.")
        there = conversations.same_in_store(store, conversation)
        if there is not None:  # shown, not copied
            return view(dict(store, active=there["id"]), stats=f"Not imported: “"
                        f"{conversations.as_markdown_text(there['title'])}” is here already, the same (shown).")
        return view(conversations.with_conversation(store, conversation),
                    stats=f"Imported “{conversations.as_markdown_text(conversation['title'])}”.")

    async def complete_ui(request: gr.Request, prompt, temperature, top_p, max_new_tokens, *advanced_and_flags):
        """Streams a completion into the tab; a request that is refused or fails says why under the buttons,
        the last output left as it was."""
        *advanced, echo, show_probabilities = advanced_and_flags
        updates = complete(engine, prompt, temperature, top_p, max_new_tokens, echo, show_probabilities,
                           client=client_of(request), **_advanced(advanced))
        shown, stats = [], None
        try:
            async for text, tokens, stats in updates:
                shown = [t for t in tokens if t["token"]]
                generated = text[len(prompt):] if echo else text
                yield (text, _highlights(shown), gr.skip(), shown, marked_completion(prompt, generated),
                       {"prompt": prompt, "text": generated})
        except gr.Error as exc:
            said = "The completion failed" if stats is not None else "Not generated"
            yield gr.skip(), gr.skip(), f"**{said}:** {on_page(exc.message)}", gr.skip(), gr.skip(), gr.skip()
            return
        yield gr.skip(), gr.skip(), stats_line(stats), gr.skip(), gr.skip(), gr.skip()

    def completion_running(busy: bool) -> list:
        """Generate and Stop swap in place, as Send and Stop do; Continue waits for the end."""
        return [gr.update(visible=not busy), gr.update(visible=busy), gr.update(interactive=not busy)]

    def continued_prompt(prompt: str, completed: Optional[dict]):
        """The prompt with its last generation appended (the box as it is when it was not generated from it)."""
        if completed is not None and completed["prompt"] == prompt:
            return prompt + completed["text"]
        return gr.skip()

    def alternatives_of(shown: list[dict], selected: gr.SelectData) -> str:
        if selected.index not in range(len(shown)):
            return ""
        return alternatives_table(shown[selected.index])

    exports = conversations.ExportFiles()
    # Gradio's copies of files handed over or uploaded: those older than an hour go, looked for hourly.
    with gr.Blocks(title="Llama-2", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"## Llama-2 · `{info.name}`")
        store = gr.BrowserState(None, storage_key=STORAGE_KEY, secret=STORAGE_SECRET)
        pending = gr.State(None)  # {"message", "keep"} while a reply is under way
        confirmed = gr.Checkbox(False, visible=False)  # what the page's last confirm() dialog answered
        with gr.Tabs(elem_id="tabs"):  # one bar: a component between two tabs would start another
            with gr.Tab("Chat", elem_id="chat-tab"), gr.Row(elem_id="chat-row"):
                with gr.Column(scale=1, min_width=200, elem_id="chat-sidebar"):
                    new_button = gr.Button("New chat", size="md", elem_id="chat-new")
                    chat_list = gr.Radio(label="Conversations", elem_id="chat-list")
                    chat_title = gr.Textbox(label="Title", max_lines=1, elem_id="chat-title",
                                            info="Enter, or leaving the box, renames")
                    delete_button = gr.Button("Delete this chat", size="sm", variant="stop", elem_id="chat-delete")
                    with gr.Row():
                        export_json = gr.Button("Export JSON", size="sm", elem_id="chat-export-json")
                        export_markdown = gr.Button("Export Markdown", size="sm", elem_id="chat-export-markdown")
                    import_button = gr.UploadButton("Import JSON", size="sm", file_types=[".json"], type="binary",
                                                    elem_id="chat-import")
                    exported = gr.File(label="Exported", visible=False, interactive=False, elem_id="chat-exported")
                with gr.Column(scale=3, min_width=300, elem_id="chat-main"):
                    chatbot = gr.Chatbot(label="Chat · click a message for its versions", elem_id="chatbot",
                                         height=420, buttons=["copy", "copy_all"], editable="user",
                                         placeholder="Say something to start the conversation.")
                    with gr.Row(elem_id="chat-branch", visible=False) as branch_row:
                        branch_prev = gr.Button("‹", size="sm", min_width=40, scale=0, elem_id="chat-branch-prev")
                        branch_label = gr.Markdown(elem_id="chat-branch-label")
                        branch_next = gr.Button("›", size="sm", min_width=40, scale=0, elem_id="chat-branch-next")
                        branch_retry = gr.Button("Retry this reply", size="sm", scale=0, min_width=120,
                                                 elem_id="chat-branch-retry")
                    branch_at = gr.State(None)  # the message the branch bar is about, an index into those shown
                    chat_stats = gr.Markdown(elem_id="chat-stats")
                    with gr.Row(elem_id="chat-compose"):
                        chat_input = gr.Textbox(show_label=False, placeholder="Message (Enter sends)", scale=5,
                                                elem_id="chat-input", autofocus=True, min_width=160, max_lines=8)
                        send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send", min_width=80)
                        stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop", visible=False,
                                         min_width=80)
                    with gr.Row(elem_id="chat-tools"):
                        retry, undo_button, clear = (
                            gr.Button(name, size="sm", interactive=False, elem_id=f"chat-{name.lower()}")
                            for name in ("Retry", "Undo", "Clear"))
                        show_prompt_button = gr.Button("Show prompt", size="sm", elem_id="chat-show-prompt")
                    with gr.Accordion("The prompt the model sees next", open=True, visible=False,
                                      elem_id="chat-prompt-panel") as prompt_panel:
                        prompt_shown = gr.Markdown(elem_id="chat-prompt")
                    examples = gr.Examples(prompts.chat_examples, chat_input, label="Examples", elem_id="chat-examples")
                with gr.Column(scale=1, min_width=240):
                    system_prompt = gr.Textbox(prompts.system_prompt, label="System prompt", lines=4,
                                               elem_id="system-prompt")
                    chat_controls = _sampling_controls(info, "chat")
            with gr.Tab("Completion", elem_id="completion-tab"), gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(label="Prompt", lines=4, elem_id="completion-prompt",  # Enter: a new line
                                        placeholder="Text for the model to continue (Shift+Enter generates)")
                    prompt_size = gr.Markdown(prompt_size_line(engine, ""), elem_id="completion-prompt-tokens")
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="completion-generate")
                        continue_button = gr.Button("Continue", elem_id="completion-continue")
                        stop_completion = gr.Button("Stop", variant="stop", elem_id="completion-stop", visible=False)
                    marked = gr.HighlightedText(label="Prompt and generated text", color_map={"generated": "#fcd34d"},
                                                show_legend=True, elem_id="completion-marked")
                    completed = gr.State(None)  # {"prompt", "text"}: the last generation and the prompt it continued
                    output = gr.Textbox(label="Output", lines=8, interactive=False, elem_id="completion-output")
                    tokens = gr.HighlightedText(label="Tokens, each with its probability", color_map=PROBABILITY_COLORS,
                                                show_legend=False, show_inline_category=True, visible=False,
                                                elem_id="completion-tokens")
                    alternatives = gr.Markdown(elem_id="completion-alternatives")
                    completion_stats = gr.Markdown(elem_id="completion-stats")
                    shown_tokens = gr.State([])
                    gr.Examples(prompts.completion_examples, prompt, label="Examples")
                with gr.Column(scale=1):
                    completion_controls = _sampling_controls(info, "completion")
                    echo = gr.Checkbox(label="Echo the prompt", elem_id="completion-echo")
                    show_probabilities = gr.Checkbox(label="Show probabilities", elem_id="completion-probabilities")
            with gr.Tab("Model", elem_id="model-tab"):
                gr.Markdown(model_facts(info), elem_id="model-facts")

        defaults.update(zip(conversations.SETTINGS, (control.value for control in chat_controls)))
        bounds.update((name, (control.minimum, control.maximum, control.step))  # the sliders' ranges
                      for name, control in zip(conversations.SETTINGS, chat_controls) if name in conversations.SLIDERS)
        buttons = [send, stop, retry, undo_button, clear, new_button, delete_button, chat_title]  # button_states'
        branch_outputs = [branch_at, branch_row, branch_label, branch_prev, branch_next, branch_retry]
        view_outputs = [store, chatbot, chat_stats, system_prompt, *chat_controls, chat_list, *buttons,
                        *branch_outputs, prompt_panel, exported]
        begin_outputs = [chatbot, chat_input, chat_stats, pending, chat_list, *buttons, prompt_panel, branch_row]
        reply_inputs = [pending, store, system_prompt, *chat_controls]
        finished = gr.State(None)  # the reply respond streamed, for finish to keep; or {"notice": True}
        reply_outputs = [chatbot, chat_stats, finished, chat_input]
        finish_outputs = [store, pending, finished, chat_list, *buttons, *branch_outputs]
        begins = [(trigger, begin, [chat_input, store, pending]) for trigger in (chat_input.submit, send.click)]
        begins.append((examples.load_input_event.then, begin, [chat_input, store, pending]))
        begins.append((retry.click, begin_retry, [store, pending, chatbot]))
        begins.append((chatbot.retry, begin_retry, [store, pending, chatbot]))
        begins.append((branch_retry.click, begin_retry, [store, pending, chatbot, branch_at]))
        begins.append((chatbot.edit, begin_edit, [store, pending, chatbot]))
        answers = [trigger(start, inputs, begin_outputs, queue=False, **ui)
                   .then(respond, reply_inputs, reply_outputs, **generating, **ui)
                   for trigger, start, inputs in begins]
        for answer in answers:
            answer.then(finish, [store, finished, pending], finish_outputs, queue=False, **ui)
        stop.click(stop_reply, [pending, store, chat_input], view_outputs + [chat_input, pending], queue=False,
                   **ui)
        chatbot.select(select_message, [store, pending], branch_outputs, queue=False, **ui)
        branch_prev.click(lambda at, s, p: flip(at, s, p, -1), [branch_at, store, pending], view_outputs, queue=False,
                          **ui)
        branch_next.click(lambda at, s, p: flip(at, s, p, 1), [branch_at, store, pending], view_outputs, queue=False,
                          **ui)
        show_prompt_button.click(show_prompt, [chat_input, store, system_prompt, chat_controls[2]],
                                 [prompt_panel, prompt_shown], queue=False, **ui)
        undo_button.click(undo, [store, pending, chatbot], view_outputs + [chat_input], queue=False, **ui)
        # Clear and Delete take every version of the messages, and cannot be undone: the page asks first.
        for trigger, question, then in ((clear.click, CLEAR_QUESTION, clear_chat),
                                        (chatbot.clear, CLEAR_QUESTION, clear_chat),
                                        (delete_button.click, DELETE_QUESTION, delete)):
            trigger(None, None, confirmed, js=ASK_UNLESS_STREAMING % json.dumps(question), queue=False, **ui) \
                .then(then, [store, pending, confirmed], view_outputs, queue=False, **ui)
        new_button.click(new_chat, [store, pending, system_prompt, *chat_controls], view_outputs, queue=False, **ui)
        chat_list.input(switch, [chat_list, store, pending], view_outputs, queue=False, **ui)
        for renaming in (chat_title.submit, chat_title.blur):  # Enter, or leaving the box, renames
            renaming(rename, [chat_title, store], [store, chat_list, chat_title], queue=False, show_progress="hidden",
                     **ui)  # no loading cover over the list: a click on it as the box loses the focus is kept
        typed = {"system_prompt", "stop", "output_grammar"}  # text boxes: "input" is keys only (Gradio 6)
        for name, control in [("system_prompt", system_prompt), *zip(conversations.SETTINGS, chat_controls)]:
            trigger = control.change if name in typed else control.input
            trigger(functools.partial(save_settings, name), [store, system_prompt, *chat_controls],
                    [store, *chat_controls], queue=False, preprocess=False, **ui)
        export_json.click(lambda s: export(s, "json"), store, exported, queue=False, **ui)
        export_markdown.click(lambda s: export(s, "md"), store, exported, queue=False, **ui)
        import_button.upload(import_file, [import_button, store, pending], view_outputs, queue=False, **ui)
        demo.load(restore, store, view_outputs, queue=False, **ui)
        # An empty Number shown only later (under Advanced, closed) shows, and sends, 0 unless set empty after load.
        demo.load(lambda: None, None, completion_controls[conversations.SETTINGS.index("seed")], queue=False, **ui)

        completion_inputs = [prompt, *completion_controls, echo, show_probabilities]
        continues = continue_button.click(continued_prompt, [prompt, completed], prompt, queue=False, **ui).then
        running = [generate, stop_completion, continue_button]
        completions = [trigger(lambda: ["", *completion_running(True)], None, [completion_stats, *running], queue=False,
                               **ui)
                       .then(complete_ui, completion_inputs,
                             [output, tokens, completion_stats, shown_tokens, marked, completed], **generating, **ui)
                       for trigger in (generate.click, prompt.submit, continues)]
        for completion in completions:
            completion.then(lambda: completion_running(False), None, running, queue=False, **ui)
        prompt.change(lambda text: prompt_size_line(engine, text), prompt, prompt_size, queue=False, **ui)
        stop_completion.click(lambda: ["Stopped.", *completion_running(False)], None, [completion_stats, *running],
                              queue=False, cancels=completions, **ui)
        show_probabilities.change(lambda on: gr.update(visible=on), show_probabilities, tokens, queue=False, **ui)
        tokens.select(alternatives_of, shown_tokens, alternatives, queue=False, **ui)

        gr.api(chat, api_name="chat", **generating)
        gr.api(complete_api, api_name="complete", **generating)
    return demo
