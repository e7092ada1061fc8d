"""The OpenAI-compatible API through the official `openai` SDK (and raw HTTP where the SDK can't send what a
client might), against a real server on a free port whose engine runs in a process of its own."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading
import time
from typing import Iterator, Literal

import httpx
import openai
import pydantic
import pytest

import app_server
from conftest import on_event_loop
from llama_core import load
from llama_core.dialog import encode_dialog
from llama_core.openai_api import create_api
from llama_core.app.address import listen_socket
from llama_core.app.web_server import BackgroundServer
from llama_core.serving import Engine

KEY = "test-key-1"
OTHER_KEY = "test-key-2"
HELLO = [{"role": "user", "content": "Good morrow, what news?"}]


@contextlib.contextmanager
def serve_api(engine, api_keys=(KEY, OTHER_KEY)) -> Iterator[str]:
    server = BackgroundServer(create_api(engine, api_keys=api_keys), listen_socket("127.0.0.1", 0)).start()
    try:
        yield server.url + "v1"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served():
    """(engine, base URL of the API): the app's server (page and API together) on the test model."""
    with app_server.serve_app(max_seq_len=512, api_keys=(KEY, OTHER_KEY)) as (engine, url):  # room for tools
        yield engine, url + "v1"


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def raw(served, method: str, path: str, body=None, key=KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, str):
        headers["Content-Type"] = "application/json"
        kwargs["content"] = body
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, served[1] + path, headers=headers, timeout=60, **kwargs)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]  # never null: the user learns what was wrong
    return body["error"]


def test_a_page_on_localhost_may_call_the_api_and_one_elsewhere_may_not(served):
    """A local chat front-end (http://localhost:3000) reads the API's answers: the preflight and the answer
    agree (the preflight alone, from Gradio's page, said yes); another site's origin gets no grant."""
    url = served[1] + "/chat/completions"
    for origin, allowed in (("http://localhost:3000", True), ("http://127.0.0.1:8080", True),
                            ("https://example.com", False)):
        preflight = httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization,content-type"})
        answer = httpx.post(url, json={"messages": HELLO, "max_tokens": 2},
                            headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        granted = [r.headers.get("access-control-allow-origin") for r in (preflight, answer)]
        assert granted == ([origin, origin] if allowed else [None, None]), (origin, granted)
        assert "access-control-allow-credentials" not in answer.headers  # keys are headers, not cookies
    unkeyed = httpx.get(served[1] + "/models", headers={"Origin": "http://localhost:3000"})
    assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == "http://localhost:3000"


# -- models and health -----------------------------------------------------------------------------------
def test_models_lists_the_loaded_model_with_its_context(client, served):
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id == served[0].info.name
    assert models[0].model_extra["context_length"] == served[0].info.max_seq_len
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_health_answers_without_a_key(served):
    response = httpx.get(served[1].removesuffix("v1") + "health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_health_counts_the_prompt_tokens_the_prefix_cache_saved(served, client, model_id):
    health = served[1].removesuffix("v1") + "health"
    system = [{"role": "system", "content": "You are a herald of the court; speak in rhyme of the king. " * 4}]
    before = httpx.get(health).json()
    for question in ("What news?", "Who comes?"):
        client.chat.completions.create(model=model_id, messages=system + [{"role": "user", "content": question}],
                                       max_tokens=2)
    after = httpx.get(health).json()
    assert {"active", "waiting", "steps", "prefilled_tokens", "cached_tokens"} <= set(after)
    assert after["cached_tokens"] - before["cached_tokens"] >= 40  # the second found the system prompt cached
    assert after["prefilled_tokens"] > before["prefilled_tokens"] and after["active"] == 0


def test_health_says_when_the_model_process_is_stuck(served, monkeypatch):
    """Alive but not answering (SIGSTOP stands for a hung device): 503 "unresponsive", for a load balancer or a
    watchdog to act on; 200 again once it goes on."""
    import os
    import signal

    from llama_core.serving.engine_process import EngineProcess

    engine, url = served[0], served[1].removesuffix("v1") + "health"
    monkeypatch.setattr(engine, "stats", lambda: EngineProcess.stats(engine, 0.5))
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        stuck = httpx.get(url, timeout=10)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    assert stuck.status_code == 503 and stuck.json()["status"] == "unresponsive", stuck.text
    assert httpx.get(url, timeout=10).status_code == 200


def test_health_of_a_model_process_that_just_ended_says_restarting(served, monkeypatch):
    """The moment after the model process is killed, its pipe is closed before its supervisor has marked it
    restarting: /health said "unresponsive" (meant for one alive and stuck) for about half a second (docs
    pass). It waits, briefly, for the supervisor's word."""
    import threading

    from llama_core.errors import EngineUnavailableError

    engine, url = served[0], served[1].removesuffix("v1") + "health"

    def ended(*args):
        raise EngineUnavailableError("the model process stopped")

    monkeypatch.setattr(engine, "stats", ended)
    monkeypatch.setattr(engine, "state", "running")
    supervisor = threading.Timer(0.3, lambda: setattr(engine, "state", "restarting"))
    supervisor.start()
    try:
        health = httpx.get(url, timeout=10)
    finally:
        supervisor.join()
    assert health.status_code == 503 and health.json()["status"] == "restarting", health.text


# -- chat ------------------------------------------------------------------------------------------------
def test_chat_stream_equals_non_stream_with_usage(client, model_id, served):
    whole = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content and streamed
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    # Every event of the stream, the usage one too, is a chunk; both shapes carry system_fingerprint (null).
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and whole.object == "chat.completion"
    assert "system_fingerprint" in whole.model_dump() and all("system_fingerprint" in c.model_dump() for c in chunks)
    engine = served[0]
    assert whole.usage.prompt_tokens == len(encode_dialog(engine.tokenizer, HELLO))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert 1 <= whole.usage.completion_tokens <= 24


def test_chat_takes_system_and_text_parts_and_max_completion_tokens(client, model_id):
    messages = [{"role": "developer", "content": "You are Juliet."},
                {"role": "user", "content": [{"type": "text", "text": "Good "}, {"type": "text", "text": "morrow"}]}]
    parts = client.chat.completions.create(model=model_id, messages=messages, max_completion_tokens=5, temperature=0)
    plain = client.chat.completions.create(
        model=model_id, messages=[{"role": "system", "content": "You are Juliet."},
                                  {"role": "user", "content": "Good morrow"}], max_tokens=5, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens <= 5 and parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_logprobs_describe_each_generated_token(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        ranked = [alt.logprob for alt in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in content) == reply.choices[0].message.content  # the tokens spell the reply


def test_chat_stop_string_ends_the_reply_before_it(client, model_id):
    full = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    cut = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=40, temperature=0, stop=[stop],
                                         logprobs=True)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # The logprobs end with the text: no token that wrote only the stop string.
    tokens = "".join(entry.token for entry in cut.choices[0].logprobs.content)
    entries = cut.choices[0].logprobs.content
    assert tokens.startswith(cut.choices[0].message.content)
    assert len("".join(entry.token for entry in entries[:-1])) < len(cut.choices[0].message.content)
    for streamed in (False, True):
        completion = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=30, temperature=0,
                                               stop=["the"], logprobs=0, stream=streamed)
        choices = list(completion) if streamed else [completion]
        text = "".join(c.choices[0].text for c in choices)
        tokens = [t for c in choices if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert choices[-1].choices[0].finish_reason == "stop", text
        assert "".join(tokens).startswith(text) and len("".join(tokens[:-1])) < len(text), (text, tokens)


def test_seed_reproduces_a_sample_while_other_requests_run(client, model_id):
    ask = dict(model=model_id, messages=HELLO, max_tokens=30, temperature=1.0, top_p=1.0, seed=1234)
    alone = client.chat.completions.create(**ask).choices[0].message.content

    def other(i: int) -> str:
        return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": f"Speak {i}"}],
                                              max_tokens=40, temperature=1.0).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        others = [pool.submit(other, i) for i in range(4)]
        busy = pool.submit(lambda: client.chat.completions.create(**ask).choices[0].message.content)
        assert busy.result() == alone
        assert all(isinstance(f.result(), str) for f in others)


def test_n_choices_are_distinct_samples_and_reproducible(client, model_id):
    ask = dict(model=model_id, messages=HELLO, max_tokens=20, temperature=1.5, top_p=1.0, seed=99, n=3)
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    single = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=1)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the shared prompt counts once


def test_streamed_n_choices_each_end_once(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=10, temperature=0.8,
                                                 seed=5, n=2, stream=True))
    ends = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert ends == [0, 1]
    whole = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=10, temperature=0.8, seed=5, n=2)
    for choice in whole.choices:
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == choice.index)
        assert streamed == choice.message.content


# -- completions ------------------------------------------------------------------------------------------
def test_completion_echo_and_logprobs(client, model_id):
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo"]
    reply = client.completions.create(model=model_id, prompt=prompts, max_tokens=8, temperature=0, echo=True,
                                      logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(prompts, reply.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset)
        assert all(v is not None and v <= 0 for v in logprobs.token_logprobs)
        # Every token, the prompt's too, comes with the 2 most likely at its position (a text prompt's first
        # given BOS), and itself where it is not one of them: up to logprobs+1 entries, as OpenAI gives them.
        assert len(logprobs.top_logprobs) == len(logprobs.tokens)
        for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert top[token] == pytest.approx(value, abs=1e-6) and value <= max(top.values()) + 1e-6
            ranked = sorted(top.values(), reverse=True)
            assert len(top) == 2 or (len(top) == 3 and value == pytest.approx(ranked[2], abs=1e-6))
        assert any(len(top) == 3 for top in logprobs.top_logprobs[:len(logprobs.tokens) - 8])  # the prompt's
        # The tokens spell the text, the prompt's first without the space SentencePiece does not write.
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    plain = client.completions.create(model=model_id, prompt=prompts[0], max_tokens=8, temperature=0)
    assert reply.choices[0].text == prompts[0] + plain.choices[0].text


def test_a_newline_token_reads_as_a_newline_and_a_part_of_a_character_as_its_byte(client, model_id):
    # Llama-2's tokenizer spells a newline, and characters outside its pieces, in byte pieces (<0x0A>).
    reply = client.completions.create(model=model_id, prompt="ROMEO:\nJULIET: é", max_tokens=1, temperature=0,
                                      echo=True, logprobs=0)
    tokens = reply.choices[0].logprobs.tokens
    assert "\n" in tokens and "<0x0A>" not in tokens, tokens
    assert "".join(tokens[:-1]).lstrip().startswith("ROMEO:\nJULIET: ")
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say é"}],
                                          max_tokens=24, temperature=0, logprobs=True)
    for entry in chat.choices[0].logprobs.content:  # bytes always hold the token's own bytes
        assert bytes(entry.bytes) == (entry.token.encode() if not entry.token.startswith("<0x")
                                      else bytes([int(entry.token[3:5], 16)]))


