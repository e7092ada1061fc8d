"""GET /metrics: Prometheus' text format, counting the engine's work and every reply the server streams (its API's
and its page's), behind the API's key, and answering while the engine does not."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Iterator

import httpx
import pytest
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families

import app_server
from llama_core import load
from llama_core.app.address import listen_socket
from llama_core.app.web_server import BackgroundServer
from llama_core.errors import EngineUnavailableError
from llama_core.openai_api import create_api
from llama_core.serving import Engine

KEY = "metrics-key"
HELLO = [{"role": "user", "content": "Good morrow, what news?"}]


@pytest.fixture(scope="module")
def app():
    """(engine, URL) of the whole app, as llama-chat serves it: the engine in a process of its own, the page and the
    API on one server, the API behind KEY."""
    with app_server.serve_app(max_batch_size=4, api_keys=(KEY,)) as served:
        yield served


@pytest.fixture(scope="module")
def slow_api():
    """(engine, URL) of the API alone on an engine in this process whose turns take 20 ms or more, so that a
    reply of 200 tokens is still running when its client leaves."""
    engine = Engine(load(**app_server.engine_build()), seed=0, after_turn=lambda: time.sleep(0.02)).start()
    try:
        with serve(create_api(engine, api_keys=(KEY,))) as url:
            yield engine, url
    finally:
        engine.close()


def scrape(url: str, key: str | None = KEY) -> dict[tuple[str, tuple], float]:
    """The metrics at url's /metrics as {(sample name, its labels): value}."""
    response = httpx.get(url + "metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def added(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def post(url: str, path: str, body: dict) -> httpx.Response:
    response = httpx.post(url + "v1/" + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def streamed_usage(response: httpx.Response) -> tuple[int, str]:
    """(completion tokens, finish reason) of a streamed completion sent with include_usage."""
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    return events[-1]["usage"]["completion_tokens"], reasons[-1]


def test_replies_streamed_or_not_are_counted_with_their_tokens_and_first_token_times(app):
    engine, url = app
    eos_banned = {str(engine.tokenizer.eos_id): -100}  # each reply runs to its max_tokens: finish reason "length"
    before = scrape(url)
    whole = post(url, "chat/completions", {"messages": HELLO, "max_tokens": 6, "logit_bias": eos_banned}).json()
    streamed = post(url, "completions", {"prompt": "ROMEO:", "max_tokens": 9, "logit_bias": eos_banned, "stream": True,
                                         "stream_options": {"include_usage": True}})
    after = scrape(url)

    streamed_tokens, streamed_reason = streamed_usage(streamed)
    assert (whole["choices"][0]["finish_reason"], streamed_reason) == ("length", "length")
    tokens = whole["usage"]["completion_tokens"] + streamed_tokens
    assert tokens == 6 + 9
    assert added(before, after, "llama_core_requests_finished_total", reason="length") == 2
    assert sum(added(before, after, "llama_core_requests_finished_total", reason=reason)
               for reason in ("eos", "stop", "cancelled", "error")) == 0
    assert added(before, after, "llama_core_generated_tokens_total") == tokens
    # the engine's own count, carried from its process through its stats
    assert added(before, after, "llama_core_engine_generated_tokens_total") == tokens
    assert added(before, after, "llama_core_time_to_first_token_seconds_count") == 2
    assert added(before, after, "llama_core_request_duration_seconds_count") == 2
    assert added(before, after, "llama_core_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert 0 < added(before, after, "llama_core_time_to_first_token_seconds_sum") < added(
        before, after, "llama_core_request_duration_seconds_sum")
    assert added(before, after, "llama_core_engine_decode_steps_total") > 0
    assert added(before, after, "llama_core_engine_prompt_tokens_computed_total") > 0
    assert after[("llama_core_engine_requests_running", ())] == 0
    assert after[("llama_core_engine_requests_waiting", ())] == 0
    assert after[("llama_core_engine_slots", ())] == 4
    assert after[("llama_core_engine_unresponsive", ())] == 0


def test_a_reply_on_the_page_is_counted_with_the_apis(app):
    engine, url = app
    before = scrape(url)
    reply = Client(url, verbose=False).predict(message="Good morrow, my lord.", history=[], system_prompt="",
                                               temperature=0.0, top_p=0.9, max_new_tokens=12, api_name="/chat")
    after = scrape(url)
    assert isinstance(reply, str)
    assert sum(added(before, after, "llama_core_requests_finished_total", reason=reason)
               for reason in ("eos", "stop", "length", "cancelled", "error")) == 1
    generated = added(before, after, "llama_core_generated_tokens_total")
    assert 0 < generated <= 12
    assert generated == added(before, after, "llama_core_engine_generated_tokens_total")
    assert added(before, after, "llama_core_time_to_first_token_seconds_count") == 1


def test_metrics_need_the_api_key_and_health_does_not(app):
    _, url = app
    assert httpx.get(url + "metrics").status_code == 401
    assert httpx.get(url + "metrics", headers={"Authorization": "Bearer not-the-key"}).status_code == 401
    assert httpx.get(url + "health").status_code == 200
    assert ("llama_core_engine_slots", ()) in scrape(url)


def _no_answer(*args, **kwargs):
    return None


def _ended(*args, **kwargs):
    raise EngineUnavailableError("the model process stopped unexpectedly; restarting")


@pytest.mark.parametrize("stats", [_no_answer, _ended], ids=["stuck", "ended"])
def test_a_scrape_while_the_engine_does_not_answer_says_so_and_what_is_known(app, monkeypatch, stats):
    engine, url = app
    post(url, "completions", {"prompt": "ROMEO:", "max_tokens": 2})
    monkeypatch.setattr(engine, "stats", stats)
    metrics = scrape(url)
    assert metrics[("llama_core_engine_unresponsive", ())] == 1
    assert metrics[("llama_core_engine_slots", ())] == 4
    assert ("llama_core_engine_requests_running", ()) not in metrics  # not known: left out, not reported as 0
    assert ("llama_core_engine_decode_steps_total", ()) not in metrics
    assert metrics[("llama_core_time_to_first_token_seconds_count", ())] >= 1  # the server's own counts stay
    monkeypatch.undo()
    assert scrape(url)[("llama_core_engine_unresponsive", ())] == 0


def test_a_client_that_leaves_a_streamed_reply_is_counted_as_cancelled(slow_api):
    engine, url = slow_api
    before = scrape(url)
    body = {"prompt": "ROMEO:", "max_tokens": 200, "stream": True, "logit_bias": {str(engine.eos_id): -100}}
    with httpx.stream("POST", url + "v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: {"))
    assert first
    assert wait_for(lambda: added(before, scrape(url), "llama_core_requests_finished_total", reason="cancelled") == 1)
    after = scrape(url)
    assert added(before, after, "llama_core_requests_finished_total", reason="length") == 0
    assert 1 <= added(before, after, "llama_core_generated_tokens_total") < 200
    assert added(before, after, "llama_core_request_duration_seconds_count") == 1
    assert wait_for(lambda: scrape(url)[("llama_core_engine_requests_running", ())] == 0)


def test_each_server_counts_its_own_replies(slow_api):
    """Two APIs on one engine (each its own registry: neither the library's global one nor each other's)."""
    engine, url = slow_api
    with serve(create_api(engine, api_keys=(KEY,))) as other:
        before = scrape(url)
        post(other, "completions", {"prompt": "ROMEO:", "max_tokens": 3})
        assert scrape(other)[("llama_core_requests_finished_total", (("reason", "length"),))] + scrape(other)[
            ("llama_core_requests_finished_total", (("reason", "eos"),))] == 1
        after = scrape(url)
    assert added(before, after, "llama_core_generated_tokens_total") == 0
    assert added(before, after, "llama_core_engine_generated_tokens_total") > 0  # the engine's work is shared


@contextlib.contextmanager
def serve(api) -> Iterator[str]:
    server = BackgroundServer(api, listen_socket("127.0.0.1", 0)).start()
    try:
        yield server.url
    finally:
        server.stop()


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
