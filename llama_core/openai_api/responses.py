"""OpenAI's Responses API (POST /v1/responses) on the same engine as the chat route.

Its input items become the chat route's messages (a message, an assistant's function call, a call's output),
`instructions` the system prompt, `text.format` the grammar of `response_format`, and function tools the chat
route's tools. The reply is a Response object, or its stream of events: response.created, the output item and
its text (or its function call's arguments) as they come, then response.completed (or response.incomplete, where
max_output_tokens ended it). The last STORED responses (and no more than STORED_MESSAGES messages in all) are kept
in memory (ResponseStore), so that a request can go on from one (`previous_response_id`) and GET /v1/responses/{id} can read it back; a restart forgets them.
"""

from __future__ import annotations

import collections
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from ..serving.requests import MAX_TOP_LOGPROBS, SamplingParams
from . import tools
from .errors import APIError, from_llama_error
from .replies import ChatReply
from .schemas import (ChatMessage, FunctionCall, InputItem, NamedTool, ResponsesRequest, TextPart, Tool, ToolCall,
                      TextFormat)
from .streaming import merged_batches

TEXT_PARTS = ("input_text", "output_text", "text")
STORED = 256  # responses a server keeps, the oldest forgotten first
# ... and the messages their conversations hold in all, each a copy (~0.5 KB bare): 8 MiB of empty input messages
# kept ~150 MB a response, 256 of them more memory than a machine has. The newest response is always kept.
STORED_MESSAGES = 100_000


@dataclass
class Stored:
    """A response kept: the conversation it ended (its input after its previous response's, then its output),
    and the Response object."""

    messages: list[ChatMessage]
    response: dict[str, Any]


class ResponseStore:
    """The last `size` stored responses, in memory, by id, with at most `messages` messages in all (the newest
    response kept whatever it holds); the server's event loop is its only user."""

    def __init__(self, size: int = STORED, messages: int = STORED_MESSAGES) -> None:
        self.size, self.messages = size, messages
        self._kept: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._held = 0  # the messages of the responses kept

    def get(self, response_id: str, param: str = "previous_response_id") -> Stored:
        found = self._kept.get(response_id)
        if found is None:
            raise APIError(404, f"no response {response_id!r:.80} here: this server keeps its last {self.size} "
                           f"stored responses ({self.messages:,} messages in all), in memory, until it restarts", param=param, code="not_found")
        return found

    def put(self, response_id: str, stored: Stored) -> None:
        self._kept[response_id] = stored
        self._held += len(stored.messages)
        while len(self._kept) > 1 and (len(self._kept) > self.size or self._held > self.messages):
            self._held -= len(self._kept.popitem(last=False)[1].messages)

    def delete(self, response_id: str) -> None:
        self._held -= len(self.get(response_id, param="response_id").messages)
        del self._kept[response_id]


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 for what this server's Responses API does not do, rather than a reply that silently leaves it out."""
    if body.background:
        raise APIError(400, "background responses are not run here: send the request without background, and "
                       "stream it to see the reply as it is written", param="background")
    if body.conversation is not None:
        raise APIError(400, "conversations are not kept here: carry one on with previous_response_id",
                       param="conversation")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {body.top_logprobs}",
                       param="top_logprobs")
    for i, included in enumerate(body.include or ()):
        if included != LOGPROBS:
            raise APIError(400, f"include[{i}] must be {LOGPROBS!r}, the one thing this server adds, got "
                           f"{included!r:.80}", param=f"include[{i}]")


