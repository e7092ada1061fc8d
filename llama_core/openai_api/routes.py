"""The OpenAI-compatible HTTP API on a running engine: /v1/models, /v1/chat/completions, /v1/completions and
/health, as a FastAPI app that the web app mounts its Gradio interface into (one host and port for both).

Requests are read by the models of .schemas, their values judged by llama_core.serving.requests (the
validator of every route), and run by the same engine as the web page's. Replies follow the OpenAI API,
streamed as Server-Sent Events with `stream`; see README.md for what differs.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import Depends, FastAPI, Request
from starlette.requests import ClientDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..dialog import UNSAFE_ERROR, Dialog, encode_dialog, ends_in_reply
from ..errors import ContextLengthError, EngineUnavailableError, InvalidRequestError, LlamaError
from ..grammar import Grammar
from ..serving import aio, requests
from ..serving.events import StreamChunk
from ..serving.requests import MAX_SEED, SamplingParams
from ..serving.streams import TextEngine, TextStream, stream_chat, stream_completion, vocabulary
from ..tokenizer import StreamDecoder
from . import responses, tools
from .cors import LocalOrigins
from .errors import APIError, from_llama_error, from_validation_errors
from .schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, Prediction,
                      ResponseFormat, ResponsesRequest, SamplingFields, TextPart, TokenizeRequest)
from .streaming import Batch, merged_batches

MAX_CHOICES = 16  # most choices (n x prompts) in one request
ENDED_STATE_SECONDS = 2.0  # /health's wait for a model process that just ended to be restarting (or failed)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "seed", "logit_bias")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}

log = logging.getLogger(__name__)


def create_api(engine: TextEngine, model_name: Optional[str] = None, api_keys: Sequence[str] = ()) -> FastAPI:
    """The API serving `engine` as the model `model_name` (default: the checkpoint folder's name). With
    api_keys, every /v1 route needs `Authorization: Bearer <one of them>`; /health never does."""
    model_id = model_name or engine.info.name
    created = int(time.time())
    api = FastAPI(title="llama_core OpenAI-compatible API", docs_url="/v1/docs", openapi_url="/v1/openapi.json",
                  redoc_url=None)
    api.add_middleware(LocalOrigins)
    keys = [key.encode() for key in api_keys]

    async def authorized(request: Request) -> None:  # async: no worker thread for a header check
        """Refuses a request without a valid key (where keys are set); names its client for the engine."""
        if not keys:
            request.state.client = f"address:{request.client.host if request.client else 'unknown'}"
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "no API key given: send it as the header 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key")
        held = next((i for i, key in enumerate(keys) if hmac.compare_digest(given.strip().encode(), key)), None)
        if held is None:
            raise APIError(401, "the API key given is not valid for this server", code="invalid_api_key")
        request.state.client = f"key:{held}"  # the key by its place in the list: no secret in the engine

    def served_model(requested: Optional[str]) -> None:
        if requested is not None and requested != model_id:
            raise APIError(404, f"the model {requested!r} does not exist here; this server serves {model_id!r}",
                           param="model", code="model_not_found")

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "llama_core",
                "context_length": engine.info.max_seq_len, "max_model_len": engine.info.max_seq_len}

    _install_error_handlers(api)
    v1 = [Depends(authorized)]
    kept = responses.ResponseStore()  # the Responses API's stored responses

    @api.get("/health", include_in_schema=False)
    def health() -> JSONResponse:
        """200 while the engine takes requests, with its counters (Engine.stats: requests running and waiting,
        prompt tokens computed and found in the prefix cache); else 503 with its state ("restarting" after its process died,
        "failed" when it could not be restarted, "stopping", "stopped", or "unresponsive": its process is alive
        but does not answer, stuck)."""
        if engine.alive:
            try:
                stats = engine.stats()  # a model process is asked (None: it does not answer); in-process, read here
            except EngineUnavailableError:
                pass  # its process ended a moment ago: its state below says what comes next
            else:
                if stats is None:
                    return JSONResponse({"status": "unresponsive", "model": model_id}, status_code=503,
                                        headers={"Retry-After": "5"})
                return JSONResponse({"status": "ok", "model": model_id, **stats})
        state = getattr(engine, "state", "stopped")
        waited = time.monotonic() + ENDED_STATE_SECONDS
        while state == "running" and time.monotonic() < waited:  # ended a moment ago: not yet restarting
            time.sleep(0.05)
            state = getattr(engine, "state", "stopped")
        return JSONResponse({"status": "restarting" if state == "running" else state, "model": model_id},
                            status_code=503, headers={"Retry-After": "5"})

    @api.get("/v1/models", dependencies=v1)
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model:path}", dependencies=v1)
    def get_model(model: str) -> dict[str, Any]:
        served_model(model)
        return model_card()

    @api.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        served_model(body.model)
        _refuse_unsupported_chat(body)
        size = await _size(request)
        functions, required = await aio.submitted(lambda: _tools(body), size)  # long schemas: off the loop
        dialog = _dialog(body.messages, tools.tools_prompt(functions, required) if functions else "")
        prediction = _prediction(body.prediction)
        fields = set(body.model_fields_set) | {"messages"}
        rename = {"max_new_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

        def reply_controls() -> dict[str, Any]:
            controls = _controls(body, engine.tokenizer.eos_id, logprobs=bool(body.logprobs),
                                 top_logprobs=body.top_logprobs or 0)
            if functions:
                controls["grammar"] = _call_grammar(functions, required, body.response_format)
            return controls

        controls = await aio.submitted(reply_controls, size)
        _check_reply_start(dialog, controls)
        max_new_tokens = _max_new_tokens(max_tokens, engine, "max_completion_tokens" if rename else "max_tokens")
        refusal = [False]

        def submit(seed: Optional[int]) -> TextStream:
            stream = stream_chat(engine, dialog, max_new_tokens=max_new_tokens, drop_old_turns=False,
                                 prediction=prediction, client=request.state.client, **dict(controls, seed=seed))
            if stream.refusal is not None:
                refusal[0] = True
            return stream

        choices = _choices(body.n, capacity=engine.client_capacity)
        streams = await _submit_all(submit, _seeds(controls["seed"], choices), fields, rename, size, controls)
        if refusal[0]:
            raise APIError(400, UNSAFE_ERROR, param="messages", code="invalid_prompt")
        reply = _ChatReply(engine, model_id, streams, len(streams), _include_usage(body), bool(body.logprobs),
                           functions)
        if body.stream:
            return _event_stream(reply.events(request))
        return await reply.whole(request)

    @api.post("/v1/responses", dependencies=v1)
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        served_model(body.model)
        earlier = kept.get(body.previous_response_id).messages if body.previous_response_id is not None else []
        messages, origin = responses.chat_messages(body, earlier)
        size = await _size(request)
        try:
            chat_tools, tool_choice = responses.chat_tools(body)
            chat = ChatCompletionRequest(
                messages=messages, max_tokens=body.max_output_tokens, response_format=responses.response_format(
                    body.text.format if body.text else None), tools=chat_tools, tool_choice=tool_choice,
                **{name: getattr(body, name) for name in SAMPLING_FIELDS if name != "logit_bias"})
            _refuse_unsupported_chat(chat)
            functions, required = await aio.submitted(lambda: _tools(chat), size)
            note = "\n\n".join(part for part in (body.instructions or "", tools.tools_prompt(functions, required)
                                                  if functions else "") if part)
            dialog = _dialog(chat.messages, note)
            def reply_controls() -> dict[str, Any]:
                controls = _controls(chat, logprobs=False)
                if functions:
                    controls["grammar"] = _call_grammar(functions, required, chat.response_format)
                return controls

            controls = await aio.submitted(reply_controls, size)
            _check_reply_start(dialog, controls)
            max_new_tokens = _max_new_tokens(chat.max_tokens, engine, "max_tokens")

            def submit(_: None) -> TextStream:
                stream = stream_chat(engine, dialog, max_new_tokens=max_new_tokens, drop_old_turns=False,
                                     client=request.state.client, **controls)
                if stream.refusal is not None:
                    raise APIError(400, UNSAFE_ERROR, param="messages", code="invalid_prompt")
                return stream

            (stream,) = await _submit_all(submit, [None], set(chat.model_fields_set) | {"messages"}, {}, size,
                                          controls)
        except APIError as exc:
            raise responses.renamed(exc, origin) from None
        writer = responses.ResponseWriter(stream, model_id, body, functions, messages,
                                          None if body.store is False else kept)
        if body.stream:
            return _event_stream(writer.events(request), done=False)
        return await writer.whole(request)

    @api.get("/v1/responses/{response_id}", dependencies=v1)
    async def get_response(response_id: str) -> dict[str, Any]:  # async: on the loop, the store's one user
        return kept.get(response_id, param="response_id").response

    @api.delete("/v1/responses/{response_id}", dependencies=v1)
    async def delete_response(response_id: str) -> dict[str, Any]:
        kept.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        served_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported: Llama-2 models have no fill-in-the-middle training",
                           param="suffix")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; use n for several completions", param="best_of")
        prompts = _prompts(body.prompt, vocabulary(engine))
        n = _choices(body.n, len(prompts), engine.client_capacity)
        top = body.logprobs
        if top is not None and not 0 <= top <= requests.MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer from 0 to {requests.MAX_TOP_LOGPROBS}, got {top}",
                           param="logprobs")
        size = await _size(request)
        controls = await aio.submitted(lambda: _controls(body, engine.tokenizer.eos_id, logprobs=top is not None,
                                                         top_logprobs=top or 0), size)
        scoring = bool(body.echo) and body.max_tokens == 0  # the prompt alone, with its logprobs: one step, unsent
        max_new_tokens = 1 if scoring else _max_new_tokens(body.max_tokens, engine, "max_tokens")
        echo_logprobs = bool(body.echo) and top is not None
        jobs = [(prompt, seed) for prompt in prompts for seed in _seeds(controls["seed"], n)]

        def submit(job: tuple[str | list[int], Optional[int]]) -> TextStream:
            prompt = job[0]
            if isinstance(prompt, str) and not prompt.strip():  # as OpenAI takes it: the model writes after BOS
                prompt = engine.tokenizer.encode(prompt, bos=True, eos=False)
            return stream_completion(engine, prompt, max_new_tokens=max_new_tokens, prompt_logprobs=echo_logprobs,
                                     client=request.state.client, **dict(controls, seed=job[1]))

        streams = await _submit_all(submit, jobs, set(body.model_fields_set) | {"prompt"}, {}, size, controls)
        echoed = [job[0] for job in jobs] if body.echo else None
        reply = _CompletionReply(engine, model_id, streams, n, _include_usage(body), top, echoed, scoring)
        if body.stream:
            return _event_stream(reply.events(request))
        return await reply.whole(request)

    @api.post("/tokenize", dependencies=v1)
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """A prompt's tokens (a completion's, or a chat's messages as the chat route lays them out), to count
        them against the context before sending them."""
        served_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send a prompt or messages (one of them) to tokenize", param="prompt")
        if body.prompt is not None and body.tools:
            raise APIError(400, "tools go with messages, as on the chat route", param="tools")
        size = await _size(request)
        functions, required = await aio.submitted(lambda: _tools(body), size)
        tokenizer = engine.tokenizer

        def tokens() -> list[int]:
            if body.prompt is not None:
                return tokenizer.encode(_text(body.prompt, "prompt"), bos=body.add_special_tokens is not False,
                                        eos=False)
            try:
                return encode_dialog(tokenizer, _dialog(body.messages, tools.tools_prompt(functions, required)
                                                        if functions else ""))
            except LlamaError as exc:
                raise from_llama_error(exc, {"messages"}) from None

        ids = await aio.submitted(tokens, size)
        return {"count": len(ids), "max_model_len": engine.info.max_seq_len, "tokens": ids}

    @api.post("/detokenize", dependencies=v1)
    def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """The text of token ids."""
        served_model(body.model)
        known = vocabulary(engine)
        outside = [token for token in body.tokens if not 0 <= token < known]
        if outside:
            raise APIError(400, f"tokens holds {outside[0]}, outside the vocabulary [0, {known})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @api.get("/tokenizer_info", dependencies=v1)
    def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's special tokens and the context, as vLLM's server has them (lm-evaluation-harness
        looks for this route, then tokenizes through /tokenize and sends token-id prompts)."""
        tokenizer = engine.tokenizer
        return {"tokenizer_class": "LlamaTokenizer", "bos_token": tokenizer.sp_model.id_to_piece(tokenizer.bos_id),
                "eos_token": tokenizer.sp_model.id_to_piece(tokenizer.eos_id), "pad_token": None,
                "model_max_length": engine.info.max_seq_len, "vocab_size": vocabulary(engine)}

    @api.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False,
                   dependencies=v1)
    def unknown_route(path: str, request: Request) -> None:
        raise APIError(404, f"no route {request.method} /v1/{path}; this server has GET /v1/models, "
                       "POST /v1/chat/completions, POST /v1/completions and POST /v1/responses", code="unknown_url")

    return api


