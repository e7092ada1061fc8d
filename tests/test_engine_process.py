"""The engine in a process of its own: the same answers as in-process, its errors raised in the parent,
cancellation reaching the child, and, if the child dies, requests failing cleanly and a new child started."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llama_core import (CheckpointNotFoundError, EngineUnavailableError, Grammar, InvalidRequestError, Llama,
                        ServerBusyError)
from llama_core.serving import RequestFailedError
from llama_core.serving.engine_process import EngineProcess, _Outbox
from llama_core.serving import Finished, StreamChunk
from llama_core.serving import stream_completion

from conftest import engine_model_dir, greedy_concurrently
from test_engine import _collect, prompts, solo  # noqa: F401 - fixtures

BUILD = dict(max_seq_len=256, seed=0, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llama() -> Llama:
    return Llama.build(engine_model_dir(), max_batch_size=8, **BUILD)


@pytest.fixture(scope="module")
def served():
    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=8, **BUILD), threads=1) as process:
        yield process


def test_facts_describe_the_model_without_its_weights(served, llama):
    facts = served.info
    assert facts.parameter_count == llama.parameter_count
    assert facts.args == llama.args and facts.max_seq_len == 256 and facts.max_batch_size == 8
    assert served.tokenizer.n_words == llama.tokenizer.n_words
    assert facts.device == "cpu" and facts.dtype == "float32" and facts.load_seconds > 0


def test_concurrent_greedy_requests_equal_their_solo_outputs(served, prompts, solo):  # noqa: F811
    assert greedy_concurrently(served, prompts, 40) == solo


def test_prompt_logprobs_and_text_equal_in_process(served, llama, prompts):  # noqa: F811
    expected = llama.generate([prompts[5]], 4, temperature=0, logprobs=True, echo=True)[1][0]
    stream = served.submit(prompts[5], 4, temperature=0, prompt_logprobs=True, top_logprobs=2)
    generated = [chunk.logprob for chunk in stream]
    assert stream.prompt_logprobs == pytest.approx(expected[1 : len(prompts[5])], abs=1e-4)
    # The most likely tokens at each prompt position cross the process boundary too.
    assert len(stream.prompt_top_logprobs) == len(prompts[5]) - 1
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in stream.prompt_top_logprobs)
    assert generated == pytest.approx(expected[len(prompts[5]) :], abs=1e-4)
    text = "".join(c.text for c in stream_completion(served, "the king said", temperature=0, max_new_tokens=20))
    tokens = llama.tokenizer.encode("the king said", bos=True, eos=False)
    assert text == "".join(c.text for c in llama.stream(tokens, 20, temperature=0)) and text.strip()


def test_stats_carry_the_tokens_generated_from_the_child(served, prompts):  # noqa: F811
    before = served.stats()["generated_tokens"]
    read = len(_collect(served.submit(prompts[2], 12, temperature=0)))
    assert served.stats()["generated_tokens"] - before == read > 0
    assert served.generated_tokens == before + read


def test_the_app_engine_with_a_float16_kv_cache_holds_it_in_its_process_and_says_so(prompts):  # noqa: F811
    from llama_core.serving.launch import open_engine

    narrow = Llama.build(engine_model_dir(), max_batch_size=2, kv_cache_dtype="float16", **BUILD)
    expected = narrow.generate([prompts[0]], 12, temperature=0)[0][0]
    engine = open_engine(engine_model_dir(), max_seq_len=256, max_batch_size=2, device="cpu", dtype="float32", threads=1,
                         seed=0, kv_cache_dtype="float16")
    try:
        assert engine.info.kv_cache_dtype == "float16" and engine.info.kv_cache_bytes == narrow.loaded.info.kv_cache_bytes
        assert [chunk.token for chunk in engine.submit(prompts[0], 12, temperature=0)] == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer from 1 to 255"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=1.5), "top_p must be a number from 0 to 1"),
    (dict(prompt_tokens=[1, 10**6]), r"prompt\[1\] is 1000000: token ids are integers from 0"),
    (dict(prompt_tokens=[]), "prompt is empty"),
])
def test_bad_requests_raise_in_the_parent_and_serving_goes_on(served, prompts, solo, kwargs, message):  # noqa: F811
    request = dict(prompt_tokens=prompts[0], max_new_tokens=5, temperature=0.6, top_p=0.9) | kwargs
    with pytest.raises(InvalidRequestError, match=message):
        served.submit(**request)
    assert _collect(served.submit(prompts[2], 40, temperature=0)) == solo[2]


def test_cancelling_reaches_the_child_and_frees_the_slot(prompts):  # noqa: F811
    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=1, **BUILD), threads=1) as process:
        first = process.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
        chunks = iter(first)
        next(chunks)  # the first request holds the only slot
        waiting = process.submit(prompts[1], 5, temperature=0)
        first.cancel()
        assert 1 <= len(_collect(waiting)) <= 5
        assert list(chunks) == [] or first.finish_reason == "cancelled"


def test_a_stream_dropped_unread_is_cancelled_in_the_child(prompts):  # noqa: F811
    """A reader that goes away without reading (a closed page, an abandoned call) leaves its stream to the
    garbage collector: its request must not hold the child's slot until its last token."""
    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=1, **BUILD), threads=1) as process:
        steps = process.steps
        process.submit(prompts[0], 200, temperature=1.0, top_p=1.0)  # the only slot, for 200 tokens; dropped at once
        assert len(_collect(process.submit(prompts[1], 3, temperature=0))) == 3
        assert process.steps - steps <= 10 and process.active_count == 0