def test_completion_logprobs_0_gives_each_token_with_its_own_logprob_only(client, model_id):
    reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=0)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 6 and reply.system_fingerprint is None
    assert logprobs.top_logprobs == [{t: v} for t, v in zip(logprobs.tokens, logprobs.token_logprobs)]


def test_completion_top_logprobs_keep_the_likelier_of_two_tokens_with_one_text():
    # The embedded tokenizer has `f` (2002) and its byte piece <0x66> (109): both read "f" in the API.
    from types import SimpleNamespace
    from llama_core.openai_api.replies import CompletionReply
    tokenizer = load().tokenizer
    f, byte_f, e = 2002, 109, 1985
    assert [tokenizer.token_text(t) for t in (f, byte_f, e)] == ["f", "<0x66>", "e"]
    reply = CompletionReply(SimpleNamespace(tokenizer=tokenizer), "m", [], 1, False, top=3, echoed=None)
    assert reply._top([(f, -0.04), (byte_f, -8.98), (e, -9.5)], f, -0.04) == {"f": -0.04, "e": -9.5}
    assert reply._top([(e, -0.1), (f, -2.0), (byte_f, -8.98)], byte_f, -8.98) == {"e": -0.1, "f": -2.0}


def test_completion_default_max_tokens_is_openais_16(client, model_id):
    reply = client.completions.create(model=model_id, prompt="ROMEO:", temperature=1.0, seed=3)
    assert reply.usage.completion_tokens <= 16
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_completion_stream_equals_non_stream(client, model_id):
    ask = dict(model=model_id, prompt="To be, or not", max_tokens=20, temperature=0, logprobs=1)
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


# -- structured outputs ---------------------------------------------------------------------------------
class Verse(pydantic.BaseModel):
    speaker: Literal["ROMEO", "JULIET", "NURSE"]
    act: int = pydantic.Field(ge=1, le=5)
    words: list[pydantic.constr(max_length=12)] = pydantic.Field(max_length=3)


def test_the_sdk_parses_a_reply_into_its_pydantic_model(client, model_id):
    for seed in range(3):
        reply = client.chat.completions.parse(model=model_id, messages=HELLO, response_format=Verse, seed=seed,
                                              temperature=1.0, max_completion_tokens=120)
        verse = reply.choices[0].message.parsed
        assert isinstance(verse, Verse) and reply.choices[0].finish_reason == "stop"
        assert json.loads(reply.choices[0].message.content) == verse.model_dump()


def test_json_object_replies_are_json_streamed_or_not(client, model_id):
    ask = dict(model=model_id, messages=HELLO, response_format={"type": "json_object"}, seed=7, temperature=0.9,
               max_tokens=100)
    whole = client.chat.completions.create(**ask)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(streamed), dict)


def test_a_client_that_leaves_mid_body_is_no_error_in_the_log(served, caplog):
    import logging
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(served[1])
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            with socket.create_connection((address.hostname, address.port)) as raw:
                raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n{\"mode")
        time.sleep(1.0)
        assert httpx.get(served[1].removesuffix("v1") + "health", timeout=10).status_code == 200
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_schemas_and_grammars_are_compiled_off_the_event_loop(monkeypatch, client, model_id):
    """Any grammar, however short, is built (and its matcher made for its check) in a worker thread: the event
    loop serving every other client is not held up while it is. A grammar costs what it asks, not its length:
    13 characters (a{2000}{2000}) held the loop for 2.6 s, a short schema with twenty such patterns 7 s (security
    pass: every user's page and API waited)."""
    from llama_core import grammar
    from llama_core.serving.grammar_matcher import GrammarMatcher

    on_loop = []

    follow, check_start = grammar._follow_first_steps, GrammarMatcher.check_start
    monkeypatch.setattr(grammar, "_follow_first_steps",
                        lambda *a: on_loop.append(("built", on_event_loop())) or follow(*a))
    monkeypatch.setattr(GrammarMatcher, "check_start",
                        lambda self, *a: on_loop.append(("matcher", on_event_loop())) or check_start(self, *a))
    fields = {f"field_{i}": {"type": "integer", "description": "a number of the record " * 4} for i in range(60)}
    schema = {"type": "object", "properties": fields}
    client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "record", "schema": schema}})  # long
    client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4,
                                   response_format={"type": "json_object"})  # short
    client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=4, extra_body={"guided_regex": "a{3}"})
    client.responses.create(model=model_id, input="Good morrow", max_output_tokens=4, text={"format": {
        "type": "json_schema", "name": "word", "schema": {"type": "object", "properties": {"w": {"type": "string"}}}}})
    client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, tool_choice="required",
                                   tools=[WEATHER])
    assert ("built", False) in on_loop and ("matcher", False) in on_loop
    assert [step for step in on_loop if step[1]] == [], on_loop


def test_ignore_eos_runs_a_completion_to_max_tokens(client, model_id, served):
    eos = served[0].tokenizer.eos_id
    ended = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=60, temperature=0,
                                      logit_bias={str(eos): 100})  # EOS at once, unless it is never drawn
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 0
    ran = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=60, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert ran.choices[0].finish_reason == "length" and ran.usage.completion_tokens == 60


def test_completions_take_a_response_format_too(client, model_id):
    reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=12, n=3, seed=1, temperature=1.0,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "line", "schema": {"type": "integer", "maximum": 99999}}}})
    for choice in reply.choices:
        assert re.fullmatch(r"-?\d{1,5}", choice.text) and choice.finish_reason == "stop", choice


def test_a_predicted_json_reply_is_drafted_and_the_same(client, model_id, served):
    """Predicted outputs and structured outputs together, as for a JSON document edited a little."""
    info = served[0].info
    if not info.cpu_products or not info.cpu_products.startswith("llama_core"):
        pytest.skip("prompt lookup, which drafts from a prediction, is on by default only on llama_core's CPU kernels")
    ask = dict(model=model_id, messages=HELLO, max_tokens=120, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "lines", "schema": {"type": "object", "properties": {
            "lines": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 40}}},
            "required": ["lines"], "additionalProperties": False}}})
    plain = client.chat.completions.create(**ask)
    content = plain.choices[0].message.content
    predicted = client.chat.completions.create(**ask, prediction={"type": "content", "content": content})
    assert predicted.choices[0].message.content == content and json.loads(content)["lines"] is not None
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_logit_bias_bans_tokens_streamed_or_not(client, model_id, served):
    tokenizer = served[0].tokenizer
    ask = dict(model=model_id, prompt="ROMEO:", max_tokens=12, temperature=0)
    free = client.completions.create(**ask).choices[0].text
    first = tokenizer.encode("ROMEO:" + free, bos=True, eos=False)[len(tokenizer.encode("ROMEO:", bos=True,
                                                                                        eos=False))]
    banned = client.completions.create(**ask, logit_bias={str(first): -100}).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, logit_bias={str(first): -100},
                                                                           stream=True))
    assert banned != free and streamed == banned


# -- tools --------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
SUMMON = {"type": "function", "function": {"name": "summon", "parameters": {
    "type": "object", "properties": {"who": {"enum": ["ROMEO", "JULIET", "NURSE"]}}, "required": ["who"]}}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


def called(choice) -> tuple[str, dict]:
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    return call.function.name, json.loads(call.function.arguments)


def test_a_required_tool_call_follows_its_function_and_its_parameters(client, model_id):
    for seed in range(3):
        reply = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER, SUMMON], seed=seed,
                                               tool_choice="required", temperature=1.0, max_tokens=80)
        name, arguments = called(reply.choices[0])
        if name == "get_weather":
            assert set(arguments) == {"city"} and len(arguments["city"]) <= 20
        else:
            assert name == "summon" and arguments in ({"who": "ROMEO"}, {"who": "JULIET"}, {"who": "NURSE"})


def test_a_named_tool_is_the_one_called_and_none_calls_nothing(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER, SUMMON], max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "summon"}})
    assert called(reply.choices[0])[0] == "summon"
    plain = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           max_tokens=20, temperature=0)
    alone = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=20, temperature=0)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == alone.choices[0].message.content


def test_a_streamed_tool_call_is_the_unstreamed_one(client, model_id):
    ask = dict(model=model_id, messages=ASK, tools=[WEATHER, SUMMON], tool_choice="required", seed=5,
               temperature=1.0, max_tokens=80)
    whole = client.chat.completions.create(**ask)
    chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    deltas = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [called(whole.choices[0])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    # The SDK's stream helper finishes the call (its arguments.done event, parsed) and reads content null.
    with client.chat.completions.stream(**ask) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0].message
    assert [(d.name, json.loads(d.arguments)) for d in done] == [called(whole.choices[0])]
    assert final.content is None and final.tool_calls[0].function.name == done[0].name


def test_with_tools_and_a_response_format_a_reply_is_a_call_or_follows_the_format(client, model_id):
    """As OpenAI holds them together (an agent with tools and an output type sends both)."""
    verdict = {"type": "object", "properties": {"verdict": {"enum": ["ay", "nay"]}}, "required": ["verdict"],
               "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": verdict, "strict": True}}
    kinds = set()
    for seed in range(6):
        ask = dict(model=model_id, messages=ASK, tools=[WEATHER], response_format=response_format, seed=seed,
                   temperature=1.0, max_tokens=60)
        choice = client.chat.completions.create(**ask).choices[0]
        if choice.message.tool_calls:
            kinds.add("call")
            assert called(choice)[0] == "get_weather"
        else:
            kinds.add("format")
            assert json.loads(choice.message.content)["verdict"] in ("ay", "nay"), choice.message.content
        streamed = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == (choice.message.content or "")
    assert kinds, kinds
    required = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert called(required.choices[0])[0] == "get_weather"
    response = client.responses.create(model=model_id, input=ASK, tools=[{"type": "function", **WEATHER["function"]}],
                                       text={"format": {"type": "json_schema", "name": "verdict", "schema": verdict}},
                                       max_output_tokens=60, temperature=0)
    assert response.status == "completed" and response.output[0].type in ("message", "function_call")