def with_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output text comes with its tokens' log-probabilities (and top_logprobs' alternatives)."""
    return LOGPROBS in (body.include or ())


def chat_messages(body: ResponsesRequest, earlier: list[ChatMessage]) -> tuple[list[ChatMessage], list[Optional[int]]]:
    """The conversation as chat messages: `earlier` (its previous response's), then the input; and for each
    message the input item it came from (None: the previous response's; an assistant's function calls in a
    row make one message)."""
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    messages = [message.model_copy(deep=True) for message in earlier]  # the stored ones stay as they were
    origin: list[Optional[int]] = [None] * len(earlier)
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise APIError(400, f"input[{i}] is a message without a role", param=f"input[{i}].role")
            messages.append(ChatMessage(role=item.role, content=_content(item.content)))
            origin.append(i)
        elif kind == "function_call":
            if item.name is None or item.arguments is None:
                raise APIError(400, f"input[{i}] is a function_call: it needs name and arguments", param=f"input[{i}]")
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
                origin.append(i)
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content="" if item.output is None else _content(item.output)))
            origin.append(i)
        else:
            raise APIError(400, f"input[{i}] is a {kind!r} item; this server reads message, function_call and "
                           "function_call_output items", param=f"input[{i}].type")
    return messages, origin


def _content(content: Any) -> Any:
    """A message's content with the Responses API's text parts as the chat route's."""
    if not isinstance(content, list):
        return content
    return [TextPart(type="text", text=part.text) if part.type in TEXT_PARTS else part for part in content]


def response_format(text: Optional[TextFormat]) -> Optional[dict[str, Any]]:
    """text.format as the chat route's response_format."""
    if text is None or text.type == "text":
        return None
    if text.type == "json_object":
        return {"type": "json_object"}
    if text.type != "json_schema":
        raise APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {text.type!r}",
                       param="text.format.type")
    return {"type": "json_schema", "json_schema": {"name": text.name or "reply", "schema": text.schema_}}


def chat_tools(body: ResponsesRequest) -> tuple[Optional[list[Tool]], Any]:
    """The function tools and tool_choice in the chat route's shapes."""
    converted = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function" or tool.name is None:
            raise APIError(400, f"tools[{i}] must be a function tool with a name (type 'function'); this server "
                           f"has no built-in tools, got type {tool.type!r}", param=f"tools[{i}]")
        converted.append(Tool(type="function", function={"name": tool.name, "description": tool.description,
                                                         "parameters": tool.parameters}))
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                           "\"name\": ...}", param="tool_choice")
        choice = NamedTool(type="function", function={"name": choice["name"]})
    return (converted or None), choice


LOGPROBS = "message.output_text.logprobs"  # what include may ask for
FIELDS = {"max_tokens": "max_output_tokens", "response_format.json_schema.schema": "text.format.schema",
          "response_format.json_schema.name": "text.format.name",
          "response_format.type": "text.format.type", "response_format": "text.format", "messages": "input"}


def renamed(error: APIError, origin: list[Optional[int]]) -> APIError:
    """A chat route's error named as the Responses API names the field (messages[j] is the input item it came
    from, or previous_response_id; tools[i].function.name is tools[i].name)."""
    def item(match: re.Match) -> str:
        j = int(match[1])
        if j < len(origin) and origin[j] is None:
            return "previous_response_id"
        return f"input[{origin[j] if j < len(origin) else j}]"

    def rename(text: str) -> str:
        text = re.sub(r"the messages take (.*) shorten them", r"the input takes \1 shorten it", text)
        text = re.sub(r"messages\[(\d+)\]", item, text)
        text = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", text)
        text = re.sub(r"\btool_call_id\b", "call_id", text)
        for old, new in FIELDS.items():
            text = re.sub(rf"(?<![\w.\[]){re.escape(old)}(?![\w\[])", new, text)
        return text

    error.message = rename(error.message)
    if error.param:
        error.param = rename(error.param)
    return error