def test_a_stream_collected_inside_a_send_is_cancelled_without_waiting(served, prompts, monkeypatch):  # noqa: F811
    """A partly read stream's iterator left in a reference cycle is closed by the garbage collector, which may run
    at any allocation, one inside a send to the child included, with the pipe's lock held: its cancel must not
    wait for that lock (in the same thread it would wait forever), yet the child must be told."""
    import gc
    import threading

    sent = []
    send = served._send
    monkeypatch.setattr(served, "_send", lambda message: (sent.append(message[:2]), send(message))[1])
    conn = served._conn

    class CollectingPipe:  # the pipe, with the collector running inside each send
        def send(self, message: tuple) -> None:
            gc.collect()
            conn.send(message)

    stream = served.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
    other = []  # the stream of the request whose send the collector runs in
    gc.disable()  # the iterator is collected inside the send, not before
    try:
        chunks = iter(stream)
        next(chunks)
        os.kill(served.pid, signal.SIGSTOP)  # the request stays unfinished until the child goes on
        cycle = [chunks, None]
        cycle[1] = cycle
        del chunks, cycle
        monkeypatch.setattr(served, "_conn", CollectingPipe())
        threading.Thread(target=lambda: other.append(served.submit(prompts[1], 3, temperature=0)), daemon=True).start()
        deadline = time.monotonic() + 10
        while not other and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other, "a cancel run by the collector inside a send waited for the pipe's lock"
    finally:
        gc.enable()
        os.kill(served.pid, signal.SIGCONT)
        if served._conn is not conn:
            monkeypatch.setattr(served, "_conn", conn)
            if not other:
                served._send_lock.release()  # lets the waiting cancel, then the send, through
    assert len(_collect(other[0])) == 3
    deadline = time.monotonic() + 10
    while ("cancel", sent[0][1]) not in sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent[0][0] == "submit" and ("cancel", sent[0][1]) in sent  # the child is told, by the canceller
    _collect(stream)
    assert stream.finish_reason == "cancelled"


def test_cancelling_a_finished_request_sends_the_child_nothing(served, prompts, monkeypatch):  # noqa: F811
    """The app cancels every stream it leaves, finished or not (Stop, a closed page): a finished one's cancel
    would be a message over the pipe, and a wake-up of the child's reader, for nothing."""
    sent = []
    send = served._send
    monkeypatch.setattr(served, "_send", lambda message: (sent.append(message[0]), send(message))[1])
    finished = served.submit(prompts[2], 3, temperature=0)
    assert len(_collect(finished)) == 3 and finished.finish_reason == "length"
    finished.cancel()
    running = served.submit(prompts[3], 200, temperature=0)
    next(iter(running))
    running.cancel()
    assert _collect(running) == [] or running.finish_reason == "cancelled"  # the cancel was sent (from a thread)
    assert sent == ["submit", "submit", "cancel"]


def test_submitting_does_not_wait_for_the_child_and_a_full_engine_answers_busy(prompts):  # noqa: F811
    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=1, **BUILD), max_waiting=1, threads=1) as process:
        running = process.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
        waiting = process.submit(prompts[1], 3, temperature=0)
        with pytest.raises(ServerBusyError, match="server busy: 1 requests running and 1 waiting"):
            process.submit(prompts[2], 3, temperature=0)
        running.cancel()
        assert len(_collect(waiting)) == 3
        assert len(_collect(process.submit(prompts[2], 3, temperature=0))) == 3  # room again once they ended