def test_a_forced_call_is_a_call_whatever_stop_strings_it_holds_and_one_cut_short_is_no_text(served, client,
                                                                                                model_id):
    # With a stop string the call's JSON holds, a forced call came back as its text cut there, finish_reason
    # "stop"; one cut short by max_tokens came back as text ('{"name": "get_'), the server's format for calls.
    ask = dict(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    stopped = client.chat.completions.create(**ask, max_tokens=60, stop=[":", '"'])
    assert called(stopped.choices[0])[0] == "get_weather"
    for max_tokens in range(1, 16):
        whole = client.chat.completions.create(**ask, max_tokens=max_tokens).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, max_tokens=max_tokens, stream=True)]
        assert whole.finish_reason == chunks[-1].finish_reason == "length", (max_tokens, whole, chunks)
        assert not whole.message.content and not "".join(c.delta.content or "" for c in chunks), (max_tokens, whole)
        calls = [call for c in chunks for call in c.delta.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        if whole.message.tool_calls:  # the function told: its arguments as far as written
            (call,) = whole.message.tool_calls
            assert call.function.name == "get_weather"
            assert call.function.arguments == "" or call.function.arguments.startswith("{"), call
    named = [c.message.tool_calls for c in
             (client.chat.completions.create(**ask, max_tokens=n).choices[0] for n in range(1, 16))]
    assert all(named)  # one tool: told even before its name is written (it was no call then: QA)
    two = client.chat.completions.create(**dict(ask, tools=[WEATHER, SUMMON]), max_tokens=2).choices[0]
    assert two.finish_reason == "length" and not two.message.tool_calls and two.message.content == ""
    response = client.responses.create(model=model_id, input=ASK, tools=[{"type": "function", **WEATHER["function"]}],
                                       tool_choice="required", max_output_tokens=12, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete" and item.name == "get_weather"
    going_on = client.responses.create(model=model_id, previous_response_id=response.id, input="Go on.",
                                       max_output_tokens=4, temperature=0)  # the cut call kept as the text it was
    assert going_on.status in ("completed", "incomplete")
    events = list(client.responses.create(model=model_id, input=ASK, tools=[{"type": "function", **WEATHER["function"]}],
                                          tool_choice="required", max_output_tokens=12, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    assert streamed.status == "incomplete" and streamed.output[0].type == "function_call"
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [item.arguments]
    assert streamed.output[0].arguments == item.arguments


def test_a_call_cut_short_is_told_by_what_it_wrote():
    from llama_core.openai_api.schemas import Tool
    from llama_core.openai_api.tools import Call, call_made, check_tools, is_call

    functions = check_tools([Tool(**WEATHER), Tool(**SUMMON), Tool(**{**SUMMON, "function": {
        **SUMMON["function"], "name": "summon_all"}})])
    whole = '{"name": "get_weather", "arguments": {"city": "Verona"}}'
    assert call_made(whole, functions, "eos") == Call("get_weather", '{"city": "Verona"}')
    assert call_made(whole[:-7], functions, "length") == Call("get_weather", '{"city": "Ve', complete=False)
    assert call_made('{"name": "get_w', functions, "length") == Call("get_weather", "", complete=False)
    assert call_made('{"name": "summon', functions, "length") is None  # summon, or summon_all
    assert call_made('{"name": "summon"', functions, "stop") == Call("summon", "", complete=False)
    for cut in ("{", '{"na', '{"name": "', '{"name": "summon'):
        assert is_call(cut, functions) and call_made(cut, functions, "length") is None
        if cut != '{"name": "summon':  # where only one function can be called, it is the one cut short
            assert call_made(cut, functions[:1], "length") == Call("get_weather", "", complete=False)
    for text in ("Sunny.", '{"verdict": "ay"}', '{"name": "Romeo"}'):  # text, or JSON of a response format
        assert not is_call(text, functions) and call_made(text, functions, "eos") is None
    assert not is_call(whole, [])


def test_a_conversation_goes_on_after_a_tool_result(client, model_id):
    """The call and its result go back into the dialog; with tool_choice auto the reply is text or another
    call, and a text reply streams as it is written."""
    first = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, and 24 degrees"}]
    for seed in range(3):
        reply = client.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER], seed=seed,
                                               temperature=1.0, max_tokens=40)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert called(choice)[0] == "get_weather"
        else:
            assert choice.message.content and not choice.message.content.lstrip().startswith("{")
            streamed = [c for c in client.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER],
                                                                  seed=seed, temperature=1.0, max_tokens=40,
                                                                  stream=True) if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


def test_with_tools_a_text_reply_streams_as_written_and_a_call_is_sent_whole_at_its_end():
    from llama_core.openai_api.replies import ChatReply
    from llama_core.openai_api.schemas import Tool
    from llama_core.openai_api.streaming import Batch
    from llama_core.openai_api.tools import check_tools
    from llama_core.serving.events import StreamChunk

    class Ended:
        finish_reason = "eos"

    reply = ChatReply(None, "m", [Ended(), Ended()], 2, False, False, check_tools([Tool(**WEATHER)]))

    def event(index, *texts, done=False):
        found = reply.event(Batch(index, [StreamChunk(1, 0.0, text) for text in texts], done))
        return [(f["choices"][0]["delta"], f["choices"][0]["finish_reason"]) for f in found]

    assert event(0, " ") == []  # not yet known to be text
    assert event(0, "Sunny") == [({"role": "assistant", "content": " Sunny"}, None)]  # the role with the first
    assert event(0, ", in", " Verona") == [({"content": ", in Verona"}, None)]
    assert event(0, done=True) == [({}, "stop")]
    assert event(1, '{"name": "get_weather", ') == []
    assert event(1, '"arguments": {"city": "Verona"}}') == []
    (delta, finish), end = event(1, done=True)
    assert finish is None and delta["role"] == "assistant" and delta["content"] is None
    assert end == ({}, "tool_calls")  # the end in a chunk of its own, as OpenAI sends it
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Verona"}'}


def test_tool_turns_are_written_into_the_dialog_as_the_model_reads_them():
    from llama_core.openai_api.reading import llama_dialog
    from llama_core.openai_api.schemas import ChatMessage

    messages = [ChatMessage(**m) for m in [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}},
            {"id": "c2", "function": {"name": "get_weather", "arguments": '{"city": "Mantua"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"}]]
    dialog = llama_dialog(messages, "TOOLS")
    assert [m["role"] for m in dialog] == ["system", "user", "assistant", "user"]
    assert dialog[0]["content"] == "Be brief.\n\nTOOLS"
    assert dialog[2]["content"] == ('{"name": "get_weather", "arguments": {"city": "Verona"}}\n'
                                    '{"name": "get_weather", "arguments": {"city": "Mantua"}}')
    assert dialog[3]["content"] == "get_weather returned: Sunny\nget_weather returned: Rain"
    # The caller's own next user message (agent frameworks send one after the results; a tool result's content
    # may be text parts) goes on in the results' user turn instead of breaking the turns' alternation.
    messages[-1] = ChatMessage(role="tool", tool_call_id="c2", content=[{"type": "text", "text": "Ra"},
                                                                        {"type": "text", "text": "in"}])
    dialog = llama_dialog(messages + [ChatMessage(role="user", content="And tomorrow?")], "TOOLS")
    assert [m["role"] for m in dialog] == ["system", "user", "assistant", "user"]
    assert dialog[3]["content"] == "get_weather returned: Sunny\nget_weather returned: Rain\n\nAnd tomorrow?"


def test_tokenize_counts_a_chat_with_tools_as_the_chat_route_bills_it(served, client, model_id):
    url, headers = served[1].removesuffix("v1"), {"Authorization": f"Bearer {KEY}"}
    for choice in ("auto", "required"):
        reply = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER, SUMMON], max_tokens=1,
                                               tool_choice=choice)
        counted = httpx.post(url + "tokenize", json={"messages": ASK, "tools": [WEATHER, SUMMON], "tool_choice": choice},
                             headers=headers).json()
        assert counted["count"] == reply.usage.prompt_tokens, (counted["count"], reply.usage)
    bare = httpx.post(url + "tokenize", json={"messages": ASK}, headers=headers).json()
    assert bare["count"] < counted["count"]
    refused = httpx.post(url + "tokenize", json={"prompt": "x", "tools": [WEATHER]}, headers=headers)
    assert refused.status_code == 400 and error_of(refused)["param"] == "tools"


def test_a_user_message_after_tool_results_is_answered_on_both_apis(served, client, model_id):
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}, {"role": "user", "content": "And tomorrow?"}]
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
    response = client.responses.create(model=model_id, max_output_tokens=4, temperature=0, input=[
        *ASK, {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Verona"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}, {"role": "user", "content": "And tomorrow?"}])
    assert response.output_text == reply.choices[0].message.content  # the same dialog, the same greedy reply
    parts = client.responses.create(model=model_id, max_output_tokens=4, temperature=0, input=[
        *ASK, {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Verona"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Sun"},
                                                                     {"type": "input_text", "text": "ny"}]},
        {"role": "user", "content": "And tomorrow?"}])  # an output as text parts, as the SDK's types allow
    assert parts.output_text == response.output_text
    unknown = raw(served, "POST", "/responses", {"max_output_tokens": 4, "input": [
        *ASK, {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "Sunny"}]})
    assert unknown.status_code == 400 and error_of(unknown)["param"] == "input[2].call_id", unknown.text
    assert "call_id 'c2'" in error_of(unknown)["message"] and "input[1]" in error_of(unknown)["message"]


def test_any_order_of_roles_openai_takes_is_laid_out_as_llama_2s_turns():
    from llama_core.openai_api.reading import llama_dialog
    from llama_core.openai_api.schemas import ChatMessage

    def laid_out(*messages):
        return [(m["role"], m["content"]) for m in llama_dialog([ChatMessage(role=r, content=c) for r, c in messages])]

    # One role in a row is one turn; a system message after the start is the user's words in its place.
    assert laid_out(("user", "a"), ("user", "b")) == [("user", "a\n\nb")]
    assert laid_out(("system", "s"), ("developer", "t"), ("user", "a")) == [("system", "s\n\nt"), ("user", "a")]
    assert laid_out(("user", "a"), ("assistant", "b"), ("system", "c"), ("user", "d")) == [
        ("user", "a"), ("assistant", "b"), ("user", "c\n\nd")]
    assert laid_out(("user", "a"), ("assistant", "b"), ("assistant", "c"), ("user", "d")) == [
        ("user", "a"), ("assistant", "b\n\nc"), ("user", "d")]
    # A system prompt alone gets an empty user turn; an assistant's greeting first, one before it.
    assert laid_out(("system", "s")) == [("system", "s"), ("user", "")]
    assert laid_out(("system", "s"), ("assistant", "Hi"), ("user", "a")) == [
        ("system", "s"), ("user", ""), ("assistant", "Hi"), ("user", "a")]
    # The assistant's words last are the start of the reply.
    assert laid_out(("user", "a"), ("assistant", "Once")) == [("user", "a"), ("assistant", "Once")]


def test_a_reply_started_by_the_caller_is_continued(served, client, model_id):
    """The messages may end with the assistant's (a prefill): the reply is what the model writes after those
    words, as /v1/completions writes after the same Llama-2 layout; and orders Llama-2 has no turn for answer."""
    messages = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am"}]
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0)
    prompt = encode_dialog(served[0].tokenizer, messages)
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].text and reply.usage.prompt_tokens == len(prompt)
    # A start ending in white space (the layout leaves it out): what the reply writes of it again is left out, so
    # that start + reply reads as one text (it read "I am  a ..."), streamed or not.
    assert reply.choices[0].message.content.startswith(" ")
    for spaced in ("I am ",):
        messages[-1]["content"] = spaced
        after = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0)
        assert spaced + after.choices[0].message.content == "I am" + reply.choices[0].message.content
        streamed = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            after.choices[0].message.content
    for messages in (ASK + ASK, [{"role": "system", "content": "Be brief."}], [*ASK, {"role": "developer",
                                                                                          "content": "In verse."}]):
        assert client.chat.completions.create(model=model_id, messages=messages, max_tokens=2).choices[0].message
    refused = raw(served, "POST", "/chat/completions", {"messages": messages + [{"role": "assistant", "content": "{"}],
                                                         "response_format": {"type": "json_object"}})
    assert refused.status_code == 400 and error_of(refused)["param"] == "messages", refused.text


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "foo"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "x"}]}, "functions"),
    ({"tools": [WEATHER], "guided_regex": "ay|nay"}, "guided_regex"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "tool", "tool_call_id": "1", "content": "x"}]}, "messages[4].role"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{"}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "x"}]}, "messages[1].tool_calls[0].function.arguments"),
    # a result must name the call it answers (it was taken as the function's whatever it named, or none)
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "2", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "x"}, {"role": "user", "content": "y"},
                   {"role": "assistant", "tool_calls": [{"id": "2", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "x"}]}, "messages[5].tool_call_id"),  # an older call
])
def test_a_bad_tool_request_is_a_400_naming_the_field(served, body, param):
    response = raw(served, "POST", "/chat/completions", {"messages": ASK, **body})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text