# -- reading a request -------------------------------------------------------------------------------------
def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    if body.functions:
        raise APIError(400, "functions is OpenAI's older form of tools: send tools instead", param="functions")
    held = [name for name in _grammar_fields(body) if name != "response_format"]  # a format goes with tools
    if body.tools and held and body.tool_choice != "none":
        raise APIError(400, f"{held[0]} and tools cannot hold one reply together: send one of them (response_format "
                       "may go with tools)", param=held[0])


def _tools(body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[tools.Function], bool]:
    """The tools the reply may call, and whether it must call one."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
        return [], False
    return tools.callable_now(tools.check_tools(body.tools), body.tool_choice)


def _prediction(prediction: Optional[Prediction]) -> Optional[str]:
    """The predicted reply's text (OpenAI's predicted outputs), or None."""
    if prediction is None:
        return None
    if prediction.type != "content":
        raise APIError(400, f"prediction.type must be 'content', got {prediction.type!r}", param="prediction.type")
    return _text(prediction.content, "prediction.content")


def _dialog(messages: list[ChatMessage], tools_note: str = "") -> Dialog:
    """OpenAI's messages as a Llama-2 dialog ("developer" is OpenAI's newer name for "system"; an assistant's
    tool calls and the tools' results as tools.history_turns writes them), tools_note at the end of the system
    prompt. OpenAI takes any order of roles, Llama-2's layout one: messages of one role in a row are one turn
    (a blank line between), a system message after the conversation's start is read in its place as the
    user's words, a dialog of system messages alone gets an empty user turn, and one that ends with the
    assistant's is the start of the reply, which the model continues."""
    if not messages:
        raise APIError(400, "messages is empty: send at least one user message", param="messages")
    dialog: Dialog = []
    for i, role, written in tools.history_turns(messages):
        message = messages[i]
        role = {"developer": "system", "tool": "user"}.get(role, role)
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}] has role {message.role!r}; this server takes system, developer, "
                           "user, assistant and tool messages", param=f"messages[{i}].role")
        if written is None and message.content is None:
            raise APIError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
        content = "" if message.content is None or message.role == "tool" else _text(message.content,
                                                                                   f"messages[{i}].content")
        if written is not None:
            content = f"{content}\n{written}" if content else _text(written, f"messages[{i}]")
        if role == "system" and dialog and dialog[-1]["role"] != "system":
            role = "user"
        if role == "assistant" and (not dialog or dialog[-1]["role"] == "system"):
            dialog.append({"role": "user", "content": ""})  # the assistant spoke first (a greeting)
        if dialog and dialog[-1]["role"] == role:
            content = f"{dialog.pop()['content']}\n\n{content}"
        dialog.append({"role": role, "content": content})
    if tools_note:
        if dialog[0]["role"] == "system":
            dialog[0] = {"role": "system", "content": f"{dialog[0]['content']}\n\n{tools_note}".strip()}
        else:
            dialog.insert(0, {"role": "system", "content": tools_note})
    if len(dialog) == 1 and dialog[0]["role"] == "system":
        dialog.append({"role": "user", "content": ""})
    return dialog