def test_the_client_reaches_the_child_and_its_bound_is_checked_at_submit(prompts):  # noqa: F811
    # Two slots, two waiting places: a named client holds at most 2 + 2 // 2 = 3 requests.
    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=2, **BUILD), max_waiting=2, threads=1) as process:
        assert process.client_capacity == 3
        running = [process.submit(prompts[i], 200, temperature=1.0, top_p=1.0, client="A",
                                  logit_bias={process.tokenizer.eos_id: -100}) for i in range(2)]
        readers = [iter(stream) for stream in running]  # kept: an iterator dropped cancels its request
        for reader in readers:
            next(reader)  # both slots are A's
        queued_first = process.submit(prompts[2], 3, temperature=0, client="A")
        with pytest.raises(ServerBusyError, match="this client already has 3 requests running and waiting"):
            process.submit(prompts[3], 3, temperature=0, client="A")
        queued_last = process.submit(prompts[3], 3, temperature=0, client="B")
        running[1].cancel()  # sent after both submits: the child chooses between them
        # B runs none, A one: B's takes the slot, and A's waits for B's to end (A's other runs on).
        assert len(_collect(queued_last)) >= 1 and len(_collect(queued_first)) >= 1
        assert queued_last.finished_at < queued_first.finished_at
        assert len(_collect(process.submit(prompts[4], 3, temperature=0, client="A"))) >= 1  # A's room is back
        running[0].cancel()


def test_a_request_the_child_refuses_ends_its_stream_with_the_reason(served, prompts):  # noqa: F811
    os.kill(served.pid, signal.SIGSTOP)  # the request is not answered (its 3 tokens were, before the refusal below)
    try:
        stream = served.submit(prompts[0], 3, temperature=0)
        rid = max(served._channels)  # the child's refusal, as it answers a submit it cannot take
        served._route(("rejected", rid, "LlamaError", "the engine is closed"))
    finally:
        os.kill(served.pid, signal.SIGCONT)
    with pytest.raises(RequestFailedError, match="the engine is closed"):
        _collect(stream)
    assert len(_collect(served.submit(prompts[1], 3, temperature=0))) == 3


def wait_for_state(process: EngineProcess, state: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while process.state != state and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.state == state


def test_a_dead_child_fails_its_requests_and_is_restarted(prompts, solo):  # noqa: F811
    """kill -9 of the model process during a stream: the stream ends saying so, requests meanwhile are refused
    as restarting (and /health says so), and a new process then serves the same answers."""
    from fastapi.testclient import TestClient

    from llama_core.openai_api import create_api

    process = EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=8, **BUILD), threads=1).start()
    try:
        stream = process.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
        chunks = iter(stream)
        next(chunks)
        first_pid = process.pid
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(RequestFailedError, match="model process stopped unexpectedly; restarting"):
            list(chunks)
        assert process.state == "restarting"  # a new process takes seconds to load the model
        with pytest.raises(EngineUnavailableError, match="restarting"):
            process.submit(prompts[1], 5)
        health = TestClient(create_api(process)).get("/health")
        assert health.status_code == 503 and health.json()["status"] == "restarting"
        wait_for_state(process, "running")
        assert process.pid != first_pid and process.restarts == 1
        assert greedy_concurrently(process, prompts, 40) == solo
        assert TestClient(create_api(process)).get("/health").status_code == 200
    finally:
        process.shutdown()


def test_a_shutdown_during_a_restart_stops_the_child_it_was_loading(prompts):  # noqa: F811
    import multiprocessing

    others = {child.pid for child in multiprocessing.active_children()}  # other tests' model processes
    process = EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=2, **BUILD), threads=1).start()
    os.kill(process.pid, signal.SIGKILL)
    wait_for_state(process, "restarting")
    process.shutdown()  # as Ctrl-C would, while the new child loads the model
    deadline = time.monotonic() + 60
    time.sleep(1.0)  # the restart's child has had time to be started
    while any(child.name == "llama-engine" and child.pid not in others
              for child in multiprocessing.active_children()):
        assert time.monotonic() < deadline, "the child the restart loaded still runs after the shutdown"
        time.sleep(0.1)
    assert process.state == "stopped" and not process.alive and process.pid is None
    with pytest.raises(EngineUnavailableError):
        process.submit(prompts[0], 4)


