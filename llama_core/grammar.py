"""Replies that must match a grammar: a JSON schema (or any JSON object), a regular expression or a Lark grammar.

A Grammar is checked when it is made and travels with a request's SamplingParams. The engine gives each request
that has one a GrammarMatcher (serving/grammar_matcher.py): before each draw it masks every token that would
break the grammar, and once the grammar is complete it ends the reply. The grammar engine is llguidance (as in
llama.cpp, vLLM and SGLang): it computes a mask over Llama-2's 32,000 tokens in about 0.1 ms.

JSON comes on one line, with the separators people write (`{"name": "Romeo", "age": 16}`): a small model let
loose on free whitespace can write newlines until its token limit. A schema's `"x-guidance"` object overrides
that (llguidance's JSON options, e.g. `{"whitespace_flexible": true}`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .errors import InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 100_000  # the longest schema, pattern or grammar accepted, as text
KINDS = ("json", "regex", "lark")
FIRST_STEPS = 16  # bytes a grammar is followed for when it is made: where its lexer meets llguidance's limits


@dataclass(frozen=True)
class Grammar:
    """What a reply must match, as llguidance's grammar (`text`), made by `json`, `regex` or `lark`, each of
    which raises InvalidRequestError naming what is wrong with the schema, pattern or grammar."""

    kind: str  # "json", "regex" or "lark": what it was made from
    text: str  # llguidance's grammar
    forbidden: tuple[str, ...] = ()  # texts a reply never writes, even where the grammar would allow them

    def __post_init__(self) -> None:
        if self.kind not in KINDS or not isinstance(self.text, str):
            raise InvalidRequestError(f"a Grammar is made by Grammar.json, Grammar.regex or Grammar.lark, "
                                      f"got kind {self.kind!r}")

    def forbidding(self, texts: tuple[str, ...]) -> "Grammar":
        """This grammar, with replies that never write any of `texts` (a chat's dialog tags: a reply that
        stopped at one would be cut short of its grammar, and one that held one would spoil the next turn)."""
        return dataclasses.replace(self, forbidden=tuple(dict.fromkeys(self.forbidden + tuple(texts))))

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}(...)"

    @classmethod
    def json(cls, schema: Optional[dict[str, Any] | bool] = None, name: str = "schema") -> "Grammar":
        """Replies that are JSON matching `schema` (a JSON Schema, as a dict); None: any JSON object, as the
        OpenAI API's "json_object" response format gives."""
        if schema is None:
            schema = {"type": "object"}
        if schema is False:
            raise InvalidRequestError(f"{name} is false, which no reply can match")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{name} must be a JSON Schema object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except RecursionError:
            raise InvalidRequestError(f"{name} is nested too deeply") from None
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{name} must hold only JSON values: {exc}") from None
        _check_length(text, name)
        try:
            grammar = _matcher_class().grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except RecursionError:
            raise InvalidRequestError(f"{name} is nested too deeply") from None
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{name} is not a JSON Schema this server can follow: {exc}") from None
        checked = cls._checked("json", grammar, name)
        for pattern in _patterns(schema):  # each from its start: one deep in the schema is met late in a reply
            whole = {"type": "string", "pattern": f"^(?:{pattern})$"}
            _follow_first_steps(_matcher_class().grammar_from_json_schema(whole, defaults=JSON_OPTIONS), name)
        return checked

    @classmethod
    def json_text(cls, text: str, name: str = "schema") -> "Grammar":
        """As json, from the schema's JSON text."""
        try:
            schema = json.loads(text)
        except RecursionError:
            raise InvalidRequestError(f"{name} is nested too deeply") from None
        except ValueError as exc:
            raise InvalidRequestError(f"{name} is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{name} must be a JSON Schema object, got {type(schema).__name__}")
        return cls.json(schema, name)

    @classmethod
    def regex(cls, pattern: str, name: str = "pattern") -> "Grammar":
        """Replies that match the regular expression `pattern` whole (Rust's regex syntax: no lookaround or
        backreferences)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(f"{name} must be a non-empty string, got {pattern!r:.60}")
        _check_length(pattern, name)
        return cls._checked("regex", _matcher_class().grammar_from_regex(pattern), name)

    @classmethod
    def lark(cls, source: str, name: str = "grammar") -> "Grammar":
        """Replies in the language of a Lark grammar whose rule `start` is the whole reply (llguidance's
        dialect: `%json {schema}` and `/regex/` terminals included)."""
        if not isinstance(source, str) or not source.strip():
            raise InvalidRequestError(f"{name} must be a non-empty string, got {source!r:.60}")
        _check_length(source, name)
        return cls._checked("lark", _matcher_class().grammar_from_lark(source), name)

    @classmethod
    def _checked(cls, kind: str, grammar: str, name: str) -> "Grammar":
        failed, messages = _matcher_class().validate_grammar_with_warnings(grammar, None)
        if failed:
            message = messages[0].split("(in regex): ", 1)[-1] if kind == "regex" else messages[0]
            raise InvalidRequestError(f"{name} is not valid: {first_lines(message)}")
        _follow_first_steps(grammar, name)
        return cls(kind, grammar)


def _check_length(text: str, name: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{name} must be at most {MAX_GRAMMAR_CHARS:,} characters, got {len(text):,}")


def _follow_first_steps(grammar: str, name: str) -> None:
    """Builds the grammar's matcher, lexer included, and follows it for its first FIRST_STEPS bytes (the
    lowest each time): llguidance builds its lexer as a reply goes, so a grammar within its limits when it is
    validated may still pass them there (`(a{1000}){1000}`, a million bytes forced) and fail a reply at its
    first token. Raises InvalidRequestError naming `name` where it does (or fails otherwise: a schema that only
    refers to itself); about a millisecond where it does not."""
    matcher = _matcher_class()(_byte_tokenizer(), grammar, log_level=0)
    for _ in range(FIRST_STEPS):
        if matcher.is_error() or matcher.is_stopped():
            break
        mask = matcher.compute_bitmask()  # a bit a byte, the end of sequence last
        lowest = next((b for b in range(256) if mask[b // 8] >> (b % 8) & 1), None)
        if lowest is None:
            break
        matcher.consume_token(lowest)
    if matcher.is_error():
        raise InvalidRequestError(unfollowable(name, matcher.get_error()))


def _patterns(schema: Any) -> Iterator[str]:
    """The regular expressions of a JSON Schema's string `pattern`s, however deep."""
    if isinstance(schema, list):
        for item in schema:
            yield from _patterns(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key not in ("enum", "const", "default", "examples"):
                yield from _patterns(value)


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, and an end of sequence: a grammar's first steps as bytes."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"\xffend"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.lru_cache(maxsize=1)
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_Bytes()))