def _check_reply_start(dialog: Dialog, controls: dict[str, Any]) -> None:
    """A 400 where the messages end with the assistant's (a reply for the model to continue) and a grammar
    (response_format, tools, a guided field) would hold the continuation as a whole reply."""
    if ends_in_reply(dialog) and controls.get("grammar") is not None:
        raise APIError(400, "the last message is the assistant's, the start of a reply for the model to continue; "
                       "response_format, tools and the guided fields hold a whole reply: end with a user message",
                       param="messages")


def _text(content: str | list[TextPart], field: str) -> str:
    """A content field's text: a string, or text parts joined; any other part (an image, audio), or text that
    is not valid or too long, is refused naming the field."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"{field}[{j}] is a {part.type!r} part; this model reads text parts only",
                               param=f"{field}[{j}]")
        content = "".join(part.text for part in content)
    try:
        return requests.text(content, field)
    except LlamaError as exc:
        raise APIError(400, str(exc), param=field,
                       code="context_length_exceeded" if isinstance(exc, ContextLengthError) else None) from None


def _prompts(prompt: Any, vocabulary: int) -> list[str | list[int]]:
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


def _choices(n: Optional[int], prompts: int = 1, capacity: Optional[int] = None) -> int:
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


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _grammar_fields(body: SamplingFields) -> list[str]:
    """The request's fields that hold its reply to a grammar: a response_format other than text, vLLM's."""
    asked = [name for name in GUIDED_FIELDS if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.type != "text":
        asked.insert(0, "response_format")
    return asked


def _grammar(body: SamplingFields) -> Optional[Grammar]:
    """What the request asks the reply to match: its response_format, or one of vLLM's guided_json (a JSON
    Schema, or its text), guided_regex, guided_choice (one of these texts) and guided_grammar (Lark)."""
    asked = _grammar_fields(body)
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
    schema = response_format.json_schema.schema_
    return {} if schema is None else schema


def _controls(body: SamplingFields, eos_id: Optional[int] = None, **extra: Any) -> dict[str, Any]:
    """The request's sampling fields as llama_core's sampling controls (each absent one at its default), its
    response_format as a grammar; with ignore_eos, EOS (eos_id) never drawn, as vLLM's field asks."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if getattr(body, "ignore_eos", None) and eos_id is not None:
        given["logit_bias"] = {**(given.get("logit_bias") or {}), str(eos_id): -100}
    controls = {**{name: getattr(SamplingParams, name) for name in SAMPLING_FIELDS}, **given, **extra,
                "grammar": _grammar(body)}
    try:
        SamplingParams(**controls)  # judged once here, so that a bad value is refused before any choice runs
    except LlamaError as exc:
        raise from_llama_error(exc, set(body.model_fields_set)) from None
    return controls