class ResponseWriter:
    """One response's stream as a Response object, or as the Responses API's events."""

    def __init__(self, stream: Any, model_id: str, body: ResponsesRequest, functions: list[tools.Function],
                 messages: list[ChatMessage], store: Optional[ResponseStore],
                 scores: Optional[ChatReply] = None) -> None:
        """messages: the conversation the response answers; store: where it is kept once done (None: not);
        scores: the stream as a chat reply with logprobs, whose entries the output text comes with (None: none)."""
        self.stream, self.model_id, self.body, self.functions = stream, model_id, body, functions
        self.messages, self.store, self.scores = messages, store, scores
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
            "type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model_id, "output": output, "error": None, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            # the values the reply was sampled with (Llama-2's defaults where absent), as OpenAI reports them
            "temperature": SamplingParams.temperature if body.temperature is None else body.temperature,
            "top_p": SamplingParams.top_p if body.top_p is None else body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,  # taken; a reply calls at most one
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else (body.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "store": self.store is not None,
            "previous_response_id": body.previous_response_id, "text": {"format": fmt},
            "metadata": body.metadata or {},
            "usage": self.usage() if status != "in_progress" else None,
        }

    def usage(self) -> dict[str, Any]:
        s = self.stream
        return {"input_tokens": s.prompt_tokens, "output_tokens": s.generated_tokens,
                "total_tokens": s.prompt_tokens + s.generated_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def status(self) -> str:
        return "incomplete" if self.stream.finish_reason == "length" else "completed"

    def call(self, text: str) -> Optional[tools.Call]:
        return tools.call_made(text, self.functions, self.stream.finish_reason)

    def items(self, text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
        call = self.call(text)
        if call is not None:  # "incomplete" where max_output_tokens (or a stop string) cut it short
            return [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": tools.tool_call(call)["id"],
                     "name": call.name, "arguments": call.arguments,
                     "status": "completed" if call.complete else "incomplete"}]
        if tools.is_call(text, self.functions):  # cut short before its function could be told
            text, logprobs = "", []
        return [self.message(text, self.status(), logprobs)]  # "incomplete" where max_output_tokens cut it

    def message(self, text: Optional[str], status: str,
                logprobs: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                            "logprobs": logprobs or []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    async def whole(self, request: Request) -> dict[str, Any]:
        text, chunks = "", []
        async for batch in merged_batches([self.stream], request):
            if batch.error is not None:
                raise from_llama_error(batch.error, ())
            text += "".join(c.text for c in batch.chunks)
            chunks += batch.chunks
        scored = self.scores.token_logprobs(0, self.scores.written(0, chunks)) if self.scores else None
        return self.kept(self.response(self.status(), self.items(text, scored)))

    def kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """The finished response, stored with its conversation where it is to be."""
        if self.store is not None:
            said = []
            for item in response["output"]:
                if item["type"] == "function_call" and item["status"] == "incomplete":  # as the reply wrote it
                    said.append(ChatMessage(role="assistant", content=tools.call_text(
                        tools.Call(item["name"], item["arguments"], complete=False))))
                elif item["type"] == "function_call":
                    said.append(ChatMessage(role="assistant", tool_calls=[ToolCall(id=item["call_id"], function=(
                        FunctionCall(name=item["name"], arguments=item["arguments"])))]))
                else:
                    said.append(ChatMessage(role="assistant", content="".join(c["text"] for c in item["content"])))
            self.store.put(self.id, Stored(self.messages + said, response))
        return response

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        held: Optional[str] = "" if self.functions else None  # with tools: text not yet known to be no call
        text, started = "", False
        scored: list[dict[str, Any]] = []  # the text's tokens' logprobs entries, with logprobs
        sent = 0  # the entries sent with the text's deltas
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        async for batch in merged_batches([self.stream], request):
            if batch.error is not None:  # OpenAI's error event, then the response failed (the SDK reads the latter)
                error = from_llama_error(batch.error, ()).body()["error"]
                yield self.event("error", code=error["code"], message=error["message"], param=error["param"])
                failed = dict(self.response("failed", []), error={"code": "server_error", "message": error["message"]})
                yield self.event("response.failed", response=failed)
                return
            piece = "".join(c.text for c in batch.chunks)
            if self.scores is not None:  # less the tokens that may have written only a stop string
                scored += self.scores.token_logprobs(0, self.scores.to_send(batch))
            if held is not None:
                held += piece
                if not batch.done and tools.may_be_call(held):
                    continue
                piece, held = held, None
                if batch.done and self.call(piece) is not None:
                    async for event in self._call_events(piece):
                        yield event
                    return
                if batch.done and tools.is_call(piece, self.functions):  # cut short before its function was told
                    piece = ""
            if (piece or batch.done) and not started:
                started = True
                yield self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress"))
                yield self.event("response.content_part.added", **where,
                                 part={"type": "output_text", "text": "", "annotations": []})
            if piece:
                text += piece
                yield self.event("response.output_text.delta", **where, delta=piece, logprobs=scored[sent:])
                sent = len(scored)
        status = self.status()
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": scored}
        yield self.event("response.output_text.done", **where, text=text, logprobs=scored)
        yield self.event("response.content_part.done", **where, part=part)
        item = self.message(text, status, scored)
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event(f"response.{status}", response=self.kept(self.response(status, [item])))

    async def _call_events(self, text: str) -> AsyncIterator[dict[str, Any]]:
        (item,) = self.items(text)
        added = {**item, "arguments": "", "status": "in_progress"}
        yield self.event("response.output_item.added", output_index=0, item=added)
        yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=0,
                         delta=item["arguments"])
        yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=0,
                         name=item["name"], arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=0, item=item)
        status = self.status()
        yield self.event(f"response.{status}", response=self.kept(self.response(status, [item])))
