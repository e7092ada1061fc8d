"""The one place a request is checked: the engine, the `Llama` facade and every route of the app use these.

Each check raises InvalidRequestError (or ContextLengthError) with a message that names the field and
what it accepts; values that pass come back in the types the engine uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..dialog import UNSAFE_ERROR, Dialog
from ..errors import ContextLengthError, InvalidRequestError

MAX_INPUT_CHARS = 100_000  # longest message, system prompt or completion prompt accepted
MAX_HISTORY_CHARS = 400_000  # longest chat history accepted, all messages together


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request for the engine: a prompt's token ids and how to continue it."""

    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.6
    top_p: float = 0.9
    prompt_logprobs: bool = False  # also the log-probabilities of prompt tokens 1..n-1
    logprobs: bool = True  # each chunk's log-probability (NaN without)

    @classmethod
    def checked(cls, prompt_tokens: Any, max_new_tokens: Any, temperature: Any = 0.6, top_p: Any = 0.9,
                prompt_logprobs: Any = False, logprobs: Any = True, *, vocab_size: int,
                max_seq_len: int) -> "GenerationRequest":
        """The request for a model with this vocabulary and context, or InvalidRequestError /
        ContextLengthError naming what is wrong."""
        check_sampling(temperature, top_p)
        max_new_tokens = check_max_new_tokens(max_new_tokens, max_seq_len)
        tokens = check_prompt_tokens(prompt_tokens, vocab_size, max_seq_len)
        return cls(tokens, max_new_tokens, float(temperature), float(top_p),
                   flag(prompt_logprobs, "prompt_logprobs"), flag(logprobs, "logprobs"))


# -- numbers -----------------------------------------------------------------------------------------------
def check_sampling(temperature: Any, top_p: Any) -> None:
    """Raises InvalidRequestError unless temperature >= 0 and 0 < top_p <= 1 (both finite numbers)."""
    value = _finite(temperature)
    if value is None or value < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0, got {_show(temperature)}")
    value = _finite(top_p)
    if value is None or not 0 < value <= 1:
        raise InvalidRequestError(f"top_p must be a number in (0, 1], got {_show(top_p)}")


def check_max_new_tokens(max_new_tokens: Any, max_seq_len: int) -> int:
    """max_new_tokens as an int from 1 to max_seq_len - 1 (an integral float, as sliders send, is accepted)."""
    value = whole_number(max_new_tokens)
    limit = max_seq_len - 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise InvalidRequestError(
            f"max_new_tokens must be an integer from 1 to {limit} (the context is {max_seq_len} tokens), "
            f"got {_show(max_new_tokens)}"
        )
    return value


def whole_number(value: Any) -> Any:
    """An integral float (a slider's 64.0) as an int; anything else unchanged, for its check to judge."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def check_prompt_tokens(prompt_tokens: Any, vocab_size: int, max_seq_len: int, name: str = "prompt") -> tuple[int, ...]:
    """A prompt's token ids: at least one, each in [0, vocab_size), at most max_seq_len - 1 of them."""
    if not isinstance(prompt_tokens, (list, tuple)) or not prompt_tokens:
        raise InvalidRequestError(f"{name} is empty: it needs at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_tokens):
        raise InvalidRequestError(f"{name} has token ids outside [0, {vocab_size})")
    if len(prompt_tokens) >= max_seq_len:
        raise ContextLengthError(
            f"{name} has {len(prompt_tokens)} tokens, but max_seq_len is {max_seq_len}: "
            f"it must be at most {max_seq_len - 1} to leave room for a reply"
        )
    return tuple(prompt_tokens)


# -- fields of the app's routes --------------------------------------------------------------------------
def text(value: Any, name: str) -> str:
    """A string field (Gradio's list of text parts is joined), at most MAX_INPUT_CHARS long."""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "".join(str(p.get("text", "")) for p in value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_INPUT_CHARS:
        raise InvalidRequestError(
            f"{name} is too long: {len(value):,} characters, at most {MAX_INPUT_CHARS:,} are accepted"
        )
    return value


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {_show(value)}")
    return value


def completion_prompt(prompt: Any) -> str:
    """The prompt of a completion: a non-blank string."""
    prompt = text(prompt, "prompt")
    if not prompt.strip():
        raise InvalidRequestError("prompt is empty: type some text to continue")
    return prompt


def chat_dialog(message: Any, history: Any, system_prompt: Any) -> Dialog:
    """The dialog of a chat turn: the system prompt (when not blank), the earlier exchanges of history (those
    the chat refused left out) and the new message.

    history: earlier {"role", "content"} messages, alternating user and assistant, ending with a reply.
    """
    message, system_prompt = text(message, "message"), text(system_prompt, "system_prompt")
    if not message.strip():
        raise InvalidRequestError("message is empty: type something to say")
    dialog: Dialog = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    return dialog + chat_history(history) + [{"role": "user", "content": message}]


def chat_history(history: Any) -> Dialog:
    """Earlier messages as llama_core messages, leaving out exchanges the chat refused."""
    if not isinstance(history, list):
        raise InvalidRequestError(
            f"history must be a list of {{'role', 'content'}} messages, got {type(history).__name__}"
        )
    messages: Dialog = []
    for i, message in enumerate(history):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidRequestError(f"history[{i}] must be a dict with 'role' and 'content', got {str(message)[:60]!r}")
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise InvalidRequestError(
                f"history[{i}] has role {_show(message['role'])} but {expected!r} was expected: history "
                "alternates user and assistant messages (the system prompt is a parameter of its own)"
            )
        messages.append({"role": expected, "content": text(message["content"], f"history[{i}] content")})
    if len(messages) % 2:
        raise InvalidRequestError("history must end with an assistant reply; the new message is a parameter of its own")
    if sum(len(m["content"]) for m in messages) > MAX_HISTORY_CHARS:
        raise InvalidRequestError(f"history is too long: more than {MAX_HISTORY_CHARS:,} characters in all")
    pairs = [messages[i : i + 2] for i in range(0, len(messages), 2) if messages[i + 1]["content"] != UNSAFE_ERROR]
    return [m for pair in pairs for m in pair]


def check_batch(prompts: Sequence[Any], max_batch_size: int) -> None:
    """Raises InvalidRequestError unless prompts is a non-empty list of at most max_batch_size prompts."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("no prompts given: expected a non-empty list of prompts")
    if len(prompts) > max_batch_size:
        raise InvalidRequestError(f"{len(prompts)} prompts given, but max_batch_size is {max_batch_size}")


def _finite(value: Any) -> float | None:
    """value as a finite float, or None for anything else (a bool, a string, NaN, an int too large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _show(value: Any) -> str:
    """A value for an error message, cut short: a 400-digit number must not fill the message."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
