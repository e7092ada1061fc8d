"""The Llama-2 chat layout: [INST]/<<SYS>> prompts, the special-tag safety check, and fitting
long histories into the context by dropping the oldest turns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from .errors import ContextLengthError, DialogError
from .tokenizer import Tokenizer

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = list[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
UNSAFE_ERROR = "I can't answer that: the message contains reserved chat-format tags ([INST], [/INST], <<SYS>>, <</SYS>>). Please rephrase without them."

ROLES = ("system", "user", "assistant")


@dataclass
class FittedDialog:
    """A dialog encoded to fit the context: its prompt tokens and how many old (user, assistant) pairs were dropped."""

    prompt_tokens: list[int]
    dropped_pairs: int


def validate_dialog(dialog: object, reply_started: bool = False) -> None:
    """Raises DialogError naming the first problem: empty dialog, unknown role, misplaced system message,
    roles not alternating user/assistant, last message not from the user (or with reply_started, the
    assistant: the start of its reply, which the model continues), or content not a string."""
    if not isinstance(dialog, (list, tuple)) or not dialog:
        raise DialogError(f"a dialog must be a non-empty list of messages, got {_describe(dialog)}")
    for i, message in enumerate(dialog):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DialogError(f"message {i} must be a dict with 'role' and 'content', got {_describe(message)}")
        if message["role"] not in ROLES:
            raise DialogError(f"message {i} has unknown role {message['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DialogError(f"message {i} content must be a string, got {type(message['content']).__name__}")
        if message["role"] == "system" and i != 0:
            raise DialogError(f"message {i} is a system message; only the first message may be one")
    offset = 1 if dialog[0]["role"] == "system" else 0
    for i in range(offset, len(dialog)):
        expected = "user" if (i - offset) % 2 == 0 else "assistant"
        if dialog[i]["role"] != expected:
            raise DialogError(
                f"message {i} has role {dialog[i]['role']!r} but {expected!r} was expected: "
                "after an optional system message, roles must alternate user, assistant, user, ..."
            )
    if dialog[-1]["role"] != "user" and not (reply_started and dialog[-1]["role"] == "assistant"):
        raise DialogError(f"message {len(dialog) - 1}: the last message must be from the user, not {dialog[-1]['role']!r}")


def ends_in_reply(dialog: Dialog) -> bool:
    """Whether a dialog ends with the start of the assistant's reply, for the model to continue."""
    return dialog[-1]["role"] == "assistant"


def has_special_tags(dialog: object) -> bool:
    """True if any message's content (system included) contains a reserved chat-format tag."""
    if not isinstance(dialog, (list, tuple)):
        return False
    return any(
        isinstance(m, dict) and isinstance(m.get("content"), str) and any(tag in m["content"] for tag in SPECIAL_TAGS)
        for m in dialog
    )


def dialog_segments(dialog: Dialog) -> list[tuple[str, bool]]:
    """A valid dialog in the exact Llama-2 chat layout: (text, ends with EOS) for each BOS-started segment,
    one per (user, assistant) exchange and one for the last user message, or where the dialog ends with the
    start of the assistant's reply, one for that exchange, open for the reply to go on."""
    validate_dialog(dialog, reply_started=True)
    if dialog[0]["role"] == "system":
        first = {"role": "user", "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}
        dialog = [first] + list(dialog[2:])
    started = ends_in_reply(dialog)
    exchanges = dialog[:-2] if started else dialog[:-1]
    segments = [(f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} ", True)
                for prompt, answer in zip(exchanges[::2], exchanges[1::2])]
    if started:
        question, start = dialog[-2]["content"].strip(), dialog[-1]["content"].strip()
        return segments + [(f"{B_INST} {question} {E_INST} {start}", False)]
    return segments + [(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", False)]


def encode_dialog(tokenizer: Tokenizer, dialog: Dialog) -> list[int]:
    """Token ids of a valid dialog in the exact Llama-2 chat layout (BOS/EOS as ids, never as text)."""
    tokens: list[int] = []
    for text, eos in dialog_segments(dialog):
        tokens += tokenizer.encode(text, bos=True, eos=eos)
    return tokens


def dialog_text(dialog: Dialog) -> str:
    """The text encode_dialog encodes, BOS and EOS written as <s> and </s> (for people to read: the text
    itself would encode those as plain characters)."""
    return "".join(f"<s>{text}" + ("</s>" if eos else "") for text, eos in dialog_segments(dialog))


def fit_dialog(tokenizer: Tokenizer, dialog: Dialog, max_prompt_tokens: int) -> FittedDialog:
    """Encodes dialog, dropping its oldest whole (user, assistant) pairs until it has at most
    max_prompt_tokens tokens. The system prompt and the last user message (with the reply's start where the
    dialog ends with one) are always kept.

    Raises:
        ContextLengthError: the system prompt and last user message alone don't fit.
    """
    validate_dialog(dialog, reply_started=True)
    system = [dialog[0]] if dialog[0]["role"] == "system" else []
    turns = list(dialog[len(system) :])
    n_pairs = (len(turns) - (2 if ends_in_reply(dialog) else 1)) // 2

    def encoded(dropped: int) -> list[int]:
        return encode_dialog(tokenizer, system + turns[2 * dropped :])

    tokens = encoded(0)
    if len(tokens) <= max_prompt_tokens:
        return FittedDialog(tokens, 0)
    shortest = encoded(n_pairs)
    if len(shortest) > max_prompt_tokens:
        raise ContextLengthError(
            f"the last message{' with the system prompt' if system else ''} needs {len(shortest)} tokens, "
            f"but only {max_prompt_tokens} fit beside the room kept for the reply: "
            f"over by {len(shortest) - max_prompt_tokens} tokens"
        )
    # Fewest dropped pairs that fit; dropping more never makes the prompt longer.
    low, high = 1, n_pairs
    while low < high:
        middle = (low + high) // 2
        if len(encoded(middle)) <= max_prompt_tokens:
            high = middle
        else:
            low = middle + 1
    return FittedDialog(encoded(low), low)


def reply_room(max_seq_len: int, max_gen_len: int) -> int:
    """Tokens prepare_chat keeps free for the reply: max_gen_len, but at most half the context."""
    return max(1, min(max_gen_len, max_seq_len // 2))


def prepare_chat(tokenizer: Tokenizer, max_seq_len: int, dialog: Dialog, max_gen_len: int) -> FittedDialog:
    """Validates and encodes a dialog for a max_seq_len context, dropping its oldest turns until it fits with
    room for the reply: max_gen_len tokens, but at most half the context (a longer reply still runs until
    the context is full). Where the dialog ends with the reply's start, that start is in the room: what it
    leaves, at least one token, is kept for the rest (a long reply goes on without its own exchange dropped)."""
    validate_dialog(dialog, reply_started=True)
    room = reply_room(max_seq_len, max_gen_len)
    if ends_in_reply(dialog):
        room = max(1, room - len(tokenizer.encode(dialog[-1]["content"].strip(), bos=False, eos=False)))
    return fit_dialog(tokenizer, dialog, max_seq_len - room)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