def _matcher_class():
    """llguidance's LLMatcher, imported when a grammar is first made (the command lines import this module
    to check their arguments, and stay light)."""
    try:
        from llguidance import LLMatcher
    except ImportError as exc:
        raise InvalidRequestError(f"replies held to a grammar need llguidance, which is not installed here: pip "
                                  f"install 'llguidance>=1.0,<2' ({exc})") from None
    return LLMatcher


def unfollowable(name: str, error: str) -> str:
    """What to say of the grammar `name` that llguidance could not follow, saying `error`: past its limits on
    the work a grammar may take (not ones a caller sets), it is too large or too complex."""
    error = first_lines(error, 1)
    if "limits." in error or error.startswith("lexer error"):
        return f"{name} is too large or too complex for this server to follow (llguidance: {error})"
    return f"{name} cannot be followed: {error}"


def first_lines(message: str, lines: int = 3) -> str:
    """An llguidance message's first lines, on one line."""
    return " ".join(line.strip() for line in message.strip().splitlines()[:lines])


# An output format as the app and the command line name it, and what its text box holds.
FORMATS = {"text": "", "json": "", "json_schema": "a JSON Schema", "regex": "a regular expression",
           "lark": "a Lark grammar"}


def grammar_for(output_format: Any, spec: Any = "", name: str = "output_grammar") -> Optional[Grammar]:
    """The grammar of an output format named as in FORMATS: None for "text", any JSON object for "json", else
    `spec` read as a JSON Schema's text, a regular expression or a Lark grammar (refused naming `name`)."""
    if output_format not in FORMATS:
        raise InvalidRequestError(f"output_format must be one of {', '.join(FORMATS)}, got {output_format!r:.60}")
    if output_format == "text":
        return None
    if output_format == "json":
        return Grammar.json()
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequestError(f"output format {output_format!r} needs {FORMATS[output_format]} in {name}")
    if output_format == "regex":
        return Grammar.regex(spec, name)
    if output_format == "lark":
        return Grammar.lark(spec, name)
    return Grammar.json_text(spec, name)