def test_more_tools_than_a_grammar_may_hold_is_a_400_on_both_routes(served):
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(10)}}}} for i in range(1000)]
    response = raw(served, "POST", "/chat/completions", {"messages": ASK, "tools": many})
    assert response.status_code == 400 and error_of(response)["param"] == "tools", response.text
    flat = [{"type": "function", **tool["function"]} for tool in many]
    response = raw(served, "POST", "/responses", {"input": "Hi", "tools": flat})
    assert response.status_code == 400 and error_of(response)["param"] == "tools", response.text
    # More than OpenAI's 128 are refused before any schema is compiled (10,000 took 17 s of a CPU).
    response = raw(served, "POST", "/chat/completions", {"messages": ASK, "tools": many[:129]})
    assert response.status_code == 400 and "at most 128" in error_of(response)["message"], response.text


@pytest.mark.parametrize("extra, follows", [
    ({"guided_choice": ["ROMEO", "JULIET", 'the "NURSE"']}, lambda text: text in ("ROMEO", "JULIET", 'the "NURSE"')),
    ({"guided_regex": "(ay|nay), my lord[.!]"}, lambda text: re.fullmatch("(ay|nay), my lord[.!]", text)),
    ({"guided_json": {"type": "integer", "minimum": 0, "maximum": 99}}, lambda text: 0 <= json.loads(text) <= 99),
    ({"guided_json": '{"enum": ["sun", "moon"]}'}, lambda text: json.loads(text) in ("sun", "moon")),
    ({"guided_grammar": 'start: ("yes" | "no") "!"'}, lambda text: text in ("yes!", "no!")),
])
def test_vllms_guided_fields_hold_the_reply_on_both_routes(client, model_id, extra, follows):
    for seed in range(2):
        chat = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=20, temperature=1.0, seed=seed,
                                              extra_body=extra).choices[0]
        completion = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=20, temperature=1.0,
                                               seed=seed, extra_body=extra).choices[0]
        for choice, text in ((chat, chat.message.content), (completion, completion.text)):
            assert choice.finish_reason == "stop" and follows(text), text


def test_a_grammar_that_fails_after_its_start_is_the_requests_error_not_the_servers(served):
    """`a|[b-z]{2}a{1000000}` passes the check of its first steps (`a`) and the reply (two letters) then exceeds
    llguidance's lexer: a 400, and in a stream an error event of the same type (a 500 says a bug here)."""
    body = {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0, "guided_regex": "a|[b-z]{2}a{1000000}"}
    response = raw(served, "POST", "/completions", body)
    assert response.status_code == 400 and "lexer error" in error_of(response)["message"], response.text
    assert error_of(response)["type"] == "invalid_request_error"
    response = raw(served, "POST", "/completions", {**body, "stream": True})
    errors = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert response.status_code == 200 and errors and errors[-1]["error"]["type"] == "invalid_request_error", response.text


@pytest.mark.parametrize("body, param", [
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_json": "{"}, "guided_json"),
    ({"guided_json": "null"}, "guided_json"),
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a", "tools": [WEATHER]}, "guided_regex"),
])
def test_a_bad_or_second_guided_field_is_a_400_naming_it(served, body, param):
    for path, base in (("/chat/completions", {"messages": ASK}), ("/completions", {"prompt": "x"})):
        if "tools" in body and path == "/completions":
            continue
        response = raw(served, "POST", path, {**base, **body})
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text


# -- tokens ------------------------------------------------------------------------------------------------
def test_tokenize_counts_what_the_routes_then_bill_and_detokenize_reads_it_back(client, model_id, served):
    url = served[1].removesuffix("v1")
    headers = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "You are Juliet."}, {"role": "user", "content": "Good morrow!"}]
    counted = httpx.post(url + "tokenize", json={"messages": messages}, headers=headers).json()
    chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert counted["max_model_len"] == served[0].info.max_seq_len
    prompt = httpx.post(url + "tokenize", json={"prompt": "ROMEO: But soft"}, headers=headers).json()
    assert prompt["count"] == client.completions.create(model=model_id, prompt="ROMEO: But soft",
                                                        max_tokens=2).usage.prompt_tokens
    bare = httpx.post(url + "tokenize", json={"prompt": "ROMEO: But soft", "add_special_tokens": False},
                      headers=headers).json()
    assert bare["tokens"] == prompt["tokens"][1:]
    assert httpx.post(url + "detokenize", json={"tokens": bare["tokens"]},
                      headers=headers).json() == {"prompt": "ROMEO: But soft"}
    assert httpx.post(url + "tokenize", json={"prompt": "x"}).status_code == 401  # the API's key, as /v1


