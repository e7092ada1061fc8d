"""Reading a request: its fields as what the engine runs, each refused naming the field at fault (an APIError).

The chat's messages become a Llama-2 dialog, a completion's prompt its prompts, the sampling fields the
engine's controls (the grammar among them: .reply_grammar), `n` the choices and their seeds, and max_tokens
the number of tokens to generate.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..dialog import SPECIAL_TAGS, Dialog, ends_in_reply
from ..errors import ContextLengthError, LlamaError
from ..serving import requests
from ..serving.requests import MAX_SEED, SamplingParams
from ..serving.streams import TextEngine
from . import tools
from .errors import APIError, from_llama_error
from .reply_grammar import grammar_fields, request_grammar
from .schemas import ChatCompletionRequest, ChatMessage, Prediction, SamplingFields, TextPart, TokenizeRequest

MAX_CHOICES = 16  # most choices (n x prompts) in one request
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "seed", "logit_bias")


def refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    """A 400 for what the chat route does not take: OpenAI's older `functions`, or tools with a guided field."""
    if body.functions:
        raise APIError(400, "functions is OpenAI's older form of tools: send tools instead", param="functions")
    if body.audio is not None or any(kind != "text" for kind in body.modalities or ()):
        raise APIError(400, "this model writes text only: modalities can only be [\"text\"], and audio is not taken",
                       param="audio" if body.audio is not None else "modalities")
    held = [name for name in grammar_fields(body) if name != "response_format"]  # a format goes with tools
    if body.tools and held and body.tool_choice != "none":
        raise APIError(400, f"{held[0]} and tools cannot hold one reply together: send one of them (response_format "
                       "may go with tools)", param=held[0])


def reply_tools(body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[tools.Function], bool]:
    """The tools the reply may call, and whether it must call one."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
        return [], False
    return tools.callable_now(tools.check_tools(body.tools), body.tool_choice)


def tagged_field(body: ChatCompletionRequest) -> str:
    """The field first holding a reserved chat-format tag ([INST], <<SYS>>, ...) that the dialog's check refused:
    a message's content (or text part, or call's arguments), or a tool's description or parameters; "messages"
    where none is found (a tag made by joining two texts)."""
    def tagged(text: Any) -> bool:
        return isinstance(text, str) and any(tag in text for tag in SPECIAL_TAGS)

    for i, message in enumerate(body.messages):
        if tagged(message.content):
            return f"messages[{i}].content"
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if tagged(part.text):
                return f"messages[{i}].content[{j}].text"
        for j, call in enumerate(message.tool_calls or ()):
            if tagged(call.function.arguments) or tagged(call.function.name):
                return f"messages[{i}].tool_calls[{j}].function"
    for i, tool in enumerate(body.tools or ()):
        if tagged(tool.function.description):
            return f"tools[{i}].function.description"
        if tagged(json.dumps(tool.function.parameters, ensure_ascii=False)):
            return f"tools[{i}].function.parameters"
    return "messages"


def predicted_text(prediction: Optional[Prediction]) -> Optional[str]:
    """The predicted reply's text (OpenAI's predicted outputs), or None."""
    if prediction is None:
        return None
    if prediction.type != "content":
        raise APIError(400, f"prediction.type must be 'content', got {prediction.type!r}", param="prediction.type")
    return content_text(prediction.content, "prediction.content")


def llama_dialog(messages: list[ChatMessage], tools_note: str = "") -> Dialog:
    """OpenAI's messages as a Llama-2 dialog ("developer" is OpenAI's newer name for "system"; an assistant's
    tool calls and the tools' results as tools.history_turns writes them), tools_note at the end of the system
    prompt. OpenAI takes any order of roles, Llama-2's layout one: messages of one role in a row are one turn
    (a blank line between), a system message after the conversation's start is read in its place as the
    user's words, a dialog of system messages alone gets an empty user turn, and one that ends with the
    assistant's is the start of the reply, which the model continues."""
    if not messages:
        raise APIError(400, "messages is empty: send at least one user message", param="messages")
    turns: list[tuple[str, list[str]]] = []  # each turn's role and its messages' texts, joined once at the end
    for i, role, written in tools.history_turns(messages):
        message = messages[i]
        role = {"developer": "system", "tool": "user"}.get(role, role)
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}] has role {message.role!r}; this server takes system, developer, "
                           "user, assistant and tool messages", param=f"messages[{i}].role")
        if written is None and message.content is None:
            raise APIError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
        content = "" if message.content is None or message.role == "tool" else content_text(
            message.content, f"messages[{i}].content")
        if written is not None:
            content = f"{content}\n{written}" if content else content_text(written, f"messages[{i}]")
        if role == "system" and turns and turns[-1][0] != "system":
            role = "user"
        if role == "assistant" and (not turns or turns[-1][0] == "system"):
            turns.append(("user", [""]))  # the assistant spoke first (a greeting)
        if turns and turns[-1][0] == role:
            turns[-1][1].append(content)
        else:
            turns.append((role, [content]))
    dialog: Dialog = [{"role": role, "content": "\n\n".join(texts)} for role, texts in turns]
    if tools_note:
        if dialog[0]["role"] == "system":
            dialog[0] = {"role": "system", "content": f"{dialog[0]['content']}\n\n{tools_note}".strip()}
        else:
            dialog.insert(0, {"role": "system", "content": tools_note})
    if len(dialog) == 1 and dialog[0]["role"] == "system":
        dialog.append({"role": "user", "content": ""})
    return dialog


