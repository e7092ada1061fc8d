"""The grammar a request holds its reply to: its response_format (OpenAI's JSON mode and structured outputs),
one of vLLM's guided_json, guided_regex, guided_choice and guided_grammar, or with tools a call to one of them
(tools.call_grammar); each refused naming the field where it cannot make one.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..errors import InvalidRequestError, LlamaError
from ..grammar import Grammar
from . import tools
from .errors import APIError
from .schemas import ResponseFormat, SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def grammar_fields(body: SamplingFields) -> list[str]:
    """The request's fields that hold its reply to a grammar: a response_format other than text, vLLM's."""
    asked = [name for name in GUIDED_FIELDS if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.type != "text":
        asked.insert(0, "response_format")
    return asked


def request_grammar(body: SamplingFields) -> Optional[Grammar]:
    """What the request asks the reply to match: its response_format, or one of vLLM's guided_json (a JSON
    Schema, or its text), guided_regex, guided_choice (one of these texts) and guided_grammar (Lark)."""
    asked = grammar_fields(body)
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} each hold the reply to a grammar: send one of them", param=asked[1])
    if not asked or asked[0] == "response_format":
        return _response_grammar(body.response_format)
    name, value = asked[0], getattr(body, asked[0])
    try:
        if name == "guided_json":
            return Grammar.json_text(value, name) if isinstance(value, str) else Grammar.json(value, name)
        if name == "guided_regex":
            return Grammar.regex(value, name=name)
        if name == "guided_grammar":
            return Grammar.lark(value, name=name)
        if not value or not all(value):
            raise APIError(400, "guided_choice must be a list of non-empty texts", param=name)
        choices = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
        return Grammar.lark(f"start: {choices}\n", name=name)
    except LlamaError as exc:
        raise APIError(400, str(exc), param=name) from None


def _response_grammar(response_format: Optional[ResponseFormat]) -> Optional[Grammar]:
    """What response_format asks the reply to match (see _format_schema), as a grammar."""
    schema = _format_schema(response_format)
    if schema is None:
        return None
    try:
        return Grammar.json(schema, name="response_format.json_schema.schema")
    except LlamaError as exc:
        raise APIError(400, str(exc), param="response_format.json_schema.schema") from None


def _format_schema(response_format: Optional[ResponseFormat]) -> Optional[dict[str, Any] | bool]:
    """The JSON Schema response_format asks the reply to follow: none for "text", any JSON object for
    "json_object", json_schema.schema for "json_schema" (OpenAI's structured outputs; `strict` or not, the
    schema is followed)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.type != "json_schema":
        raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                       f"{response_format.type!r}", param="response_format.type")
    if response_format.json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs a json_schema object (with its name and "
                       "schema)", param="response_format.json_schema")
    name = response_format.json_schema.name
    if not tools.NAME.fullmatch(name):
        raise APIError(400, f"response_format.json_schema.name must be 1 to 64 letters, digits, _ or -, got "
                       f"{name!r:.80}", param="response_format.json_schema.name")
    schema = response_format.json_schema.schema_
    return {} if schema is None else schema


def call_grammar(functions: list[tools.Function], required: bool,
                 response_format: Optional[ResponseFormat] = None) -> Any:
    """The grammar a reply that may call the functions is held to (a reply that calls none follows
    response_format, a checked one, as OpenAI holds it); a 400 naming `tools` where they cannot make one (too
    large a set of schemas, say)."""
    schema = _format_schema(response_format)
    try:
        return tools.call_grammar(functions, required, {} if schema is True else schema)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tools") from None


def with_tools(controls: dict[str, Any], functions: list[tools.Function], required: bool,
               response_format: Optional[ResponseFormat] = None) -> dict[str, Any]:
    """Sampling controls for a reply that may call the functions (where there are any): held to call_grammar's
    grammar; a call that must be made is ended by it, not by stop strings, which are for text replies."""
    if not functions:
        return controls
    return dict(controls, grammar=call_grammar(functions, required, response_format),
                **({"stop": ()} if required else {}))