def test_token_id_prompts_are_taken_as_they_are_as_lm_evaluation_harness_sends_them(client, model_id, served):
    url, headers = served[1].removesuffix("v1"), {"Authorization": f"Bearer {KEY}"}
    text = "ROMEO: But soft"
    ids = httpx.post(url + "tokenize", json={"prompt": text}, headers=headers).json()["tokens"]  # BOS first
    by_text = client.completions.create(model=model_id, prompt=text, max_tokens=8, temperature=0, echo=True, logprobs=1)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=1)
    assert by_ids.choices[0].text == by_text.choices[0].text  # the same tokens: the same echo and reply
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    echoed, text_echoed = by_ids.choices[0].logprobs, by_text.choices[0].logprobs
    # Every given id is echoed, the first one (here BOS) with no log-probability: nothing precedes it.
    assert len(echoed.tokens) == len(text_echoed.tokens) + 1 and echoed.token_logprobs[0] is None
    assert echoed.token_logprobs[1:] == pytest.approx(text_echoed.token_logprobs, abs=1e-4)
    assert echoed.tokens[1:] == text_echoed.tokens
    # lm-evaluation-harness's local-completions: it finds /tokenizer_info, tokenizes without special tokens
    # and scores a batch of id prompts with echo, logprobs=1 and max_tokens=1.
    info = httpx.get(url + "tokenizer_info", headers=headers).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["model_max_length"] == served[0].info.max_seq_len
    bare = httpx.post(url + "tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers).json()
    assert bare["tokens"] == ids[1:]
    batch = [bare["tokens"], bare["tokens"][:3]]
    scored = client.completions.create(model=model_id, prompt=batch, max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert [c.index for c in scored.choices] == [0, 1]
    for prompt, choice in zip(batch, scored.choices):
        values = choice.logprobs.token_logprobs
        assert len(values) == len(prompt) + 1 and values[0] is None and all(v <= 0 for v in values[1:])
    for choice in scored.choices:  # the most likely token at each position, for lm-eval's "is greedy"
        tops = choice.logprobs.top_logprobs
        assert tops[0] is None and all(len(top) in (1, 2) for top in tops[1:])
        assert all(top[token] == pytest.approx(v, abs=1e-6) for token, v, top in
                   zip(choice.logprobs.tokens[1:], choice.logprobs.token_logprobs[1:], tops[1:]))
        assert all(v <= max(top.values()) + 1e-6 for v, top in zip(choice.logprobs.token_logprobs[1:], tops[1:]))
    # A greedy continuation scores as greedy at every position, one with another last token does not.
    greedy = [chunk.token for chunk in served[0].submit(bare["tokens"], 5, temperature=0)]
    continued = client.completions.create(model=model_id, prompt=[bare["tokens"] + greedy, bare["tokens"] + greedy[:-1] + [
        (greedy[-1] + 1) % 256]], max_tokens=1, temperature=0, echo=True, logprobs=1)
    for choice, expected in zip(continued.choices, (True, False)):
        values, tops = choice.logprobs.token_logprobs[-6:-1], choice.logprobs.top_logprobs[-6:-1]
        assert all(v >= max(top.values()) - 1e-4 for v, top in zip(values, tops)) == expected
    # Without BOS the model reads the tokens differently: the same ids after BOS score otherwise.
    assert scored.choices[0].logprobs.token_logprobs[1:-1] != pytest.approx(echoed.token_logprobs[2:], abs=1e-3)
    assert httpx.get(url + "tokenizer_info").status_code == 401  # behind the API's key, as /v1


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, model_id):
    """The GPT-3 scoring call (vLLM takes it too): the prompt's tokens and logprobs, nothing written."""
    for prompts in ("ROMEO: But soft", ["ROMEO: But soft", [5, 9, 13]]):
        scored = client.completions.create(model=model_id, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
        once = client.completions.create(model=model_id, prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
        assert scored.usage.completion_tokens == 0 and scored.usage.total_tokens == once.usage.prompt_tokens
        for choice, longer in zip(scored.choices, once.choices):
            assert choice.finish_reason == "length" and longer.text.startswith(choice.text)
            assert choice.logprobs.tokens == longer.logprobs.tokens[:-1]
            assert choice.logprobs.token_logprobs == pytest.approx(longer.logprobs.token_logprobs[:-1], abs=1e-5)
        streamed = list(client.completions.create(model=model_id, prompt=prompts, max_tokens=0, echo=True, stream=True))
        assert sorted("".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
                      for i in range(len(scored.choices))) == sorted(c.text for c in scored.choices)
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=0)


def test_an_empty_prompt_is_continued_from_bos_as_openai_takes_it(client, model_id):
    for prompt in ("", [""]):
        reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
        assert reply.usage.prompt_tokens == 1 and reply.usage.completion_tokens == 6 and reply.choices[0].text


@pytest.mark.parametrize("prompt, says", [
    ([1, 10**6], "prompt[1] is 1000000"), ([[1, 2], [3, -1]], "prompt[1][1] is -1"), ([[]], "prompt[0] is empty"),
    ([1, "a"], "prompt[0] is int"), ([True], "prompt[0] is bool"), ([[1, 2], 3], "prompt[1] is int"),
    ([[1.5]], "prompt[0][0] is 1.5"),
])
def test_bad_token_id_prompts_are_400s_saying_what(served, prompt, says):
    response = raw(served, "POST", "/completions", {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and error_of(response)["param"] == "prompt", response.text
    assert says in error_of(response)["message"], response.text


@pytest.mark.parametrize("path, body, param", [
    ("tokenize", {}, "prompt"),
    ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("tokenize", {"messages": []}, "messages"),
    ("tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("tokenize", {"prompt": "\ud800"}, "prompt"),
    ("detokenize", {"tokens": [10**6]}, "tokens"),
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize", {"tokens": "x"}, "tokens"),
])
def test_bad_token_requests_are_400s_naming_the_field(served, path, body, param):
    response = httpx.post(served[1].removesuffix("v1") + path, content=json.dumps(body),
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text


# -- the Responses API ------------------------------------------------------------------------------------
def test_a_response_is_the_chat_reply_to_the_same_dialog(client, model_id):
    response = client.responses.create(model=model_id, input="Good morrow, what news?", instructions="You are Juliet.",
                                       max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(model=model_id, max_tokens=30, temperature=0, messages=[
        {"role": "system", "content": "You are Juliet."}, {"role": "user", "content": "Good morrow, what news?"}])
    assert response.status == "completed" and response.output[0].type == "message"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    # The response reports what it was sampled with: the given temperature, Llama-2's top_p where absent.
    assert (response.temperature, response.top_p, response.parallel_tool_calls) == (0, 0.9, True)
    unparallel = client.responses.create(model=model_id, input="Hi", max_output_tokens=2, parallel_tool_calls=False)
    assert (unparallel.temperature, unparallel.parallel_tool_calls) == (0.6, False)


def test_a_streamed_response_sends_its_events_in_order_and_the_same_text(client, model_id):
    ask = dict(model=model_id, input=[{"role": "user", "content": [{"type": "input_text", "text": "Speak."}]}],
               max_output_tokens=24, temperature=0.9, extra_body={"seed": 4})
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_a_response_cut_by_max_output_tokens_is_incomplete(client, model_id):
    ask = dict(model=model_id, input="Tell me of the king and his court.", max_output_tokens=3, temperature=0)
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.completed_at is None  # the message cut, as OpenAI marks it
    last = list(client.responses.create(**ask, stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.output[0].status == "incomplete"
    done = client.responses.create(model=model_id, input="Speak.", max_output_tokens=200, temperature=0)
    assert done.status == done.output[0].status == "completed" and done.completed_at >= done.created_at


def test_the_sdk_parses_a_response_into_its_pydantic_model_whole_or_streamed(client, model_id):
    parsed = client.responses.parse(model=model_id, input="Who speaks?", text_format=Verse, max_output_tokens=120,
                                    extra_body={"seed": 1}, temperature=1.0)
    assert isinstance(parsed.output_parsed, Verse)
    with client.responses.stream(model=model_id, input="Who speaks?", text_format=Verse, max_output_tokens=120,
                                 extra_body={"seed": 1}, temperature=1.0) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_parsed == parsed.output_parsed


def test_a_response_calls_a_function_and_goes_on_from_its_output(client, model_id):
    weather = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model=model_id, input="Weather in Verona?", tools=[weather],
                                    tool_choice="required", max_output_tokens=60, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(model=model_id, input="Weather in Verona?", tools=[weather],
                                          tool_choice="required", max_output_tokens=60, temperature=0, stream=True))
    assert [e.type for e in events][2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]
    assert events[-1].response.output[0].arguments == call.arguments
    then = client.responses.create(model=model_id, tools=[weather], max_output_tokens=20, temperature=0, input=[
        {"role": "user", "content": "Weather in Verona?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert then.status in ("completed", "incomplete") and then.output


def test_a_stored_response_is_read_back_and_goes_on_as_the_chat_would(client, model_id):
    first = client.responses.create(model=model_id, input="Good morrow!", max_output_tokens=10, temperature=0)
    then = client.responses.create(model=model_id, input="And what news?", previous_response_id=first.id,
                                   max_output_tokens=10, temperature=0)
    chat = client.chat.completions.create(model=model_id, max_tokens=10, temperature=0, messages=[
        {"role": "user", "content": "Good morrow!"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And what news?"}])
    assert then.output_text == chat.choices[0].message.content and then.previous_response_id == first.id
    assert then.usage.input_tokens == chat.usage.prompt_tokens and first.store and then.store
    assert client.responses.retrieve(first.id).output_text == first.output_text
    streamed = list(client.responses.create(model=model_id, input="Speak.", max_output_tokens=5, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == streamed[-1].response.output_text
    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model=model_id, input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = client.responses.create(model=model_id, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_function_call_stored_goes_on_from_its_output_alone(client, model_id):
    """The stored conversation ends with the call, so the next request sends only the call's output."""
    weather = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model=model_id, input="Weather in Verona?", tools=[weather], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    (made,) = first.output
    answered = client.responses.create(model=model_id, tools=[weather], max_output_tokens=10, temperature=0,
                                       previous_response_id=first.id, input=[
                                           {"type": "function_call_output", "call_id": made.call_id, "output": "Sunny"}])
    assert answered.status in ("completed", "incomplete") and answered.output


def test_the_stores_size_is_kept():
    from llama_core.openai_api.errors import APIError
    from llama_core.openai_api.responses import ResponseStore, Stored

    store = ResponseStore(size=2)
    for i in range(3):
        store.put(f"resp_{i}", Stored([], {"id": f"resp_{i}"}))
    assert store.get("resp_2").response == {"id": "resp_2"}
    with pytest.raises(APIError, match="keeps its last 2 stored responses"):
        store.get("resp_0")


def test_the_store_holds_so_many_messages_in_all_the_newest_response_whatever_it_holds():
    # Stored responses were bounded by count alone: 8 MiB of empty input messages kept ~150 MB a response, and
    # 256 of them more memory than the machine had (reliability pass).
    from llama_core.openai_api.responses import ResponseStore, Stored
    from llama_core.openai_api.schemas import ChatMessage

    said = [ChatMessage(role="user", content="hi")]
    store = ResponseStore(size=10, messages=5)
    for i, count in enumerate((2, 2, 1)):
        store.put(f"resp_{i}", Stored(said * count, {"id": f"resp_{i}"}))
    assert [store.get(f"resp_{i}").response["id"] for i in range(3)] == ["resp_0", "resp_1", "resp_2"]
    store.put("resp_3", Stored(said * 3, {}))  # 8 messages: the oldest go until 5 are left
    assert [i for i in range(4) if f"resp_{i}" in store._kept] == [2, 3]
    store.delete("resp_2")
    store.put("resp_4", Stored(said * 9, {}))  # over the bound alone: kept, alone
    assert list(store._kept) == ["resp_4"]
    store.put("resp_5", Stored(said, {}))
    assert list(store._kept) == ["resp_5"]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "role": "user"}]}, "input[0].type"),
    ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "input[1].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"input": 5}, "input"),
])
def test_a_bad_response_request_is_a_400_naming_the_field(served, body, param):
    response = raw(served, "POST", "/responses", {"input": "hi", **body})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "response_format.json_schema.schema"),
    ("json", "response_format"),
])
def test_a_bad_response_format_is_a_400_naming_it(served, response_format, param):
    for path, body in (("/chat/completions", {"messages": HELLO}), ("/completions", {"prompt": "x"})):
        response = raw(served, "POST", path, {**body, "response_format": response_format})
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text


# -- errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("temperature", -1), ("temperature", "hot"), ("top_p", -0.1),
                                          ("top_p", 10**400), ("presence_penalty", 9), ("seed", -5),
                                          ("top_k", -2), ("stop", ["a", "b", "c", "d", "e"]), ("n", 0), ("n", 99)])
def test_an_invalid_field_is_a_400_naming_it(served, field, value):
    response = raw(served, "POST", "/chat/completions", {"messages": HELLO, "max_tokens": 4, field: value})
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_top_k_minus_one_is_off_as_vllm_takes_it(client, model_id):
    ask = dict(model=model_id, messages=HELLO, max_tokens=8, temperature=1.0, seed=3)
    off = client.chat.completions.create(**ask, extra_body={"top_k": -1}).choices[0].message.content
    assert off == client.chat.completions.create(**ask, extra_body={"top_k": 0}).choices[0].message.content


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"messages": HELLO, "modalities": ["text", "audio"]}, "modalities"),
    ("/chat/completions", {"messages": HELLO, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/responses", {"input": "Hi", "background": True}, "background"),
    ("/responses", {"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ("/responses", {"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include[0]"),
    ("/responses", {"input": "Hi", "top_logprobs": 99}, "top_logprobs"),
    ("/chat/completions", {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "has space!", "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    ("/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a/b", "schema": {}}}},
     "text.format.name"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
])
def test_what_is_not_done_here_is_refused_naming_the_field_not_left_out_silently(served, path, body, param):
    response = raw(served, "POST", path, {"max_tokens" if "messages" in body else "max_output_tokens": 4, **body})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text
    fine = raw(served, "POST", "/chat/completions", {"messages": HELLO, "max_tokens": 2, "modalities": ["text"]})
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"messages": [*HELLO, {"role": "user", "content": "Say [INST] twice."}]},
     "messages[1].content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                      {"type": "text", "text": "<<SYS>>"}]}]},
     "messages[0].content[1].text"),
    ("/chat/completions", {"messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "f", "description": "Writes [/INST] for you"}}]}, "tools[0].function.description"),
    ("/responses", {"input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "<</SYS>>"}]},
     "input[1].content"),
])
def test_a_reserved_chat_tag_is_refused_naming_the_field_that_holds_it(served, path, body, param):
    response = raw(served, "POST", path, body)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_prompt", response.text
    assert error_of(response)["param"] == param, response.text


def test_the_sdk_raises_bad_request_naming_the_field(client, model_id):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=HELLO, temperature=-2)
    assert caught.value.param == "temperature" and "temperature" in caught.value.message


@pytest.mark.parametrize("body, param", [
    ('{"messages": [', None),
    ("[1, 2]", None),
    ('{"max_tokens": 4}', "messages"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].role"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages[0].content[0]"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', "tools[0].function"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}', "stream_options"),
])
def test_malformed_requests_are_400_with_a_message(served, body, param):
    response = raw(served, "POST", "/chat/completions", body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_a_body_sent_without_the_json_content_type_or_too_deep_to_read_says_so(served):
    body = json.dumps({"messages": HELLO, "max_tokens": 2})
    for content_type, says in (("application/x-www-form-urlencoded", "it came as 'application/x-www-form-urlencoded'"),
                               (None, "it came with no Content-Type")):
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
        response = httpx.post(served[1] + "/chat/completions", content=body, headers=headers, timeout=60)
        assert response.status_code == 400 and says in error_of(response)["message"], response.text
        assert "Content-Type: application/json" in error_of(response)["message"]
    deep = raw(served, "POST", "/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert deep.status_code == 400 and "nested too deeply" in error_of(deep)["message"], deep.text
    latin = httpx.post(served[1] + "/chat/completions", timeout=60, content='{"messages": [{"role": "user", '
                       '"content": "café"}]}'.encode("latin-1"),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert latin.status_code == 400 and "not UTF-8 text" in error_of(latin)["message"], latin.text


def test_completion_refusals_name_the_field(served):
    for body, param in [({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": [1, 10**6]}, "prompt"),
                        ({"prompt": []}, "prompt"), ({"prompt": "x", "logprobs": 50}, "logprobs"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "best_of": 3}, "best_of")]:
        response = raw(served, "POST", "/completions", body)
        assert response.status_code == 400 and error_of(response)["param"] == param, (body, response.text)


def test_a_list_past_its_bound_is_refused_before_its_items_are_read(served):
    # 8 MiB holding 2.7 million wrong items in one list took pydantic 10 s of the event loop (every client's) to
    # list 2.7 million errors (security re-test). Each list is bounded first: one error, the counts in it.
    body = {"messages": [[]] * 20_000}
    response = raw(served, "POST", "/chat/completions", body)
    assert response.status_code == 400 and error_of(response)["param"] == "messages"
    assert error_of(response)["message"].startswith("messages: holds 20,000 items; at most 10,000 are taken")
    response = raw(served, "POST", "/responses", {"input": [[]] * 20_000})
    assert response.status_code == 400 and error_of(response)["param"] == "input", response.text
    response = raw(served, "POST", "/chat/completions", {"messages": ASK, "stop": ["x"] * 2_000})
    assert response.status_code == 400 and error_of(response)["param"] == "stop", response.text


def test_a_list_of_wrong_items_within_its_bound_is_refused_at_the_first(served):
    # 400 lists of 10,000 wrong parts each (8 MiB) held the event loop 58 s while pydantic listed 4 million errors.
    response = raw(served, "POST", "/chat/completions", {"messages": [{"role": "user", "content": [1] * 10_000}] * 100})
    assert response.status_code == 400 and error_of(response)["param"] == "messages[0].content", response.text
    more = re.search(r"\(and (\d+) more problems?\)", error_of(response)["message"])
    assert more is None or int(more.group(1)) < 10, error_of(response)["message"]
    response = httpx.post(served[1].removesuffix("v1") + "detokenize", json={"tokens": ["a"] * 100_000},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400 and "more problem" not in error_of(response)["message"], response.text


def test_a_prompt_longer_than_the_context_is_refused(client, model_id, served):
    long = "word " * served[0].info.max_seq_len * 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": long}])
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_id, prompt=long)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError, match=r"the input takes [\d,]+ tokens.* shorten it to") as caught:
        client.responses.create(model=model_id, input=long)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "input"
    # Past the characters any field takes (before counting its tokens), the code a client truncates on is the same.
    huge = "word " * 30_000
    with pytest.raises(openai.BadRequestError, match="150,000 characters") as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": huge}])
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages[0].content"


def test_max_tokens_beyond_the_context_runs_to_its_end(client, model_id, served):
    reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=10**6, temperature=1.0, seed=1,
                                      top_p=1.0)
    limit = served[0].info.max_seq_len
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= limit


def test_keys_are_required_and_checked(served, model_id):
    for key in (None, "wrong-key"):
        response = raw(served, "GET", "/models", key=key)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"  # the scheme a key goes in (RFC 6750)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[1], api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=served[1], api_key=OTHER_KEY, max_retries=0).models.list().data


def test_unknown_model_and_route_are_404(client, served):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    response = raw(served, "POST", "/embeddings", {"input": "x"})
    assert response.status_code == 404 and error_of(response)["code"] == "unknown_url"


# -- a busy engine, and clients that leave -----------------------------------------------------------------
@pytest.fixture(scope="module")
def one_slot():
    """An API on an engine with one slot and one place in its queue, whose steps are slowed to 20 ms so that
    a request stays in flight while the test looks at it."""
    build = app_server.engine_build(max_seq_len=256, max_batch_size=1)
    engine = Engine(load(**build), seed=0, max_waiting=1, after_turn=lambda: time.sleep(0.02)).start()
    try:
        with serve_api(engine) as url:
            yield engine, url
    finally:
        engine.close()


def wait_for(condition, seconds: float = 1.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_streamed_reply_lists_the_tokens_of_its_text_as_the_whole_reply_does(one_slot):
    """Tokens held back as the start of a possible stop string are listed with the text they write, not
    sent ahead with none: where they wrote only the stop string, the stream leaves them out, as the
    whole reply does. (One token a turn here: each comes in an event of its own.)"""
    engine, url = one_slot
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    ask = dict(model=engine.info.name, messages=HELLO, max_tokens=24, temperature=0, logprobs=True,
               logit_bias={str(engine.eos_id): -100})
    full = client.chat.completions.create(**ask).choices[0]
    text, tokens = full.message.content, [entry.token for entry in full.logprobs.content]
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    assert len(stop) == 5 and text.index(stop) == len(text) // 2
    whole = client.chat.completions.create(**ask, stop=[stop]).choices[0]
    streamed, entries = "", []
    for event in client.chat.completions.create(**ask, stop=[stop], stream=True):
        for choice in event.choices:
            streamed += choice.delta.content or ""
            entries += [entry.token for entry in (choice.logprobs.content if choice.logprobs else None) or []]
    assert streamed == whole.message.content == text[: len(text) // 2]
    assert entries == [entry.token for entry in whole.logprobs.content] == tokens[: len(entries)]
    assert "".join(entries).startswith(streamed)  # the last token may write the stop's start too


def test_more_choices_than_the_server_ever_holds_is_a_400_not_busy(one_slot):
    engine, url = one_slot  # one slot, one waiting place: two requests at most
    response = httpx.post(url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"messages": HELLO, "n": 3, "max_tokens": 2})
    assert response.status_code == 400 and error_of(response)["param"] == "n"
    assert "more than this server holds at once (2" in error_of(response)["message"]
    response = httpx.post(url + "/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert response.status_code == 400 and error_of(response)["param"] == "n"
    ok = httpx.post(url + "/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                    json={"prompt": "ROMEO:", "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_full_queue_is_503_and_leaving_clients_free_their_places(one_slot):
    engine, url = one_slot
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    running = client.chat.completions.create(model=engine.info.name, messages=HELLO, max_tokens=200,
                                             temperature=1.0, top_p=1.0, stream=True,
                                             logit_bias={str(engine.eos_id): -100})  # no early end, whatever its seed
    next(iter(running))  # its first event, sent once the engine has the request (maybe still queued)
    assert wait_for(lambda: engine.active_count == 1, 5)  # then it holds the engine's one slot

    def waiting_request():  # a non-streaming client that gives up after 0.5 s
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(url + "/completions", json={"prompt": "ROMEO:", "max_tokens": 50},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)

    waiter = threading.Thread(target=waiting_request)
    waiter.start()
    assert wait_for(lambda: engine.waiting_count == 1, 5)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=engine.info.name, prompt="ROMEO:", max_tokens=5)
    assert caught.value.status_code == 503 and caught.value.code == "server_busy"
    waiter.join()
    assert wait_for(lambda: engine.waiting_count == 0), "the abandoned request kept its place in the queue"
    assert engine.active_count == 1  # the streaming request goes on
    running.close()  # the streaming client leaves
    assert wait_for(lambda: engine.active_count == 0), "the abandoned stream kept its slot"
    reply = client.completions.create(model=engine.info.name, prompt="ROMEO:", max_tokens=3)
    assert reply.choices[0].text is not None


def test_the_api_names_each_requests_client_by_its_key_or_else_its_address(one_slot, monkeypatch):
    """The engine's fair admission tells clients apart by the API key they send (by its place in the list: the
    secret stays out of the engine), or with no keys set, by their address."""
    engine, url = one_slot
    clients, add = [], engine.add
    monkeypatch.setattr(engine, "add", lambda request, channel: (clients.append(request.client), add(request, channel)))
    for key in (KEY, OTHER_KEY):
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        client.chat.completions.create(model=engine.info.name, messages=HELLO, max_tokens=2)
        client.completions.create(model=engine.info.name, prompt="ROMEO:", max_tokens=2)
        client.responses.create(model=engine.info.name, input="Good morrow", max_output_tokens=2)
    with serve_api(engine, api_keys=()) as open_url:
        assert httpx.post(open_url + "/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200
    assert clients == ["key:0"] * 3 + ["key:1"] * 3 + ["address:127.0.0.1"]


def test_a_bug_is_a_500_in_the_api_shape_and_the_server_keeps_serving(one_slot, monkeypatch):
    engine, url = one_slot

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    response = httpx.post(url + "/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 500 and error_of(response)["type"] == "server_error"
    monkeypatch.undo()
    models = httpx.get(url + "/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200


def test_an_engine_that_stopped_makes_health_503():
    build = app_server.engine_build(max_seq_len=64, max_batch_size=1)
    engine = Engine(load(**build), seed=0).start()
    try:
        with serve_api(engine) as url:
            health = url.removesuffix("v1") + "health"
            assert httpx.get(health).status_code == 200
            engine.close()
            response = httpx.get(health)
            assert response.status_code == 503 and response.json()["status"] == "stopped"
            failed = httpx.post(url + "/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
            assert failed.status_code == 503 and error_of(failed)["message"]
    finally:
        engine.close()


def test_server_sent_events_end_with_done(served):
    with httpx.stream("POST", served[1] + "/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)


def test_logins_protect_the_page_and_keys_the_api_on_one_server():
    """--auth and --api-key together: the page and its Gradio API ask for the login, /v1 for a key, /health
    for nothing."""
    from gradio_client import Client

    with app_server.serve_app(max_seq_len=64, max_batch_size=1, api_keys=(KEY,), auth=[("ann", "s3cret")]) as (_, url):
        assert httpx.get(url + "config", timeout=10).status_code == 401
        # Gradio's API checks the login on the event loop (server.check_logins_on_the_loop), and still checks it
        call = httpx.post(url + "gradio_api/call/complete", json={"data": ["ROMEO:", 0.0, 0.9, 4, False, False]},
                          timeout=10)
        assert call.status_code == 401 and "Not authenticated" in call.text
        assert httpx.get(url + "health", timeout=10).status_code == 200
        assert httpx.get(url + "v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
        with pytest.raises(Exception):
            Client(url, verbose=False, auth=("ann", "wrong"))
        # Wrong logins take turns, one a second (Gradio answered 100 in 1.6 s); a right one is let in after them.
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            tries = list(pool.map(lambda i: httpx.post(url + "login", data={"username": "ann", "password": f"guess{i}"},
                                                       timeout=30).status_code, range(4)))
        assert tries == [400] * 4 and time.monotonic() - started >= 3.0
        text, _, _ = Client(url, verbose=False, auth=("ann", "s3cret")).predict(
            "ROMEO:", 0.0, 0.9, 4, False, False, api_name="/complete")
        assert text
        # Refused before a body is read (security pass: an 8 MiB body sent with no key or login held the event
        # loop, every user's page and API, for seconds before its 401): the key from the headers alone, so a body
        # that is not even JSON gets the 401, not a 400 ...
        bad = httpx.post(url + "v1/chat/completions", content=b"{not json", timeout=10,
                         headers={"content-type": "application/json"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert bad.headers["www-authenticate"] == "Bearer"
        keyed = httpx.post(url + "v1/chat/completions", content=b"{not json", timeout=10,
                           headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 400 and "not valid JSON" in keyed.json()["error"]["message"]
        assert httpx.get(url + "v1/docs", timeout=10).status_code == 200  # the API's description, as before
        assert httpx.get(url + "v1/unknown", timeout=10).status_code == 401  # any other /v1 path needs the key
        # ... and the page's routes take no more than a login form's worth from a client not logged in
        lists = ("[" + ",".join(["[]"] * 40_000) + "]").encode()  # 120 KB
        for route in ("gradio_api/cancel", "gradio_api/call/complete", "gradio_api/queue/join"):
            refused = httpx.post(url + route, content=lists, headers={"content-type": "application/json"}, timeout=10)
            assert refused.status_code == 413, (route, refused.status_code, refused.text[:200])
        with httpx.Client(base_url=url, timeout=30) as browser:
            assert browser.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 200
            long_prompt = browser.post("gradio_api/call/complete", json={"data": ["ROMEO: " * 20_000, 0.0, 0.9, 4,
                                                                                  False, False]})
            assert long_prompt.status_code == 200 and "event_id" in long_prompt.json()  # logged in: the usual room
            assert browser.post("gradio_api/cancel", content=lists,
                                headers={"content-type": "application/json"}).status_code == 413  # a few ids


def test_usage_reports_the_prompt_tokens_the_cache_held(client, model_id):
    """The same conversation again (a chat's next turn sends it all): its prompt comes from the prefix cache,
    all but the tokens that must be computed for the first logits."""
    messages = [{"role": "system", "content": "You are Juliet, and you answer in verse."},
                {"role": "user", "content": "What light through yonder window breaks?"}]
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens - 2 <= cached < again.usage.prompt_tokens


def test_usage_reports_the_drafted_tokens_the_reply_kept_as_accepted_predictions(client, model_id, served):
    info = served[0].info
    if not info.cpu_products or not info.cpu_products.startswith("llama_core"):
        pytest.skip("prompt lookup is on by default only on llama_core's CPU kernels")
    reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=200, temperature=0)
    details = reply.usage.completion_tokens_details
    assert 0 < details.accepted_prediction_tokens < reply.usage.completion_tokens
    assert details.rejected_prediction_tokens >= 0
    chunks = list(client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=200, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-1].usage.completion_tokens_details == details  # the same drafts: the engine's price is fixed


def test_a_prediction_gives_the_same_reply_its_right_tokens_drafted(client, model_id, served):
    """OpenAI's predicted outputs: the reply is the model's own either way; a prediction that is the reply
    has its tokens drafted and kept, and an edited one leaves a seeded sampled reply as it is without."""
    info = served[0].info
    if not info.cpu_products or not info.cpu_products.startswith("llama_core"):
        pytest.skip("prompt lookup, which drafts from a prediction, is on by default only on llama_core's CPU kernels")
    messages = [{"role": "user", "content": "Tell me of the king and his court."}]
    plain = client.chat.completions.create(model=model_id, messages=messages, max_tokens=60, temperature=0)
    reply = plain.choices[0].message.content
    predicted = client.chat.completions.create(model=model_id, messages=messages, max_tokens=60, temperature=0,
                                               prediction={"type": "content", "content": reply})
    details = predicted.usage.completion_tokens_details
    assert predicted.choices[0].message.content == reply and reply
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    sampled = dict(model=model_id, messages=messages, max_tokens=60, temperature=0.9, seed=3)
    parts = [{"type": "text", "text": reply.replace("the", "a")[:20]}, {"type": "text", "text": reply[20:]}]
    assert (client.chat.completions.create(**sampled, prediction={"type": "content", "content": parts})
            .choices[0].message.content == client.chat.completions.create(**sampled).choices[0].message.content)


@pytest.mark.parametrize("prediction, named", [
    ({"type": "image", "content": "x"}, "prediction.type must be 'content'"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0] is a 'image_url' part"),
    ({"type": "content", "content": 7}, "prediction"),
    ({"type": "content", "content": "x" * 100_001}, "prediction.content is too long"),
])
def test_a_bad_prediction_is_refused_naming_it(client, model_id, prediction, named):
    with pytest.raises(openai.BadRequestError, match=re.escape(named)):
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, prediction=prediction)


def test_a_stream_whose_model_process_dies_ends_with_an_error_and_serving_resumes():
    """The web server reads streams on its event loop, woken by the engine's events: the model process dying
    mid-reply ends the reply with an error event (not a hang), and once the process is restarted the server
    answers again."""
    import os
    import signal

    with app_server.serve_app(max_seq_len=256, max_batch_size=2) as (engine, url):
        body = {"prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "stream": True,  # greedy: 200 tokens
                "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        os.kill(engine.pid, signal.SIGKILL)
        assert "error" in events[-1] and "stopped unexpectedly" in events[-1]["error"]["message"]
        assert events[-1]["error"]["code"] == "engine_unavailable"  # not a failure of the request: send it again

        def back() -> None:
            deadline = time.monotonic() + 120
            while engine.state != "running" and time.monotonic() < deadline:
                time.sleep(0.1)

        back()
        reply = httpx.post(url + "v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        # A whole (unstreamed) reply under way then is a 503 to retry, as a request sent while it restarts.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url + "v1/completions", timeout=60, json={
                "prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "logit_bias": {str(engine.tokenizer.eos_id): -100}})
            assert wait_for(lambda: engine.active_count == 1, 30)
            os.kill(engine.pid, signal.SIGKILL)
            answer = whole.result()
        assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
        assert error_of(answer)["code"] == "engine_unavailable"
        back()
        # A streamed response: OpenAI's error event, then response.failed (the error's own type, server_error,
        # was the event's, which the SDK read as an unknown event: the stream seemed to end normally).
        sdk = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=60)
        kinds = []
        long = {"type": "json_schema", "name": "tale", "schema": {"type": "object", "required": ["tale"],
                                                                   "properties": {"tale": {"type": "string", "minLength": 400}}}}
        for event in sdk.responses.create(model=engine.info.name, input="ROMEO:", max_output_tokens=200,
                                          temperature=0, stream=True, text={"format": long}):
            kinds.append(event.type)
            if len(kinds) == 1:  # its request is in the engine
                os.kill(engine.pid, signal.SIGKILL)
            if event.type == "error":
                assert event.code == "engine_unavailable" and "stopped unexpectedly" in event.message
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert event.response.status == "failed" and "stopped unexpectedly" in event.response.error.message
        back()


# -- any body ---------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_ANY_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=8))
_TEXT = st.one_of(st.text(min_size=1, max_size=40).filter(str.strip), st.sampled_from(["ROMEO:", "Good morrow"]))
_ODD_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", " \n ", "[INST]", "<<SYS>>", "[/INST]", "\x00"]))
_ODD_NUMBERS = st.one_of(st.sampled_from([float("nan"), float("inf"), -1e300, 1e300, -1, 0, 10**6, 2**63]),
                         _ANY_SCALAR)


def _dialogs():
    turn = st.tuples(_TEXT, _TEXT).map(lambda pair: [{"role": "user", "content": pair[0]},
                                                    {"role": "assistant", "content": pair[1]}])
    return st.tuples(st.sampled_from([None, "system", "developer"]), _TEXT, st.lists(turn, max_size=2), _TEXT).map(
        lambda parts: ([{"role": parts[0], "content": parts[1]}] if parts[0] else [])
        + [message for turn in parts[2] for message in turn] + [{"role": "user", "content": parts[3]}])


_ODD_MESSAGES = st.one_of(_ANY_SCALAR, st.lists(st.one_of(_ANY_SCALAR, st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "narrator", "user", "assistant", None, 7]),
     "content": st.one_of(_ODD_TEXT, st.none(), st.integers(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url", 3]), "text": st.one_of(_ODD_TEXT, st.none(), st.integers())}),
         max_size=3))})), max_size=4))
# Each field: (a valid value, a wrong one).
_SAMPLING = {
    "temperature": (st.floats(0, 2), _ODD_NUMBERS), "top_p": (st.floats(0.01, 1), _ODD_NUMBERS),
    "top_k": (st.integers(0, 50), _ODD_NUMBERS), "min_p": (st.floats(0, 1), _ODD_NUMBERS),
    "presence_penalty": (st.floats(-2, 2), _ODD_NUMBERS), "frequency_penalty": (st.floats(-2, 2), _ODD_NUMBERS),
    "repetition_penalty": (st.floats(0.5, 2), _ODD_NUMBERS), "seed": (st.integers(0, 2**31), _ODD_NUMBERS),
    "n": (st.integers(1, 3), _ODD_NUMBERS), "max_tokens": (st.integers(1, 8), _ODD_NUMBERS),
    "stop": (st.lists(_TEXT, max_size=4), st.one_of(st.lists(st.one_of(_ODD_TEXT, st.integers()), max_size=6),
                                                    _ANY_SCALAR)),
    "stream": (st.booleans(), _ANY_SCALAR),
    "stream_options": (st.none(), st.one_of(st.fixed_dictionaries({"include_usage": _ANY_SCALAR}), _ANY_SCALAR)),
    "logit_bias": (st.one_of(st.none(), st.dictionaries(st.integers(0, 2047).map(str), st.floats(-100, 100),
                                                       max_size=3)), st.one_of(st.dictionaries(st.text(max_size=6), _ANY_SCALAR, min_size=1, max_size=3),
                                        _ANY_SCALAR)),
    "model": (st.just("tiny-shakespeare"), _ANY_SCALAR),
    "guided_choice": (st.one_of(st.none(), st.lists(_TEXT, min_size=1, max_size=3)), st.one_of(_ANY_SCALAR, st.lists(
        _ODD_TEXT, max_size=3))),
    "guided_regex": (st.one_of(st.none(), st.sampled_from(["[a-z]{1,8}", "(ay|nay)!"])), st.one_of(_ANY_SCALAR,
                                                                                                  _ODD_TEXT)),
    "response_format": (st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("answer"), "schema": st.sampled_from([{"type": "integer"}, {"enum": ["yes", "no"]}, True])},
            optional={"strict": st.booleans()})})),
                        st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "grammar", 1, None])}),
                                  st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.one_of(
                                      _ANY_SCALAR, st.fixed_dictionaries({"name": st.just("x"), "schema": st.one_of(
                                          _ANY_SCALAR, st.sampled_from([{"type": "foo"}, {"$ref": "#/no"},
                                                                        {"pattern": "(("}]))}))}), _ANY_SCALAR)),
}
_CHAT_FIELDS = {
    **_SAMPLING, "logprobs": (st.booleans(), _ANY_SCALAR), "top_logprobs": (st.none(), _ODD_NUMBERS),
    "max_completion_tokens": (st.integers(1, 8), _ODD_NUMBERS),
    "tools": (st.sampled_from([[], [WEATHER], [WEATHER, SUMMON]]), st.one_of(st.lists(st.dictionaries(
        st.text(max_size=4), _ANY_SCALAR, max_size=2), min_size=1, max_size=2), _ANY_SCALAR)),
    "tool_choice": (st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "summon"}}]),
                    st.one_of(_ANY_SCALAR, st.fixed_dictionaries({"type": st.just("function"), "function": st.just(
                        {"name": "nope"})}))),
}
_COMPLETION_FIELDS = {
    **_SAMPLING, "echo": (st.booleans(), _ANY_SCALAR), "logprobs": (st.integers(0, 5), _ODD_NUMBERS),
    "suffix": (st.none(), st.one_of(_TEXT, _ANY_SCALAR)), "best_of": (st.just(1), _ODD_NUMBERS),
}


