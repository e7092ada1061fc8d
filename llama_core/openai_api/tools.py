"""OpenAI's tool calling for Llama-2, whose chat format has no place for tools.

The tools are described at the end of the system prompt, with the one way to call them: a reply that is a JSON
object `{"name": ..., "arguments": {...}}` and nothing else. The reply is held to a grammar: with tool_choice
"required" (or a function named), a call to one of the tools, its arguments following that tool's parameters
schema; with "auto", such a call or a text that does not start with "{". A reply that is a call comes back as
`tool_calls` (finish_reason "tool_calls"). The conversation's earlier calls go back into the dialog as the
assistant's JSON, and the tools' results as a user turn that names each call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..errors import LlamaError
from ..grammar import JSON_OPTIONS, Grammar
from .errors import APIError
from .schemas import ChatMessage, NamedTool, Tool

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # a request's functions, as OpenAI bounds them


@dataclass(frozen=True)
class Function:
    """A tool a reply may call."""

    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema, as the caller gave it
    arguments: dict[str, Any]  # the same, closed (see closed): what a call's arguments are held to


def check_tools(tools: list[Tool]) -> list[Function]:
    """The request's tools, each checked (a function with a valid name, parameters a schema this server can
    follow); APIError naming the field otherwise. More than MAX_TOOLS are refused before any is read: each
    schema is compiled, and 10,000 small tools took 17 s of a CPU before the total's 400."""
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools holds {len(tools):,} tools; at most {MAX_TOOLS} are taken (as OpenAI's)",
                       param="tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools[{i}].type")
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name!r:.80}",
                           param=f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}].function.name")
        names.add(name)
        parameters = NO_PARAMETERS if tool.function.parameters is None else tool.function.parameters
        try:
            Grammar.json(parameters, name=f"tools[{i}].function.parameters")
        except LlamaError as exc:
            raise APIError(400, str(exc), param=f"tools[{i}].function.parameters") from None
        functions.append(Function(name, tool.function.description or "", parameters, closed(parameters)))
    return functions


def closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise closed to other properties
    ("additionalProperties": false, as OpenAI's strict mode has it): a call's arguments are the parameters the
    function takes, and a small model left free to add keys writes long ones."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in ("enum", "const", "default", "examples") else closed(value))
           for key, value in schema.items()}
    if "properties" in out or out.get("type") == "object":
        out.setdefault("additionalProperties", False)
    return out


def callable_now(functions: list[Function], tool_choice: Union[str, NamedTool, None]) -> tuple[list[Function], bool]:
    """(the tools the reply may call, whether it must call one) for tool_choice: "auto" (the default), "none",
    "required", or {"type": "function", "function": {"name": ...}}."""
    if tool_choice is None or tool_choice == "auto":
        return functions, False
    if tool_choice == "none":
        return [], False
    if tool_choice == "required":
        return functions, True
    if isinstance(tool_choice, NamedTool) and tool_choice.type == "function":
        name = tool_choice.function.get("name")
        for function in functions:
            if function.name == name:
                return [function], True
        raise APIError(400, f"tool_choice names the function {name!r:.80}, which is not among tools",
                       param="tool_choice.function.name")
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                   f"{{\"name\": ...}}}}, got {tool_choice!r:.80}", param="tool_choice")


def tools_prompt(functions: list[Function], required: bool) -> str:
    """What the system prompt says of the tools."""
    described = [{"name": f.name, **({"description": f.description} if f.description else {}),
                  "parameters": f.parameters} for f in functions]
    when = "Answer with a call of one" if required else "To call one, answer"
    return (f"Functions: {json.dumps(described, separators=(',', ':'))}\n{when} with only "
            '{"name": ..., "arguments": {...}}; its result comes in the next message.')