def check_reply_start(dialog: Dialog, controls: dict[str, Any]) -> None:
    """A 400 where the messages end with the assistant's (a reply for the model to continue) and a grammar
    (response_format, tools, a guided field) would hold the continuation as a whole reply."""
    if ends_in_reply(dialog) and controls.get("grammar") is not None:
        raise APIError(400, "the last message is the assistant's, the start of a reply for the model to continue; "
                       "response_format, tools and the guided fields hold a whole reply: end with a user message",
                       param="messages")


def content_text(content: str | list[TextPart], field: str) -> str:
    """A content field's text: a string, or text parts joined; any other part (an image, audio), or text that
    is not valid or too long, is refused naming the field."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text":
                raise APIError(400, f"{field}[{j}] is a {part.type!r} part; this model reads text parts only",
                               param=f"{field}[{j}]")
            if part.text is None:
                raise APIError(400, f"{field}[{j}] is a text part without its text", param=f"{field}[{j}].text")
        content = "".join(part.text for part in content)
    try:
        return requests.text(content, field)
    except LlamaError as exc:
        raise APIError(400, str(exc), param=field,
                       code="context_length_exceeded" if isinstance(exc, ContextLengthError) else None) from None


def completion_prompts(prompt: Any, vocabulary: int) -> list[str | list[int]]:
    """A completion request's prompts, as the OpenAI API takes them: a string, a list of strings, a list of
    token ids (one prompt, taken as it is: no BOS is added), or a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: send a string, a list of strings, or lists of token ids", param="prompt")
    single = all(isinstance(item, int) and not isinstance(item, bool) for item in prompt)  # one prompt of ids
    prompts: list[str | list[int]] = []
    for i, item in enumerate([prompt] if single else prompt):
        name = "prompt" if single else f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            try:
                prompts.append(requests.token_ids(item, vocabulary, name))
            except LlamaError as exc:
                raise APIError(400, str(exc), param="prompt") from None
        else:
            raise APIError(400, f"prompt[{i}] is {type(item).__name__}: a prompt is a string or a list of token ids",
                           param="prompt")
    return prompts


def choice_count(n: Optional[int], prompts: int = 1, capacity: Optional[int] = None) -> int:
    """n, checked: at most MAX_CHOICES choices in all, and no more than the engine can ever hold at once for
    one client (`capacity`: a request past it would be answered busy however long its client waited)."""
    n = 1 if n is None else n
    what = f"n ({n}) x prompts ({prompts})" if prompts > 1 else f"n ({n})"
    if not 1 <= n * prompts <= MAX_CHOICES:
        raise APIError(400, f"{what} must be from 1 to {MAX_CHOICES} choices in one request", param="n")
    if capacity is not None and n * prompts > capacity:
        raise APIError(400, f"{what} choices are more than this server holds at once ({capacity}: its requests "
                            "running and waiting, for one client)", param="n")
    return n


def sampling_controls(body: SamplingFields, eos_id: Optional[int] = None, **extra: Any) -> dict[str, Any]:
    """The request's sampling fields as llama_core's sampling controls (each absent one at its default), its
    response_format as a grammar; with ignore_eos, EOS (eos_id) never drawn, as vLLM's field asks."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if given.get("top_k") == -1:  # vLLM's "off"
        given["top_k"] = 0
    if getattr(body, "ignore_eos", None) and eos_id is not None:
        given["logit_bias"] = {**(given.get("logit_bias") or {}), str(eos_id): -100}
    controls = {**{name: getattr(SamplingParams, name) for name in SAMPLING_FIELDS}, **given, **extra,
                "grammar": request_grammar(body)}
    try:
        SamplingParams(**controls)  # judged once here, so that a bad value is refused before any choice runs
    except LlamaError as exc:
        raise from_llama_error(exc, set(body.model_fields_set)) from None
    return controls


def choice_seeds(seed: Optional[int], n: int) -> list[Optional[int]]:
    """Each choice's seed: choice i of a seeded request samples with seed + i, so the choices differ and the
    request is reproducible."""
    return [None if seed is None else (seed + i) % (MAX_SEED + 1) for i in range(n)]


def new_token_limit(max_tokens: Optional[int], engine: TextEngine, name: str, scoring: bool = True) -> int:
    """max_tokens as the engine's max_new_tokens: None is as many as the context holds, and a larger number
    than the context is cut to it (the reply then ends with finish_reason "length" where the context does).
    scoring: a 0 is said to be for echo on completions (where the API has those)."""
    limit = engine.info.max_seq_len - 1
    if max_tokens is None:
        return limit
    if max_tokens < 1:
        zero = " (0 only with echo, on completions: the prompt scored, nothing written)" \
            if max_tokens == 0 and scoring else ""
        raise APIError(400, f"{name} must be at least 1{zero}, got {max_tokens}", param=name)
    return min(max_tokens, limit)


def include_usage(body: SamplingFields) -> bool:
    """Whether a streamed reply ends with its usage (stream_options.include_usage)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)