@st.composite
def _bodies(draw, required: dict, optional: dict) -> dict:
    """A request body: valid values for the required fields and some optional ones, and in half of the bodies
    one field (any of them) with a wrong value, so that most bodies reach the engine and every check is met."""
    body = draw(st.fixed_dictionaries({name: valid for name, (valid, _) in required.items()},
                                      optional={name: valid for name, (valid, _) in optional.items()}))
    if draw(st.booleans()):
        fields = {**required, **optional}
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name][1])
    return body


_CHAT_BODIES = _bodies({"messages": (_dialogs(), _ODD_MESSAGES)}, _CHAT_FIELDS)
_TOKEN_IDS = st.lists(st.integers(0, 255), min_size=1, max_size=8)
_COMPLETION_BODIES = _bodies({"prompt": (st.one_of(_TEXT, st.lists(_TEXT, min_size=1, max_size=3), _TOKEN_IDS,
                                                   st.lists(_TOKEN_IDS, min_size=1, max_size=2)), st.one_of(
    _ODD_TEXT, st.lists(st.one_of(_ODD_TEXT, st.integers(-5, 40000)), max_size=4), _ANY_SCALAR))}, _COMPLETION_FIELDS)


def _answers_any_body(served, path: str, body: dict) -> None:
    """The body gets its answer, or a 4xx error in OpenAI's shape with a message; never a server error."""
    response = raw(served, "POST", path, json.dumps(body, allow_nan=True))
    assert response.status_code in (200, 400, 404), (body, response.status_code, response.text[:500])
    if response.status_code != 200:
        assert error_of(response)["type"] == "invalid_request_error", (body, response.text[:500])
    elif body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text, response.text
    else:
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
        assert len(response.json()["choices"]) == (body.get("n") or 1) * prompts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=_CHAT_BODIES)
