"""The OpenAI-compatible HTTP API on a running engine: /v1/models, /v1/chat/completions, /v1/completions,
/health and /metrics (Prometheus: .metrics), as a FastAPI app that the web app mounts its Gradio interface
into (one host and port for both).

Requests are read by the models of .schemas, their values judged by llama_core.serving.requests (the
validator of every route), and run by the same engine as the web page's. Replies follow the OpenAI API,
streamed as Server-Sent Events with `stream`; see README.md for what differs. A route reads its request's
fields with .reading (the reply's grammar: .reply_grammar) and writes its reply with .replies.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from ..dialog import UNSAFE_ERROR, encode_dialog
from ..errors import EngineUnavailableError, LlamaError
from ..serving import aio, requests
from ..serving.streams import TextEngine, TextStream, stream_chat, stream_completion, vocabulary
from . import responses, tools
from .cors import LocalOrigins
from .errors import APIError, from_llama_error, install_error_handlers
from .keys import ApiKeys, KeyCheck
from .metrics import CONTENT_TYPE, MeteredEngine
from .reading import (SAMPLING_FIELDS, check_reply_start, choice_count, choice_seeds, completion_prompts, content_text,
                      include_usage, llama_dialog, new_token_limit, predicted_text, refuse_unsupported_chat,
                      reply_tools, sampling_controls, tagged_field)
from .replies import ChatReply, CompletionReply
from .reply_grammar import grammar_fields, with_tools
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest
from .streaming import event_stream

ENDED_STATE_SECONDS = 2.0  # /health's wait for a model process that just ended to be restarting (or failed)

log = logging.getLogger(__name__)


def create_api(engine: TextEngine, model_name: Optional[str] = None, api_keys: Sequence[str] = ()) -> FastAPI:
    """The API serving `engine` as the model `model_name` (default: the checkpoint folder's name). With
    api_keys, every /v1 route and /metrics need `Authorization: Bearer <one of them>`; /health never does.
    /metrics counts the replies of the requests submitted through a MeteredEngine: given one (the page's
    too), its own; given a plain engine, the API's alone. The metrics are also `api.state.metrics`."""
    engine = engine if isinstance(engine, MeteredEngine) else MeteredEngine(engine)
    model_id = model_name or engine.info.name
    created = int(time.time())
    api = FastAPI(title="llama_core OpenAI-compatible API", docs_url="/v1/docs", openapi_url="/v1/openapi.json",
                  redoc_url=None)
    api.state.metrics = engine.metrics
    keys = ApiKeys(api_keys)
    keyed: list[APIRoute] = []  # the routes that need a key, found as the first request comes

    def needs_key(scope: dict) -> bool:
        """Whether the route the request goes to (the first that matches it, as Starlette routes it) needs a key."""
        if not keyed:
            keyed.extend(route for route in api.routes if isinstance(route, APIRoute) and
                         any(d.call == keys.authorized for d in route.dependant.dependencies))
        partial = None  # a route matching the path but not the method: its 405
        for route in api.routes:
            match = route.matches(scope)[0]
            if match == Match.FULL:
                return route in keyed
            if match == Match.PARTIAL and partial is None:
                partial = route
        return partial is not None and partial in keyed

    api.add_middleware(KeyCheck, keys=keys, guarded=needs_key)  # inside LocalOrigins: a 401 is answered with CORS
    api.add_middleware(LocalOrigins)

    def served_model(requested: Optional[str]) -> None:
        if requested is not None and requested != model_id:
            raise APIError(404, f"the model {requested!r} does not exist here; this server serves {model_id!r}",
                           param="model", code="model_not_found")

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "llama_core",
                "context_length": engine.info.max_seq_len, "max_model_len": engine.info.max_seq_len}

    install_error_handlers(api, log)
    v1 = [Depends(keys.authorized)]
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

    @api.get("/metrics", dependencies=v1, include_in_schema=False)
    def metrics() -> Response:  # a plain def: a model process's counters are waited for in a worker thread
        """Prometheus' text format: the engine's counters, asked for now, and the replies served so far."""
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE)

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
        refuse_unsupported_chat(body)
        size = aio.preparing_size(await _size(request), bool(grammar_fields(body) or body.tools))
        functions, required = await aio.submitted(lambda: reply_tools(body), size)  # long schemas: off the loop
        dialog = await aio.submitted(lambda: llama_dialog(body.messages, tools.tools_prompt(functions, required)
                                                          if functions else ""), size)
        prediction = predicted_text(body.prediction)
        fields = set(body.model_fields_set) | {"messages"}
        rename = {"max_new_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

        def reply_controls() -> dict[str, Any]:
            return with_tools(sampling_controls(body, engine.tokenizer.eos_id, logprobs=bool(body.logprobs),
                                                top_logprobs=body.top_logprobs or 0),
                              functions, required, body.response_format)

        controls = await aio.submitted(reply_controls, size)
        check_reply_start(dialog, controls)
        max_new_tokens = new_token_limit(max_tokens, engine, "max_completion_tokens" if rename else "max_tokens")
        refusal = [False]

        def submit(seed: Optional[int]) -> TextStream:
            stream = stream_chat(engine, dialog, max_new_tokens=max_new_tokens, drop_old_turns=False,
                                 prediction=prediction, client=request.state.client, **dict(controls, seed=seed))
            if stream.refusal is not None:
                refusal[0] = True
            return stream

        choices = choice_count(body.n, capacity=engine.client_capacity)
        streams = await _submit_all(submit, choice_seeds(controls["seed"], choices), fields, rename, size, controls)
        if refusal[0]:
            raise APIError(400, UNSAFE_ERROR, param=tagged_field(body), code="invalid_prompt")
        reply = ChatReply(engine, model_id, streams, len(streams), include_usage(body), bool(body.logprobs),
                          functions)
        if body.stream:
            return event_stream(reply.events(request))
        return await reply.whole(request)

    @api.post("/v1/responses", dependencies=v1)
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        served_model(body.model)
        responses.refuse_unsupported(body)
        earlier = kept.get(body.previous_response_id).messages if body.previous_response_id is not None else []
        size = aio.preparing_size(await _size(request), len(earlier) > 64)  # copied: a long conversation, a thread
        messages, origin = await aio.submitted(lambda: responses.chat_messages(body, earlier), size)
        try:
            chat_tools, tool_choice = responses.chat_tools(body)
            chat = ChatCompletionRequest(
                messages=messages, max_tokens=body.max_output_tokens, response_format=responses.response_format(
                    body.text.format if body.text else None), tools=chat_tools, tool_choice=tool_choice,
                **{name: getattr(body, name) for name in SAMPLING_FIELDS if name != "logit_bias"})
            refuse_unsupported_chat(chat)
            size = aio.preparing_size(size, bool(grammar_fields(chat) or chat.tools))
            functions, required = await aio.submitted(lambda: reply_tools(chat), size)
            note = "\n\n".join(part for part in (body.instructions or "", tools.tools_prompt(functions, required)
                                                  if functions else "") if part)
            dialog = await aio.submitted(lambda: llama_dialog(chat.messages, note), size)
            scored = responses.with_logprobs(body)

            def reply_controls() -> dict[str, Any]:
                return with_tools(sampling_controls(chat, logprobs=scored,
                                                    top_logprobs=(body.top_logprobs or 0) if scored else 0),
                                  functions, required, chat.response_format)

            controls = await aio.submitted(reply_controls, size)
            check_reply_start(dialog, controls)
            max_new_tokens = new_token_limit(chat.max_tokens, engine, "max_tokens", scoring=False)

            def submit(_: None) -> TextStream:
                stream = stream_chat(engine, dialog, max_new_tokens=max_new_tokens, drop_old_turns=False,
                                     client=request.state.client, **controls)
                if stream.refusal is not None:
                    raise APIError(400, UNSAFE_ERROR, param=tagged_field(chat), code="invalid_prompt")
                return stream

            (stream,) = await _submit_all(submit, [None], set(chat.model_fields_set) | {"messages"}, {}, size,
                                          controls)
        except APIError as exc:
            raise responses.renamed(exc, origin) from None
        writer = responses.ResponseWriter(stream, model_id, body, functions, messages,
                                          None if body.store is False else kept,
                                          ChatReply(engine, model_id, [stream], 1, False, True) if scored else None)
        if body.stream:
            return event_stream(writer.events(request), done=False)
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
        prompts = completion_prompts(body.prompt, vocabulary(engine))
        n = choice_count(body.n, len(prompts), engine.client_capacity)
        top = body.logprobs
        if top is not None and not 0 <= top <= requests.MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer from 0 to {requests.MAX_TOP_LOGPROBS}, got {top}",
                           param="logprobs")
        size = aio.preparing_size(await _size(request), bool(grammar_fields(body)))
        controls = await aio.submitted(lambda: sampling_controls(body, engine.tokenizer.eos_id,
                                                                 logprobs=top is not None, top_logprobs=top or 0), size)
        scoring = bool(body.echo) and body.max_tokens == 0  # the prompt alone, with its logprobs: one step, unsent
        max_new_tokens = 1 if scoring else new_token_limit(body.max_tokens, engine, "max_tokens")
        echo_logprobs = bool(body.echo) and top is not None
        jobs = [(prompt, seed) for prompt in prompts for seed in choice_seeds(controls["seed"], n)]

        def submit(job: tuple[str | list[int], Optional[int]]) -> TextStream:
            prompt = job[0]
            if isinstance(prompt, str) and not prompt.strip():  # as OpenAI takes it: the model writes after BOS
                prompt = engine.tokenizer.encode(prompt, bos=True, eos=False)
            return stream_completion(engine, prompt, max_new_tokens=max_new_tokens, prompt_logprobs=echo_logprobs,
                                     client=request.state.client, **dict(controls, seed=job[1]))

        streams = await _submit_all(submit, jobs, set(body.model_fields_set) | {"prompt"}, {}, size, controls)
        echoed = [job[0] for job in jobs] if body.echo else None
        reply = CompletionReply(engine, model_id, streams, n, include_usage(body), top, echoed, scoring)
        if body.stream:
            return event_stream(reply.events(request))
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
        functions, required = await aio.submitted(lambda: reply_tools(body), aio.preparing_size(size, bool(body.tools)))
        tokenizer = engine.tokenizer

        def tokens() -> list[int]:
            if body.prompt is not None:
                return tokenizer.encode(content_text(body.prompt, "prompt"),
                                        bos=body.add_special_tokens is not False, eos=False)
            try:
                return encode_dialog(tokenizer, llama_dialog(body.messages, tools.tools_prompt(functions, required)
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
        raise APIError(404, f"no route {request.method} /v1/{path}; this server has GET /v1/models and "
                       "/v1/models/{model}, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, and "
                       "GET and DELETE /v1/responses/{id}", code="unknown_url")

    return api


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
        return await aio.submitted(submit_each, aio.preparing_size(size, controls.get("grammar") is not None))
    except LlamaError as exc:
        raise from_llama_error(exc, fields, rename) from None
