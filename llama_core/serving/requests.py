"""The one place a request is checked: the engine, the `Llama` facade and every route of the app use these.

Each check raises InvalidRequestError (or ContextLengthError) with a message that names the field and
what it accepts; values that pass come back in the types the engine uses.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

from ..dialog import UNSAFE_ERROR, Dialog
from ..errors import ContextLengthError, InvalidRequestError
from ..grammar import Grammar

MAX_INPUT_CHARS = 100_000  # longest message, system prompt or completion prompt accepted
MAX_HISTORY_CHARS = 400_000  # longest chat history accepted, all messages together
MAX_STOP_STRINGS = 4  # as the OpenAI API allows
MAX_STOP_CHARS = 200  # longest stop string
MAX_TOP_LOGPROBS = 20  # alternatives per position
MAX_LOGIT_BIAS = 300  # tokens a request may bias, as the OpenAI API allows
MAX_SEED = 2**63 - 1
MAX_CLIENT_CHARS = 256  # longest client identity (an address, a session, a key's name)
# Hotter than this is the same draw from the nucleus, near uniform; the devices divide in float32, where 1e300
# would overflow.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Every control of how one request picks its tokens, checked once when made; the same names as
    llama.cpp, vLLM, Hugging Face and the OpenAI API. Each feature is off at its default except temperature
    and top_p. Raises InvalidRequestError naming the field and the range it accepts."""

    temperature: float = 0.6  # 0 is greedy
    top_p: float = 0.9  # keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's; 0: off
    repetition_penalty: float = 1.0  # over prompt and generated tokens: divide positive logits, multiply negative ones
    presence_penalty: float = 0.0  # over generated tokens: logit -= presence_penalty once a token appeared
    frequency_penalty: float = 0.0  # over generated tokens: logit -= frequency_penalty x its count
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any
    seed: Optional[int] = None  # the same seed gives the same tokens, alone or batched (float32: see the README)
    logprobs: bool = True  # each generated token's log-probability (NaN without)
    top_logprobs: int = 0  # the most likely alternatives per position, with their log-probabilities
    grammar: Optional[Grammar] = None  # what the reply must match (a JSON schema, a regex, a Lark grammar)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit): -100 bans it, 100 all but forces it

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)
        set_field = object.__setattr__.__get__(self)
        set_field("temperature", float(self.temperature))
        set_field("top_p", float(self.top_p))
        set_field("top_k", _integer(self.top_k, "top_k", 0, None, "0 (off) or more"))
        set_field("min_p", _number(self.min_p, "min_p", 0.0, 1.0, "in [0, 1]"))
        set_field("repetition_penalty", _number(self.repetition_penalty, "repetition_penalty", 0.01, 10.0,
                                                "in [0.01, 10] (1 is off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            set_field(name, _number(getattr(self, name), name, -2.0, 2.0, "in [-2, 2] (0 is off)"))
        set_field("stop", stop_strings(self.stop))
        if self.seed is not None:
            set_field("seed", _integer(self.seed, "seed", 0, MAX_SEED, f"an integer from 0 to {MAX_SEED}"))
        set_field("logprobs", flag(self.logprobs, "logprobs"))
        set_field("top_logprobs", _integer(self.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS,
                                           f"an integer from 0 to {MAX_TOP_LOGPROBS}"))
        set_field("logit_bias", logit_bias(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidRequestError("grammar must be a llama_core.Grammar (Grammar.json(schema), Grammar.regex(pattern) "
                                      f"or Grammar.lark(source)), got {type(self.grammar).__name__}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_stop(self, extra: Sequence[str]) -> "SamplingParams":
        """These parameters with more stop strings (a chat's dialog tags), past the user's limit of four. With a
        grammar, the reply never writes them instead: a stop there would cut it short of its grammar."""
        params = copy.copy(self)
        object.__setattr__(params, "stop", tuple(dict.fromkeys(self.stop + tuple(extra))))
        if self.grammar is not None:
            object.__setattr__(params, "grammar", self.grammar.forbidding(tuple(extra)))
        return params


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as (token, bias) pairs sorted by token: None, a mapping of token ids (ints, or their
    decimal text as JSON sends them) to numbers from -100 to 100, or such pairs; at most MAX_LOGIT_BIAS tokens.
    Token ids are checked against the model's vocabulary with the request (GenerationRequest.checked)."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple, type({}.items()))):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers from -100 to 100, got {_show(value)}")
    bias: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidRequestError(f"logit_bias must map token ids to numbers from -100 to 100, got {_show(value)}")
        token, amount = pair
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers of 0 or more), got {_show(token)}")
        bias[token] = _number(amount, f"logit_bias[{token}]", -100.0, 100.0, "from -100 to 100")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    return tuple(sorted(bias.items()))


def stop_strings(value: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: None, one string or a list of at most MAX_STOP_STRINGS non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {_show(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    for s in value:
        if not s:
            raise InvalidRequestError("stop strings must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {len(s):,}")
        if _has_lone_surrogate(s):
            raise InvalidRequestError("stop strings must be valid Unicode text (a lone surrogate was found)")
    return tuple(value)


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request for the engine: a prompt's token ids and how to continue it."""

    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False  # also the log-probabilities of prompt tokens 1..n-1
    prediction_tokens: tuple[int, ...] = ()  # the reply as the caller expects it: prompt lookup drafts from it
    standalone_text: bool = False  # the reply's text reads alone (a chat reply's content), not after the prompt:
    # stop strings are found in that text (where "▁I" starts it, it reads "I", not " I")
    client: Optional[str] = None  # who sends it, for fair admission (see scheduler); None: anonymous

    @classmethod
    def checked(cls, prompt_tokens: Any, max_new_tokens: Any, params: SamplingParams, prompt_logprobs: Any = False,
                *, vocab_size: int, max_seq_len: int, name: str = "prompt",
                prediction_tokens: Any = (), standalone_text: bool = False,
                client: Optional[str] = None) -> "GenerationRequest":
        """The request for a model with this vocabulary and context, or InvalidRequestError /
        ContextLengthError naming what is wrong (the prompt as `name`). A prediction longer than the context
        is cut to it (no reply is longer). client: who sends it (see check_client)."""
        max_new_tokens = check_max_new_tokens(max_new_tokens, max_seq_len)
        tokens = check_prompt_tokens(prompt_tokens, vocab_size, max_seq_len, name,
                                     one_token_reply=max_new_tokens == 1)
        if not isinstance(prediction_tokens, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prediction_tokens):
            raise InvalidRequestError(f"prediction_tokens must be token ids in [0, {vocab_size})")
        outside = [token for token, _ in params.logit_bias if token >= vocab_size]
        if outside:
            raise InvalidRequestError(f"logit_bias has token {outside[0]}, outside the model's vocabulary "
                                      f"[0, {vocab_size})")
        return cls(tokens, max_new_tokens, params, flag(prompt_logprobs, "prompt_logprobs"),
                   tuple(prediction_tokens[:max_seq_len]), bool(standalone_text), check_client(client))


def check_client(client: Any) -> Optional[str]:
    """A request's client identity: None (anonymous: all such requests count as one client) or a non-empty
    string of at most MAX_CLIENT_CHARS characters; requests with the same one share the engine's fair share
    of one client."""
    if client is None:
        return None
    if not isinstance(client, str) or not client or len(client) > MAX_CLIENT_CHARS:
        raise InvalidRequestError(f"client must be None or a non-empty string of at most {MAX_CLIENT_CHARS} "
                                  f"characters naming who sends the request, got {_show(client)}")
    return client


def sampling_params(temperature: Any = 0.6, top_p: Any = 0.9, logprobs: Any = True,
                    params: Optional[SamplingParams] = None, **controls: Any) -> SamplingParams:
    """SamplingParams from keyword arguments (temperature, top_p, top_k, min_p, ..., as SamplingParams names
    them), or params as given when it is; raises InvalidRequestError for an unknown name."""
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        return params
    unknown = sorted(set(controls) - set(SamplingParams.names()))
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameter(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(SamplingParams.names())}")
    return SamplingParams(temperature=temperature, top_p=top_p, logprobs=logprobs, **controls)


# -- numbers -----------------------------------------------------------------------------------------------
def check_sampling(temperature: Any, top_p: Any) -> None:
    """Raises InvalidRequestError unless 0 <= temperature <= MAX_TEMPERATURE and 0 <= top_p <= 1 (both finite
    numbers; top_p 0 keeps the most likely token only, as Meta's reference and OpenAI's API take it)."""
    value = _finite(temperature)
    if value is None or not 0 <= value <= MAX_TEMPERATURE:
        raise InvalidRequestError(f"temperature must be a finite number from 0 to {MAX_TEMPERATURE:g} (0 is greedy), "
                                  f"got {_show(temperature)}")
    value = _finite(top_p)
    if value is None or not 0 <= value <= 1:
        raise InvalidRequestError(f"top_p must be a number from 0 to 1, got {_show(top_p)}")


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


def check_prompt_tokens(prompt_tokens: Any, vocab_size: int, max_seq_len: int, name: str = "prompt",
                        one_token_reply: bool = False) -> tuple[int, ...]:
    """A prompt's token ids: at least one, each in [0, vocab_size), at most max_seq_len - 1 of them (integers
    of any integer type: numpy's, a tensor's elements). With one_token_reply, up to max_seq_len: a reply's
    first token is drawn from the prompt's last position and takes no place in the cache (a prompt scored
    with echo and max_tokens 0, as lm-evaluation-harness sends a whole context window)."""
    if not isinstance(prompt_tokens, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {_kind(prompt_tokens)}")
    if not prompt_tokens:
        raise InvalidRequestError(f"{name} is empty: it needs at least one token")
    prompt_tokens = [_index(t) for t in prompt_tokens]
    for i, token in enumerate(prompt_tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{name}[{i}] is {_show(token)}: token ids are integers from 0 to "
                                      f"{vocab_size - 1}")
    most = max_seq_len if one_token_reply else max_seq_len - 1
    if len(prompt_tokens) > most:
        room = "" if one_token_reply else " to leave room for a reply"
        raise ContextLengthError(f"{name} has {len(prompt_tokens)} tokens, but max_seq_len is {max_seq_len}: "
                                 f"it must be at most {most}{room}")
    return tuple(prompt_tokens)


# -- fields of the app's routes --------------------------------------------------------------------------
def text(value: Any, name: str) -> str:
    """A string field (Gradio's list of text parts is joined), at most MAX_INPUT_CHARS long."""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "".join(str(p.get("text", "")) for p in value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    if _has_lone_surrogate(value):
        raise InvalidRequestError(f"{name} is not valid Unicode text: it holds a lone surrogate (such as \\ud800)")
    if len(value) > MAX_INPUT_CHARS:  # far past a context (a token spells a few characters): the prompt is too long
        raise ContextLengthError(
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


def token_ids(value: Any, vocabulary: int, name: str = "prompt") -> list[int]:
    """A prompt given as token ids: a non-empty list of integers from 0 to vocabulary - 1."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidRequestError(f"{name} is empty: send at least one token id")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocabulary:
            raise InvalidRequestError(f"{name}[{i}] is {_show(token)}: token ids are integers from 0 to {vocabulary - 1}")
    return list(value)


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


def check_batch(prompts: Sequence[Any], max_batch_size: int, what: str = "prompts") -> None:
    """Raises InvalidRequestError unless prompts is a non-empty list of at most max_batch_size prompts
    (`what` they are: prompts, dialogs)."""
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"expected a list of {what}, got {_kind(prompts)}")
    if not prompts:
        raise InvalidRequestError(f"no {what} given: expected a non-empty list of {what}")
    if len(prompts) > max_batch_size:
        raise InvalidRequestError(f"{len(prompts)} {what} given, but max_batch_size is {max_batch_size}")


def _number(value: Any, name: str, low: float, high: float, accepted: str) -> float:
    number = _finite(value)
    if number is None or not low <= number <= high:
        raise InvalidRequestError(f"{name} must be a number {accepted}, got {_show(value)}")
    return number


def _integer(value: Any, name: str, low: int, high: Optional[int], accepted: str) -> int:
    value = whole_number(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise InvalidRequestError(f"{name} must be {accepted}, got {_show(value)}")
    return value


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _finite(value: Any) -> float | None:
    """value as a finite float, or None for anything else (a bool, a string, NaN, an int too large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _index(value: Any) -> Any:
    """An integer of any integer type (numpy's int64, a one-element integer tensor) as an int; anything else
    (a bool, a float, a string) unchanged, for its check to refuse."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _kind(value: Any) -> str:
    """What a value that should have been a list is, for an error message (a tensor: convert it)."""
    kind = f"{type(value).__module__}.{type(value).__name__}".removeprefix("builtins.")
    return kind + (" (convert it with .tolist())" if hasattr(value, "tolist") else "")


def _show(value: Any) -> str:
    """A value for an error message, cut short: a 400-digit number must not fill the message."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
