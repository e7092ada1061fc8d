"""The HTTP shape of the OpenAI API's requests, as pydantic models.

These models judge only the shape: which fields exist and their JSON types. The values of the sampling
fields are judged by `SamplingParams` (llama_core.serving.requests), the validator every other route uses;
fields the OpenAI API has and this server cannot honour are refused by the routes with a message naming them.
Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic_core import PydanticCustomError


def _json_number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    return value


Number = Annotated[Any, AfterValidator(_json_number)]  # "0.7" as a string is refused, as OpenAI does; the range
# and finiteness are SamplingParams' to judge


# Bounds on how many items a list (or a map) may hold, checked before its items are, and a list's items checked
# up to the first wrong one: a request of 8 MiB holding 2.7 million wrong items in one list took pydantic 10 s of
# the event loop to list its 2.7 million errors, and 4 million in 400 lists within their bounds 58 s. Each bound
# is far past what a request can use (a conversation of 10,000 messages is past any model's context).
MAX_MESSAGES = 10_000  # as a chat on the page (app.branches.MAX_MESSAGES)
MAX_PARTS = 10_000  # text parts of one message
MAX_CALLS = 128  # tools a request offers, calls a message makes (OpenAI's bound on tools)
MAX_ITEMS = 1_048_576  # a prompt's token ids (or its prompts), tokens to detokenize, a map's entries
MAX_FEW = 1_024  # stop strings, choices, and the like (their own checks bound them lower)


def Bounded(item: Any, most: int) -> Any:
    """A JSON list of `item`s, of at most `most` (counted first); a wrong item ends its check (the first is the one
    reported)."""
    def at_most(value: Any) -> Any:
        if isinstance(value, list) and len(value) > most:  # else pydantic, told to stop at a wrong item, stops there
            raise PydanticCustomError("too_long", "List should have at most {max_length} items, not {actual_length}",
                                      {"field_type": "List", "max_length": most, "actual_length": len(value)})
        return value

    return Annotated[list[item], Field(max_length=most, fail_fast=True), BeforeValidator(at_most)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: StrictStr  # "text"; any other part (an image, audio) is refused by the route, naming it
    text: Optional[StrictStr] = None


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text


class ToolCall(_Request):
    id: Optional[StrictStr] = None
    type: Optional[StrictStr] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: StrictStr  # system, developer (OpenAI's newer name for system), user, assistant or tool
    content: Union[StrictStr, Bounded(TextPart, MAX_PARTS), None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[Bounded(ToolCall, MAX_CALLS)] = None  # an assistant's calls
    tool_call_id: Optional[StrictStr] = None  # a tool message: the call it answers


class Function(_Request):
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Request):
    type: StrictStr  # "function"
    function: Function


class NamedTool(_Request):
    type: StrictStr  # "function"
    function: dict[str, Any]  # {"name": ...}


class StreamOptions(_Request):
    include_usage: Optional[StrictBool] = None


class JsonSchema(_Request):
    name: StrictStr
    description: Optional[StrictStr] = None
    schema_: Optional[Union[dict[str, Any], StrictBool]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Request):
    type: StrictStr  # "text", "json_object" or "json_schema"
    json_schema: Optional[JsonSchema] = None


class SamplingControls(_Request):
    """The fields every generating route takes (chat, completions, responses)."""

    model: Optional[StrictStr] = None  # the served model's id; another id is answered 404
    stream: Optional[StrictBool] = False
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    stop: Union[StrictStr, Bounded(StrictStr, MAX_FEW), None] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    user: Optional[StrictStr] = None
    # Beyond OpenAI's fields, as vLLM and llama.cpp's server take them:
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None


class SamplingFields(SamplingControls):
    """The fields the chat and completion routes share."""

    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = 1
    response_format: Optional[ResponseFormat] = None  # on completions too, as vLLM takes it
    logit_bias: Optional[Annotated[dict[str, Any], Field(max_length=MAX_ITEMS)]] = None
    # Beyond OpenAI's, as vLLM takes them:
    guided_json: Union[dict[str, Any], StrictStr, None] = None  # a grammar for the reply: one of these four,
    guided_regex: Optional[StrictStr] = None  # or response_format
    guided_choice: Optional[Bounded(StrictStr, MAX_FEW)] = None
    guided_grammar: Optional[StrictStr] = None  # Lark
    ignore_eos: Optional[StrictBool] = None  # vLLM's: the reply runs to max_tokens (for benchmarks)


class Prediction(_Request):
    type: StrictStr  # "content"
    content: Union[StrictStr, Bounded(TextPart, MAX_PARTS)]


class ChatCompletionRequest(SamplingFields):
    messages: Bounded(ChatMessage, MAX_MESSAGES)
    prediction: Optional[Prediction] = None  # predicted outputs: drafts for prompt lookup
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[Bounded(Tool, MAX_CALLS)] = None
    tool_choice: Union[StrictStr, NamedTool, None] = None  # "none", "auto", "required", or a function by name
    parallel_tool_calls: Optional[StrictBool] = None
    functions: Optional[Bounded(Any, MAX_CALLS)] = None
    modalities: Optional[Bounded(StrictStr, MAX_FEW)] = None  # ["text"] only: no audio is written
    audio: Optional[dict[str, Any]] = None  # refused: no audio is written


class CompletionRequest(SamplingFields):
    # a string, a list of strings, token ids, or lists of token ids (the route reads which)
    prompt: Union[StrictStr, Bounded(Any, MAX_ITEMS)]
    max_tokens: Optional[StrictInt] = 16  # OpenAI's default for completions
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None  # how many alternatives per token; 0 gives the tokens' own only
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None




# -- the Responses API ----------------------------------------------------------------------------------
class InputItem(_Request):
    type: Optional[StrictStr] = None  # "message" (or absent); "function_call", "function_call_output"
    role: Optional[StrictStr] = None  # user, system, developer or assistant
    content: Union[StrictStr, Bounded(TextPart, MAX_PARTS), None] = None  # text parts: input_text, output_text
    call_id: Optional[StrictStr] = None  # a function call, or its output
    name: Optional[StrictStr] = None
    arguments: Optional[StrictStr] = None
    output: Union[StrictStr, Bounded(TextPart, MAX_PARTS), None] = None  # a function call's output: text, or text parts


class TextFormat(_Request):
    type: StrictStr  # "text", "json_object" or "json_schema"
    name: Optional[StrictStr] = None
    schema_: Optional[Union[dict[str, Any], StrictBool]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None
    description: Optional[StrictStr] = None


class TextOptions(_Request):
    format: Optional[TextFormat] = None


class ResponseTool(_Request):
    type: StrictStr  # "function"
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ResponsesRequest(SamplingControls):
    """POST /v1/responses: OpenAI's Responses API (stored responses kept in memory: responses.ResponseStore)."""

    input: Union[StrictStr, Bounded(InputItem, MAX_MESSAGES)]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = None
    text: Optional[TextOptions] = None
    tools: Optional[Bounded(ResponseTool, MAX_CALLS)] = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    store: Optional[StrictBool] = None  # false: not kept for previous_response_id and GET
    previous_response_id: Optional[StrictStr] = None
    metadata: Optional[dict[str, Any]] = None
    include: Optional[Bounded(StrictStr, MAX_FEW)] = None  # ["message.output_text.logprobs"] only (responses.LOGPROBS)
    top_logprobs: Optional[StrictInt] = None  # with that include: each token's most likely alternatives
    # Refused where set: not done here (responses.refuse_unsupported)
    background: Optional[StrictBool] = None
    conversation: Optional[Any] = None


# -- tokens, as vLLM's server counts them ------------------------------------------------------------------
class TokenizeRequest(_Request):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None  # a completion's prompt
    messages: Optional[Bounded(ChatMessage, MAX_MESSAGES)] = None  # or a chat's, laid out as the chat route does
    tools: Optional[Bounded(Tool, MAX_CALLS)] = None  # with messages: in the system prompt, as the chat route does
    tool_choice: Union[StrictStr, NamedTool, None] = None
    add_special_tokens: Optional[StrictBool] = True  # the prompt's BOS


class DetokenizeRequest(_Request):
    model: Optional[StrictStr] = None
    tokens: Bounded(StrictInt, MAX_ITEMS)