def test_a_child_that_keeps_dying_is_given_up_on(prompts):  # noqa: F811
    process = EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=2, **BUILD), threads=1, max_restarts=0).start()
    try:
        running = process.submit(prompts[1], 200, temperature=0, logit_bias={process.tokenizer.eos_id: -100})
        os.kill(process.pid, signal.SIGKILL)
        wait_for_state(process, "failed", 30)
        with pytest.raises(RequestFailedError, match="not restarted again, and the server stops"):
            list(running)  # not told "restarting"
        with pytest.raises(EngineUnavailableError, match="could not be restarted"):
            process.submit(prompts[1], 5)
    finally:
        process.shutdown()


def test_shutting_down_is_not_a_crash(prompts):  # noqa: F811
    process = EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=2, **BUILD), threads=1).start()
    process.shutdown()
    time.sleep(0.5)
    assert process.state == "stopped" and process.restarts == 0
    with pytest.raises(EngineUnavailableError, match="not running"):
        process.submit(prompts[1], 5)


def test_a_model_that_does_not_load_raises_from_start(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="checkpoint directory not found"):
        EngineProcess(dict(ckpt_dir=tmp_path / "missing", **BUILD)).start()


def test_the_child_sends_a_turns_events_in_one_message():
    sent = []
    outbox = _Outbox(sent.append)
    first, second = outbox.queue_for(1), outbox.queue_for(2)
    first.put(StreamChunk(5, -0.5, ""))
    second.put(StreamChunk(7, -0.25, ""))
    first.put(Finished("length", "", 0.0, drafted_tokens=6, accepted_tokens=4))
    outbox.flush()
    outbox.flush()  # nothing new: nothing sent
    assert sent == [("events", [("chunk", 1, 5, -0.5, None), ("chunk", 2, 7, -0.25, None),
                                ("done", 1, "length", "", 6, 4, "")])]


def test_a_grammar_llguidance_cannot_match_is_refused_at_submit_as_a_bad_request(served, prompts):  # noqa: F811
    # Valid, but past llguidance's limits when its matcher is built: refused here, before the child is sent
    # anything, as a bad request (an API's 400), not as an error ending the stream (a 500).
    pytest.importorskip("llguidance", reason="replies held to a grammar need llguidance")
    with pytest.raises(InvalidRequestError, match="too large or too complex"):
        served.submit(prompts[0], 4, grammar=Grammar.regex("(a|b)*" * 2000))
    assert len([c for c in served.submit(prompts[0], 4, temperature=0, grammar=Grammar.regex("[ab]+"))]) >= 1


def test_draining_ends_what_is_left_with_an_error_and_refuses_new_requests(prompts):  # noqa: F811
    from llama_core import EngineLostError

    with EngineProcess(dict(ckpt_dir=engine_model_dir(), max_batch_size=2, **BUILD), threads=1) as process:
        long = process.submit(prompts[1], 250, temperature=0, logit_bias={process.tokenizer.eos_id: -100})
        deadline = time.monotonic() + 30
        while process.active_count < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        process.drain(0.0)
        assert process.state == "stopping" and not process.alive
        with pytest.raises(EngineLostError, match="the server is stopping"):
            list(long)
        with pytest.raises(EngineUnavailableError, match="the server is stopping"):
            process.submit(prompts[0], 2)


def test_a_stuck_model_process_is_told_from_a_live_one(served):
    """What /health asks: a process stopped (SIGSTOP, as a hung device or a deadlock leaves it) is alive but does
    not answer; once it goes on, it answers again."""
    assert served.responsive(5.0)
    os.kill(served.pid, signal.SIGSTOP)
    try:
        assert served.alive and not served.responsive(0.5)
    finally:
        os.kill(served.pid, signal.SIGCONT)
    assert served.responsive(5.0)


def test_a_model_process_whose_parent_left_while_it_loaded_ends_quietly(monkeypatch):
    """Its parent stopped (SIGTERM while the model loads): the child's "ready" finds the pipe closed, and it
    ends without a BrokenPipeError traceback."""
    from llama_core.serving import engine_process

    class Closed:
        def send(self, message):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(engine_process.signal, "signal", lambda *args: None)  # the test process's own stay
    options = dict(max_waiting=4, prefill_chunk=None, prefix_caching=True, prompt_lookup=None, draft_price=None)
    assert engine_process._serve(Closed(), dict(ckpt_dir=engine_model_dir(), max_batch_size=1, **BUILD), options, 1) is None