def test_any_chat_body_gets_an_answer_or_an_error_naming_the_problem(served, body):
    _answers_any_body(served, "/chat/completions", body)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=_COMPLETION_BODIES)
def test_any_completion_body_gets_an_answer_or_an_error_naming_the_problem(served, body):
    _answers_any_body(served, "/completions", body)


_RESPONSE_FIELDS = {
    "instructions": (st.one_of(st.none(), _TEXT), st.one_of(_ODD_TEXT, _ANY_SCALAR)),
    "max_output_tokens": (st.integers(1, 8), _ODD_NUMBERS),
    "temperature": (st.floats(0, 2), _ODD_NUMBERS), "top_p": (st.floats(0.01, 1), _ODD_NUMBERS),
    "stream": (st.booleans(), _ANY_SCALAR),
    "text": (st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {
        "type": "json_schema", "name": "n", "schema": {"type": "integer"}}}]), st.one_of(_ANY_SCALAR, st.fixed_dictionaries(
            {"format": st.one_of(_ANY_SCALAR, st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "x", 1])}))}))),
    "tools": (st.sampled_from([[], [{"type": "function", **WEATHER["function"]}]]), st.one_of(_ANY_SCALAR, st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", 2]), "name": _ODD_TEXT}), max_size=2))),
    "tool_choice": (st.sampled_from(["auto", "none"]), st.one_of(_ANY_SCALAR, st.just({"type": "function"}))),
    "store": (st.booleans(), _ANY_SCALAR),
}
_RESPONSE_BODIES = _bodies({"input": (st.one_of(_TEXT, _dialogs()), st.one_of(_ODD_MESSAGES, st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
                           "role": st.sampled_from(["user", "assistant", "tool", None])}), max_size=3)))},
                           _RESPONSE_FIELDS)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=_RESPONSE_BODIES)
