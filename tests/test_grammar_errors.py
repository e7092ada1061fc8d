"""A grammar llguidance cannot follow, refused when the request is read: a 400 naming its field, before any
token is generated, streamed or not, on the OpenAI API; the app's message for any other bad grammar."""

from __future__ import annotations

import json

import httpx
import pytest

import app_server
from llama_core import InvalidRequestError, load
from llama_core.app.address import listen_socket
from llama_core.app.web_server import BackgroundServer
from llama_core.grammar import grammar_for
from llama_core.openai_api import create_api
from llama_core.serving import Engine

pytest.importorskip("llguidance", reason="replies held to a grammar need llguidance")

KEY = "test-key"
PAST_THE_LEXER = "(a{1000}){1000}"  # valid, and a million bytes forced: past llguidance's lexer at the first token
ASK = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "code": {"type": "string",
                                                                                "pattern": PAST_THE_LEXER}}}


@pytest.fixture(scope="module")
def api():
    """(engine, base URL) of the OpenAI API on the test model, in this process."""
    engine = Engine(load(**app_server.engine_build(max_seq_len=256, max_batch_size=2)), seed=0).start()
    server = BackgroundServer(create_api(engine, api_keys=(KEY,)), listen_socket("127.0.0.1", 0)).start()
    try:
        yield engine, server.url + "v1"
    finally:
        server.stop()
        engine.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"guided_regex": PAST_THE_LEXER}, "guided_regex"),
    ("/completions", {"guided_regex": PAST_THE_LEXER}, "guided_regex"),
    ("/chat/completions", {"guided_grammar": f'start: "hello " /{PAST_THE_LEXER}/'}, "guided_grammar"),
    ("/chat/completions", {"guided_json": SCHEMA}, "guided_json"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]},
     "tools[0].function.parameters"),
])
def test_a_grammar_past_the_lexers_limits_is_a_400_naming_its_field_before_any_token(api, path, body, param):
    engine, url = api
    base = {"messages": ASK} if path == "/chat/completions" else {"prompt": "x"}
    generated = engine.generated_tokens
    for stream in (False, True):
        response = post(url, path, {**base, "max_tokens": 5, "stream": stream, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", response.text
        assert error["message"].startswith(f"{param} is too large or too complex"), response.text
    assert engine.generated_tokens == generated


def test_a_grammar_within_the_limits_still_holds_the_reply(api):
    _, url = api
    response = post(url, "/completions", {"prompt": "x", "max_tokens": 8, "guided_regex": "(ay|nay)!"})
    assert response.status_code == 200 and json.loads(response.text)["choices"][0]["text"] in ("ay!", "nay!")


@pytest.mark.parametrize("output_format, spec", [
    ("regex", PAST_THE_LEXER), ("lark", f"start: /{PAST_THE_LEXER}/"), ("json_schema", json.dumps(SCHEMA))])
def test_the_apps_output_format_past_the_lexers_limits_is_refused_as_a_bad_grammar(output_format, spec):
    with pytest.raises(InvalidRequestError, match=r"^output_grammar is too large or too complex for this server"):
        grammar_for(output_format, spec)