def _seeds(seed: Optional[int], n: int) -> list[Optional[int]]:
    """Each choice's seed: choice i of a seeded request samples with seed + i, so the choices differ and the
    request is reproducible."""
    return [None if seed is None else (seed + i) % (MAX_SEED + 1) for i in range(n)]


def _max_new_tokens(max_tokens: Optional[int], engine: TextEngine, name: str) -> int:
    """max_tokens as the engine's max_new_tokens: None is as many as the context holds, and a larger number
    than the context is cut to it (the reply then ends with finish_reason "length" where the context does)."""
    limit = engine.info.max_seq_len - 1
    if max_tokens is None:
        return limit
    if max_tokens < 1:
        zero = " (0 only with echo, on completions: the prompt scored, nothing written)" if max_tokens == 0 else ""
        raise APIError(400, f"{name} must be at least 1{zero}, got {max_tokens}", param=name)
    return min(max_tokens, limit)


def _include_usage(body: SamplingFields) -> bool:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)


async def _size(request: Request) -> int:
    """How long a request's body is (its text, schemas and tools): what preparing and submitting it costs, to
    choose where to do that (aio.submitted). FastAPI has read the body already: this is its copy."""
    return len(await request.body())


async def _submit_all(submit: Callable[[Any], TextStream], jobs: list[Any], fields: set[str],
                      rename: dict[str, str], size: int, controls: dict[str, Any]) -> list[TextStream]:
    """Submits each job (tokenizing a request `size` long: see aio.submitted; with a grammar, always in a
    worker thread: its matcher is built for the check); if one is refused, the ones already running are
    cancelled and the refusal is answered."""
    def submit_each() -> list[TextStream]:
        streams: list[TextStream] = []
        try:
            for job in jobs:
                streams.append(submit(job))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    try:
        return await aio.submitted(submit_each, size if controls.get("grammar") is None else math.inf)
    except LlamaError as exc:
        raise from_llama_error(exc, fields, rename) from None