def test_any_responses_body_gets_a_response_or_an_error_naming_the_problem(served, body):
    response = raw(served, "POST", "/responses", json.dumps(body, allow_nan=True))
    assert response.status_code in (200, 400, 404), (body, response.status_code, response.text[:500])
    if response.status_code != 200:
        assert error_of(response)["type"] == "invalid_request_error", (body, response.text[:500])
    elif body.get("stream"):
        last = json.loads(response.text.rstrip().rsplit("data: ", 1)[1])
        assert last["type"] in ("response.completed", "response.incomplete"), response.text[-500:]
    else:
        assert response.json()["object"] == "response" and response.json()["output"]


def test_the_server_still_serves_after_every_kind_of_bad_body(client, model_id):
    reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=4, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 4


def test_echo_with_max_tokens_0_scores_a_prompt_that_fills_the_context(client, model_id, served):
    """lm-evaluation-harness's windows: max_seq_len token ids, echo, max_tokens 0, logprobs. Nothing is written,
    so the whole context is the prompt's: every token scored (the first with nothing before it), each as a
    shorter prompt before it scores it; one token more is past the context."""
    engine = served[0]
    max_seq_len = engine.info.max_seq_len
    text = " ".join(["ROMEO: But soft, what light through yonder window breaks?"] * max_seq_len)
    window = engine.tokenizer.encode(text, bos=True, eos=False)[:max_seq_len]
    scored = client.completions.create(model=model_id, prompt=window, max_tokens=0, echo=True, logprobs=1)
    logprobs = scored.choices[0].logprobs.token_logprobs
    assert scored.usage.prompt_tokens == max_seq_len and scored.usage.completion_tokens == 0
    assert len(logprobs) == max_seq_len and logprobs[0] is None and None not in logprobs[1:]
    head = client.completions.create(model=model_id, prompt=window[:100], max_tokens=0, echo=True, logprobs=1)
    assert logprobs[1:100] == pytest.approx(head.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match=f"has {max_seq_len + 1} tokens.*at most {max_seq_len}"):
        client.completions.create(model=model_id, prompt=window + window[1:2], max_tokens=0, echo=True, logprobs=1)


def test_a_responses_token_limit_of_zero_is_refused_in_its_own_words(served):
    response = raw(served, "POST", "/responses", {"input": "Hi", "max_output_tokens": 0})
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "max_output_tokens", response.text
    assert error["message"] == "max_output_tokens must be at least 1, got 0"  # no echo here, as completions have
    unknown = raw(served, "GET", "/responses/resp_1/input_items")
    assert unknown.status_code == 404 and "DELETE /v1/responses/{id}" in error_of(unknown)["message"]


def test_a_response_gives_its_tokens_logprobs_where_include_asks_as_the_chat_route_does(client, model_id):
    ask = dict(model=model_id, max_output_tokens=12, temperature=0, input=HELLO)
    chat = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3).choices[0]
    response = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3)
    (part,) = response.output[0].content
    assert part.text == chat.message.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.logprobs.content]
    assert "".join(e.token for e in part.logprobs) == part.text
    events = list(client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == part.text
    assert [e.token for d in deltas for e in d.logprobs] == [e.token for e in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [e.logprob for e in done.logprobs] == [e.logprob for e in part.logprobs]
    stopped = client.responses.create(**ask, include=["message.output_text.logprobs"],
                                      extra_body={"stop": [part.text[3:6]]})
    stopped_chat = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0,
                                                  logprobs=True, stop=[part.text[3:6]]).choices[0]
    assert stopped.output_text == stopped_chat.message.content  # a token that wrote only the stop is left out
    assert [e.token for e in stopped.output[0].content[0].logprobs] == [e.token for e in stopped_chat.logprobs.content]
    plain = client.responses.create(**ask, top_logprobs=3)  # without include: none, as OpenAI's
    assert plain.output[0].content[0].logprobs == []