def call_grammar(functions: list[Function], required: bool, reply_schema: Optional[dict[str, Any]] = None) -> Grammar:
    """A reply that calls one of the functions (its arguments following its parameters), or with required
    False, that or a text that does not start with "{" (with reply_schema, the response format's JSON Schema:
    JSON following it)."""
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.arguments},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    if required:
        return Grammar.json(schema, name="tools")
    if reply_schema is not None:
        reply = {"x-guidance": JSON_OPTIONS, **reply_schema}
        return Grammar.lark(f"start: call | reply\ncall: %json {json.dumps(schema)}\nreply: %json {json.dumps(reply)}\n",
                            name="tools")
    return Grammar.lark(f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /\\s*[^{{\\s][\\s\\S]*/\n",
                        name="tools")


def is_call(text: str, functions: list[Function]) -> bool:
    """Whether a reply is a call, or was to be one (cut short, even before its function could be told): its
    text is then never the reply's content."""
    return _written_call(text, functions) is not None


def may_be_call(text: str) -> bool:
    """Whether a reply that begins so may still be a call: a streamed reply holds its text back until not."""
    return not text.strip() or text.lstrip().startswith("{")


@dataclass(frozen=True)
class Call:
    """A call a finished reply made. complete False: the reply was cut short in it (by the token limit, or a stop
    string with tool_choice "auto"), its arguments then the JSON text as far as it was written."""

    name: str
    arguments: str  # JSON text
    complete: bool = True


# A call's text as the grammar writes it (JSON_OPTIONS' separators), its name and arguments as far as written
CALL_START = '{"name": "'
PARTIAL_CALL = re.compile(r'\{"name": "(?P<name>[A-Za-z0-9_-]*)(?P<closed>")?(?:, "arguments": (?P<arguments>.*))?',
                          re.DOTALL)


def call_text(call: Call) -> str:
    """A call as the reply writes it (the grammar's layout), as far as it went where it was cut short."""
    return f'{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}' + ("}" if call.complete else "")


def _written_call(text: str, functions: list[Function]) -> Optional[tuple[list[str], str]]:
    """For a reply that is a call, whole or begun: (the functions it may call, by the name as far as it is
    written; its arguments as far as written); None for a reply that is text. A reply that starts with "{" is a
    call: the grammar lets no text start so."""
    text = text.lstrip()
    if not functions or not text.startswith("{"):
        return None
    if CALL_START.startswith(text):  # cut short before the name
        return [f.name for f in functions], ""
    written = PARTIAL_CALL.match(text)
    if written is None:
        return None
    named = [f.name for f in functions if (f.name == written["name"] if written["closed"] else
                                           f.name.startswith(written["name"]))]
    return (named, written["arguments"] or "") if named else None


def call_made(text: str, functions: list[Function], finish_reason: Optional[str]) -> Optional[Call]:
    """The call a finished reply makes, or None for a reply that is text. One cut short is an incomplete call,
    never text, where its function can be told (its name written far enough, or only one function to call)."""
    written = _written_call(text, functions)
    if written is None:
        return None
    try:
        call = json.loads(text)
    except ValueError:
        call = None
    if (isinstance(call, dict) and call.get("name") in written[0] and isinstance(call.get("arguments"), dict)
            and finish_reason in ("eos", "stop")):
        return Call(call["name"], json.dumps(call["arguments"]))
    named, arguments = written
    return Call(named[0], arguments, complete=False) if len(named) == 1 else None


def tool_call(call: Call) -> dict[str, Any]:
    """A call as the OpenAI API gives it: its arguments as JSON text, with an id for the result to name."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def history_turns(messages: list[ChatMessage]) -> list[tuple[int, str, Optional[str]]]:
    """The messages as (index, role, text) for the dialog: an assistant's tool calls as the JSON it would
    have written, tool results merged into one user turn naming each call; None text for a message whose
    content the caller's own checks read (every other message)."""
    turns: list[tuple[int, str, Optional[str]]] = []
    names: dict[str, str] = {}  # tool_call_id -> the function called, of the calls the tool messages answer
    answering = False  # the message before was an assistant's calls, or a result of them
    calling = 0  # the index of the assistant's message with those calls
    for i, message in enumerate(messages):
        if message.role == "tool" and not answering:
            raise APIError(400, f"messages[{i}] has role 'tool' but answers no call: a tool message follows an "
                           "assistant message with tool_calls", param=f"messages[{i}].role")
        if message.role == "tool" and message.tool_call_id not in names:
            given = "has no tool_call_id" if message.tool_call_id is None else \
                f"has tool_call_id {message.tool_call_id!r:.80}"
            raise APIError(400, f"messages[{i}] is a tool result that {given}: it must be the id of the call it "
                           f"answers, one of those in messages[{calling}]", param=f"messages[{i}].tool_call_id")
        answering = message.role == "tool" or (message.role == "assistant" and bool(message.tool_calls))
        if message.role == "assistant" and message.tool_calls:
            names, calling, calls = {}, i, []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                                   param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
                if call.id is not None:
                    names[call.id] = call.function.name
                calls.append(json.dumps({"name": call.function.name, "arguments": arguments}))
            turns.append((i, "assistant", "\n".join(calls)))
        elif message.role == "tool":
            name = names[message.tool_call_id]
            result = f"{name} returned: {_result_text(message.content, i)}"
            if turns and turns[-1][1] == "tool":
                result = f"{turns[-1][2]}\n{result}"
                turns.pop()
            turns.append((i, "tool", result))
        else:
            turns.append((i, message.role, None))
    return turns


def _result_text(content: Any, i: int) -> str:
    """A tool message's content: text, or text parts joined (as OpenAI takes them)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise APIError(400, f"messages[{i}] is a tool result: its content must be text", param=f"messages[{i}].content")
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}].content[{j}] is a {part.type!r} part: a tool result is text",
                           param=f"messages[{i}].content[{j}]")
    return "".join(part.text for part in content)