# -- writing the reply -----------------------------------------------------------------------------------
class _Reply:
    """One request's choices, read together: the whole reply as one JSON object, or as events."""

    object_name = ""
    chunk_object_name = ""  # a streamed event's object
    id_prefix = ""

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool) -> None:
        """streams: the choices, those of each prompt together (per_prompt of them)."""
        self.engine, self.model_id, self.streams, self.include_usage = engine, model_id, streams, include_usage
        self.per_prompt = per_prompt
        self.unwritten: list[list[StreamChunk]] = [[] for _ in streams]  # each choice's chunks held back
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        # Every choice of one prompt shares its prompt: it counts once, as the OpenAI API counts it.
        firsts = self.streams[:: self.per_prompt]
        prompt = sum(s.prompt_tokens for s in firsts)
        completion = sum(s.generated_tokens for s in self.streams)
        accepted = sum(s.accepted_tokens for s in self.streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
                # drafts from prompt lookup, in the fields OpenAI gives predicted outputs
                "completion_tokens_details": {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens":
                                              sum(s.drafted_tokens for s in self.streams) - accepted}}

    def finish_reason(self, index: int) -> str:
        return FINISH_REASONS.get(self.streams[index].finish_reason or "stop", "stop")

    def header(self, streamed: bool = False) -> dict[str, Any]:
        # no fingerprint of the backend's configuration is kept: null, as vLLM sends it
        return {"id": self.id, "object": self.chunk_object_name if streamed else self.object_name,
                "created": self.created, "model": self.model_id, "system_fingerprint": None}

    def token_text(self, token: int, first: bool = False) -> str:
        """A token's text as the API gives it: its piece, leading space kept unless it is the first of a text
        (SentencePiece does not write it there, so the tokens spell the text); a byte piece of an ASCII character
        (<0x0A>) as that character, as vLLM gives it; another byte piece, a part of a character, as <0xNN>
        (its `bytes` say which byte)."""
        text = self.engine.tokenizer.token_text(token)
        byte = _byte_piece(text)
        text = chr(byte) if byte is not None and byte < 0x80 else text
        return text[1:] if first and text.startswith(" ") else text

    def written(self, index: int, chunks: list[StreamChunk]) -> list[StreamChunk]:
        """A choice's last chunks less those that wrote nothing of its text, only a stop string (or a dialog
        tag): the text leaves it out, so its tokens and logprobs do too (as the Python API's results)."""
        if self.streams[index].finish_reason != "stop":
            return chunks
        return chunks[:_writing_end(chunks)]

    def to_send(self, batch: Batch) -> list[StreamChunk]:
        """A streamed batch's chunks to send now: those held back before, then the batch's, less those at its
        end that have written nothing yet (a stop string may be all they write: they wait for the text they
        write, or the end, so a stream lists the tokens the whole reply lists)."""
        chunks, self.unwritten[batch.index] = self.unwritten[batch.index] + batch.chunks, []
        if batch.done:
            return self.written(batch.index, chunks)
        end = _writing_end(chunks)
        self.unwritten[batch.index] = chunks[end:]
        return chunks[:end]

    async def whole(self, request: Request) -> dict[str, Any]:
        parts: list[list[StreamChunk]] = [[] for _ in self.streams]
        async for batch in merged_batches(self.streams, request):
            if batch.error is not None:
                raise from_llama_error(batch.error, ())
            parts[batch.index] += batch.chunks
        return {**self.header(), **self.whole_body(parts), "usage": self.usage()}

    async def events(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        async for event in self.first_events():
            yield event
        async for batch in merged_batches(self.streams, request):
            if batch.error is not None:
                yield from_llama_error(batch.error, ()).body()
                return
            for event in self.event(batch):
                yield event
        if self.include_usage:
            yield {**self.header(streamed=True), "choices": [], "usage": self.usage()}

    async def first_events(self) -> AsyncIterator[dict[str, Any]]:
        return
        yield

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        raise NotImplementedError

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        """The chunks a batch of one choice's stream sends (none where it has nothing to say yet)."""
        raise NotImplementedError

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        event = {**self.header(streamed=True), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event


class _ChatReply(_Reply):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool, logprobs: bool, functions: Sequence[tools.Function] = ()) -> None:
        """functions: the tools a choice may call; a choice that is a call comes back as tool_calls (streamed:
        a choice whose text starts with "{" is held back to its end, then sent as its call)."""
        super().__init__(engine, model_id, streams, per_prompt, include_usage)
        self.logprobs = logprobs
        self.entries = [0] * len(streams)  # logprobs entries each choice has sent
        self.functions = list(functions)
        self.held: list[Optional[list[StreamChunk]]] = [[] if functions else None for _ in streams]

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        choices = []
        for i, chunks in enumerate(parts):
            chunks = self.written(i, chunks)
            text = "".join(c.text for c in chunks)
            message, finish = {"role": "assistant", "content": text, "refusal": None}, self.finish_reason(i)
            call = self._call(i, text)
            if call is not None:
                message, finish = {**message, "content": None, "tool_calls": [tools.tool_call(call)]}, "tool_calls"
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(i, chunks),
                            "finish_reason": finish})
        return {"choices": choices}

    async def first_events(self) -> AsyncIterator[dict[str, Any]]:
        for i, held in enumerate(self.held):
            if held is None:  # with tools, the role comes with the first delta: content, or null and a call
                yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        chunks = self.to_send(batch)
        held, role = self.held[batch.index], {}
        if held is not None:  # with tools: text before its first character is known to start no call is held
            held += chunks
            text = "".join(c.text for c in held)
            if not batch.done and tools.may_be_call(text):
                return []
            self.held[batch.index], role = None, {"role": "assistant"}
            call = self._call(batch.index, text) if batch.done else None
            if call is not None:  # the call, then its end alone, as OpenAI sends them (clients finish a call so)
                delta = {**role, "content": None, "tool_calls": [{"index": 0, **tools.tool_call(call)}]}
                return [self._chunk(batch.index, delta, self._logprobs(batch.index, held), None),
                        self._chunk(batch.index, {}, None, "tool_calls")]
            chunks = held
        text = "".join(c.text for c in chunks)
        logprobs = self._logprobs(batch.index, chunks)
        finish = self.finish_reason(batch.index) if batch.done else None
        if text or role or (logprobs and logprobs["content"]):  # with the end: text held back to it
            return [self._chunk(batch.index, {**role, "content": text}, logprobs, finish)]
        return [self._chunk(batch.index, {}, None, finish)] if batch.done else []

    def _call(self, index: int, text: str) -> Optional[dict[str, Any]]:
        return tools.call_made(text, self.functions, self.streams[index].finish_reason)

    def _chunk(self, index: int, delta: dict, logprobs: Optional[dict], finish: Optional[str]) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def _logprobs(self, index: int, chunks: list[StreamChunk]) -> Optional[dict[str, Any]]:
        if not self.logprobs:
            return None
        content = []
        for c in chunks:
            if c.token < 0:
                continue
            first = self.entries[index] == 0
            self.entries[index] += 1
            top = [self._entry(t, lp, first) for t, lp in (c.top_logprobs or [])]
            content.append({**self._entry(c.token, c.logprob, first), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _entry(self, token: int, logprob: float, first: bool) -> dict[str, Any]:
        text = self.token_text(token, first)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(_token_bytes(text))}


class _CompletionReply(_Reply):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, engine: TextEngine, model_id: str, streams: list[TextStream], per_prompt: int,
                 include_usage: bool, top: Optional[int], echoed: Optional[list[str | list[int]]],
                 scoring: bool = False) -> None:
        """scoring: echo with max_tokens 0: each choice is its prompt alone (the token drawn after it unsent)."""
        super().__init__(engine, model_id, streams, per_prompt, include_usage)
        self.top = top  # None: no logprobs; else alternatives per token
        self.echoed = echoed  # each choice's prompt (text, or token ids) with echo, else None
        self.scoring = scoring
        self.offsets = [0] * len(streams)  # characters of text each choice has sent
        self.unechoed = set(range(len(streams))) if echoed else set()

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.scoring:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def finish_reason(self, index: int) -> str:
        return "length" if self.scoring else super().finish_reason(index)

    def whole_body(self, parts: list[list[StreamChunk]]) -> dict[str, Any]:
        return {"choices": [self._choice(i, self.written(i, chunks), self.finish_reason(i))
                            for i, chunks in enumerate(parts)]}

    def written(self, index: int, chunks: list[StreamChunk]) -> list[StreamChunk]:
        return [] if self.scoring else super().written(index, chunks)

    def event(self, batch: Batch) -> list[dict[str, Any]]:
        chunks = [] if self.scoring else self.to_send(batch)
        choice = self._choice(batch.index, chunks, self.finish_reason(batch.index) if batch.done else None)
        if not choice["text"] and not (choice["logprobs"] and choice["logprobs"]["tokens"]) and not batch.done:
            return []
        return [self.chunk(choice)]

    def _choice(self, index: int, chunks: list[StreamChunk], finish: Optional[str]) -> dict[str, Any]:
        """The choice's text and logprobs in chunks, after its echoed prompt if that was not sent yet (the
        prompt's log-probabilities arrive with the first token)."""
        head, head_logprobs = self._echo(index) if index in self.unechoed else ("", None)
        self.unechoed.discard(index)
        logprobs = self._logprobs(index, chunks)
        if logprobs is not None and head_logprobs is not None:
            logprobs = {key: head_logprobs[key] + logprobs[key] for key in logprobs}
        return {"index": index, "text": head + "".join(c.text for c in chunks), "logprobs": logprobs,
                "finish_reason": finish}

    def _echo(self, index: int) -> tuple[str, Optional[dict[str, list]]]:
        """The echoed prompt of a choice and, with logprobs, its tokens' log-probabilities and the most likely
        tokens at each (logprobs of them): a text prompt's first one given BOS (which is not echoed), a
        token-id prompt's first one null, as nothing precedes it."""
        prompt = self.echoed[index]
        tokenizer = self.engine.tokenizer
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        self.offsets[index] = len(text)
        if self.top is None:
            return text, None
        tokens = tokenizer.encode(prompt, bos=False, eos=False) if isinstance(prompt, str) else prompt
        stream, lead = self.streams[index], [] if isinstance(prompt, str) else [None]
        values = lead + list(stream.prompt_logprobs or []) + [None] * len(tokens)
        tops = lead + list(stream.prompt_top_logprobs or []) + [None] * len(tokens)
        decoder, offsets, at = StreamDecoder(tokenizer), [], 0
        for token in tokens:
            offsets.append(at)
            at += len(decoder.push(token))
        first = next((i for i, t in enumerate(tokens) if t != tokenizer.bos_id), None)  # the first to write text
        return text, {"tokens": [self.token_text(t, i == first) for i, t in enumerate(tokens)],
                      "token_logprobs": [_logprob(v) for v in values[: len(tokens)]],
                      "top_logprobs": [self._top(*at, first=i == first) for i, at in enumerate(zip(tops, tokens, values))],
                      "text_offset": offsets}

    def _top(self, alternatives: Optional[list[tuple[int, float]]], token: int,
             logprob: Optional[float], first: bool = False) -> Optional[dict[str, float]]:
        """A position's most likely tokens as OpenAI gives them, their text to their log-probability, with the
        token chosen there added where it is not among them ("up to logprobs+1" entries, as OpenAI and vLLM)."""
        if self.top is None or alternatives is None:
            return None
        top = {self.token_text(t, first): _logprob(lp) for t, lp in alternatives}
        if token not in (t for t, _ in alternatives):
            top.setdefault(self.token_text(token, first), _logprob(logprob))
        return top

    def _logprobs(self, index: int, chunks: list[StreamChunk]) -> Optional[dict[str, list]]:
        if self.top is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for c in chunks:
            if c.token >= 0:
                tokens.append(self.token_text(c.token))
                values.append(_logprob(c.logprob))
                tops.append(self._top(c.top_logprobs or [], c.token, c.logprob))
                offsets.append(self.offsets[index])
            self.offsets[index] += len(c.text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _call_grammar(functions: list[tools.Function], required: bool,
                  response_format: Optional[ResponseFormat] = None) -> Any:
    """The grammar a reply that may call the functions is held to (a reply that calls none follows
    response_format, a checked one, as OpenAI holds it); a 400 naming `tools` where they cannot make one (too
    large a set of schemas, say)."""
    schema = _format_schema(response_format)
    try:
        return tools.call_grammar(functions, required, {} if schema is True else schema)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tools") from None


def _writing_end(chunks: list[StreamChunk]) -> int:
    """How many of chunks it takes to reach the last that wrote text: those after it wrote nothing yet."""
    end = len(chunks)
    while end and chunks[end - 1].token >= 0 and not chunks[end - 1].text:
        end -= 1
    return end


def _logprob(value: Optional[float]) -> Optional[float]:
    """A log-probability JSON can carry: -inf (a token sampling ruled out) as OpenAI's -9999.0."""
    if value is None or math.isnan(value):
        return None
    return max(value, -9999.0)


def _byte_piece(text: str) -> Optional[int]:
    """The byte a byte-fallback piece (<0xE2>) stands for, or None for any other text."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            pass
    return None


def _token_bytes(text: str) -> bytes:
    """A token's bytes: a byte-fallback piece (<0xE2>) is that one byte."""
    byte = _byte_piece(text)
    return text.encode("utf-8") if byte is None else bytes([byte])


def _event_stream(events: AsyncIterator[dict[str, Any]], done: bool = True) -> StreamingResponse:
    """Server-sent events; done: ending with `data: [DONE]` (the chat and completion routes; the Responses API
    names each event instead, and ends with response.completed)."""
    async def lines() -> AsyncIterator[bytes]:
        async for event in events:
            name = f"event: {event['type']}\n".encode() if not done and "type" in event else b""
            yield name + b"data: " + json.dumps(event).encode() + b"\n\n"
        if done:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @api.exception_handler(RequestValidationError)
    async def unreadable(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = from_validation_errors(list(exc.errors()))
        content_type = request.headers.get("content-type", "")
        if error.param is None and "json" not in content_type.lower():  # FastAPI reads the body by this header
            error.message += (f" (it came as {content_type!r}" if content_type else " (it came with no Content-Type") \
                + "; send it with the header Content-Type: application/json)"
        return error.response()

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, for what json.loads refused
            detail = "the request body could not be read as JSON (nested too deeply, or a number with too many digits?)"
            try:
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError:
                detail = "the request body is not UTF-8 text, as JSON must be"
            except ClientDisconnect:  # the client left mid-body: nobody to answer
                detail = "the client went away before the body was sent"
        message = f"{request.method} {request.url.path}: {detail}"
        return APIError(exc.status_code, message, code=code).response()

    @api.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}; the server's log has the details",
                        type="server_error").response()
