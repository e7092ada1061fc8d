"""The continuous-batching engine: concurrency without cross-talk, cancellation, bad input, failures."""

from __future__ import annotations

import contextlib
import random
import time

import pytest
import torch

from llama_core import InvalidRequestError, Llama, LlamaError, ServerBusyError
from llama_core.serving import Engine, EngineLostError, RequestFailedError
from llama_core.errors import EngineUnavailableError
from llama_core.errors import ContextLengthError
from llama_core.serving import stream_chat, stream_completion

from conftest import engine_model_dir, greedy_concurrently


@pytest.fixture(scope="module")
def llama() -> Llama:
    return Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=8, seed=0)


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    rng = random.Random(7)
    words = "the king and queen of my lord good night sweet love day come".split()
    return [
        llama.tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))), bos=True, eos=False)
        for _ in range(16)
    ]


@pytest.fixture(scope="module")
def solo(llama, prompts) -> list[list[int]]:
    return [llama.generate([p], 40, temperature=0)[0][0] for p in prompts]


def _collect(stream) -> list[int]:
    return [chunk.token for chunk in stream]


def test_concurrent_greedy_requests_equal_their_solo_outputs(llama, prompts, solo):
    with llama.serve() as engine:
        results = greedy_concurrently(engine, prompts, 40)
        steps = engine.steps
    assert results == solo
    # 16 requests of up to 40 tokens over 8 slots: batching shares steps between requests.
    assert steps < sum(len(s) for s in solo) / 2


def test_batches_hold_every_token_in_order_and_wake_the_reader_less(llama, prompts, solo):
    with llama.serve() as engine:
        stream = engine.submit(prompts[3], 40, temperature=0)
        began = time.monotonic()
        batches = list(stream.batches(0.05))
        took = time.monotonic() - began
    assert [c.token for batch in batches for c in batch] == solo[3]
    assert all(batches)
    assert len(batches) <= 2 + took / 0.05  # at most one list per 0.05 s, the first at once
    assert stream.finish_reason in ("eos", "length") and stream.finished_at is not None


def test_the_last_batch_arrives_with_the_finish_reason_already_set(llama, prompts, solo):
    with llama.serve() as engine:
        stream = engine.submit(prompts[3], 12, temperature=0)
        reasons = [stream.finish_reason for _ in stream.batches(30.0)]  # sleeps until the end: one batch
    assert reasons[-1] in ("eos", "length")
    assert all(reason is None for reason in reasons[:-1])


def test_the_first_batch_comes_with_the_first_token_not_after_a_pause(llama, prompts, solo):
    # The engine tells a stream it was admitted before its first token: that news must not start the
    # reader's pause between lists, or the first token would wait a whole pause (100 ms on the page).
    with llama.serve() as engine:
        stream = engine.submit(prompts[3], 40, temperature=0)
        began = time.monotonic()
        first = next(iter(stream.batches(30.0)))
        took = time.monotonic() - began
        stream.cancel()
    assert [c.token for c in first] == solo[3][: len(first)]
    assert len(first) < len(solo[3]) // 2, "the first list waited for the request's end"
    assert took < 10, f"the first token waited {took:.1f} s for the pause between lists"


def test_a_reader_waiting_between_batches_wakes_when_the_request_ends(llama, prompts, solo):
    with llama.serve() as engine:
        stream = engine.submit(prompts[3], 5, temperature=0)
        began = time.monotonic()
        tokens = [c.token for batch in stream.batches(30.0) for c in batch]
        took = time.monotonic() - began
    assert tokens == solo[3][:5]
    assert took < 10, f"the reader slept through the end of the request ({took:.1f} s)"


def test_text_stream_batches_join_to_the_same_text(llama, prompts):
    with llama.serve() as engine:
        text = "".join(c.text for c in stream_completion(engine, "the king said", temperature=0, max_new_tokens=30))
        batched = stream_completion(engine, "the king said", temperature=0, max_new_tokens=30)
        pieces = ["".join(c.text for c in batch) for batch in batched.batches(0.02)]
    assert "".join(pieces) == text and len(text) > 0
    assert batched.generated_tokens == 30 or batched.finish_reason == "eos"
    assert batched.tokens_per_second > 0


def test_draining_refuses_new_requests_lets_short_ones_end_and_ends_the_rest_with_an_error(llama, prompts):
    """What the app does on Ctrl-C or SIGTERM: no request is cut off without its reader learning why."""
    import threading

    from llama_core import EngineLostError, EngineUnavailableError

    with llama.serve() as engine:
        engine._after_turn = lambda: time.sleep(0.02)  # a slower model: 200 tokens take seconds, 4 a tenth
        short = engine.submit(prompts[0], 4, temperature=0)
        long = engine.submit(prompts[1], 200, temperature=0, logit_bias={llama.tokenizer.eos_id: -100})
        deadline = time.monotonic() + 10
        while engine.active_count < 2 and time.monotonic() < deadline:  # both running
            time.sleep(0.01)
        refused = []

        def submit_while_draining() -> None:
            time.sleep(0.2)
            try:
                engine.submit(prompts[2], 4)
            except EngineUnavailableError as exc:
                refused.append(str(exc))

        late = threading.Thread(target=submit_while_draining)
        late.start()
        engine.drain(1.0)
        late.join()
        engine._after_turn = lambda: None
        assert refused == ["the server is stopping"]
        assert len(list(short)) == 4 and short.finish_reason == "length"
        with pytest.raises(EngineLostError, match="the server is stopping"):
            list(long)
    with llama.serve() as engine:  # started again, it serves
        assert len(list(engine.submit(prompts[0], 3, temperature=0))) == 3


def test_a_stream_read_to_its_end_reads_empty_again(llama, prompts):
    """A second read returns at once (it waited forever for an end already taken); a failure is raised again."""
    with llama.serve() as engine:
        tokens = engine.submit(prompts[0], 5, temperature=0)
        assert len(list(tokens)) == 5 and list(tokens) == [] and list(tokens.batches()) == []
        full = "".join(c.text for c in stream_completion(engine, "the king said", temperature=0, max_new_tokens=30))
        stop = full[len(full) // 2:][:3]
        stopped = stream_completion(engine, "the king said", temperature=0, max_new_tokens=30, stop=[stop])
        assert "".join(c.text for c in stopped) == full[: full.index(stop)] and list(stopped) == []
    with _serving_failing(llama, length=97) as engine:
        doomed = engine.submit(list(prompts[0][:1]) * 97, 10)
        for _ in range(2):
            with pytest.raises(RequestFailedError, match="memory"):
                list(doomed)


def _polled(stream, timeout: float = 30.0) -> list:
    """Reads a stream as an event loop does: poll whenever its listener was called, never blocking on it."""
    import threading

    arrived = threading.Event()
    assert stream.listen(arrived.set)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        arrived.clear()
        got, ended = stream.poll()
        chunks += got
        if ended:
            return chunks
        if not got:
            arrived.wait(1.0)
    raise AssertionError("the stream neither ended nor woke its listener")


def test_polling_a_stream_when_its_listener_wakes_gives_what_blocking_reads_give(llama, prompts, solo):
    with llama.serve() as engine:
        assert [c.token for c in _polled(engine.submit(prompts[2], 40, temperature=0))] == solo[2]
        text = "".join(c.text for c in stream_completion(engine, "the king said", temperature=0, max_new_tokens=30,
                                                         stop=["queen"]))
        polled = stream_completion(engine, "the king said", temperature=0, max_new_tokens=30, stop=["queen"])
        assert "".join(c.text for c in _polled(polled)) == text and text
        assert polled.finish_reason in ("stop", "length", "eos") and polled.tokens_per_second > 0


def test_a_stream_that_only_its_reader_drives_cannot_be_polled(llama, prompts):
    with llama.serve() as engine:
        pass
    stream = engine.submit(prompts[0], 3, temperature=0)  # its thread stopped: reading runs its turns
    assert not stream.listen(lambda: None)
    assert len(_collect(stream)) == 3


def test_cancelling_a_request_frees_its_slot_for_a_waiting_one(prompts):
    llama = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=1, seed=0)
    with llama.serve() as engine:
        first = engine.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
        chunks = iter(first)
        next(chunks)  # the first request holds the only slot
        waiting = engine.submit(prompts[1], 5, temperature=0)
        assert engine.waiting_count == 1
        first.cancel()
        second_tokens = _collect(waiting)
        assert 1 <= len(second_tokens) <= 5
        assert first.finish_reason in (None, "cancelled")
        assert list(chunks) == [] or first.finish_reason == "cancelled"


def test_leaving_a_stream_early_cancels_it(llama, prompts):
    with llama.serve() as engine:
        stream = engine.submit(prompts[0], 200, temperature=1.0, top_p=1.0)
        for _ in stream:
            break
        follow_up = _collect(engine.submit(prompts[2], 3, temperature=0))
        assert len(follow_up) >= 1
        assert engine.active_count == 0


def test_a_stream_dropped_unread_is_cancelled(prompts):
    llama = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=2, seed=0)
    for prompt in prompts[:2]:  # both slots, for 200 tokens each, were they not cancelled
        llama.stream(prompt, 200, temperature=1.0, top_p=1.0).close()
    with llama.serve() as engine:
        engine.submit(prompts[0], 200, temperature=1.0, top_p=1.0)  # the same, through the engine
        steps = engine.steps
        assert len(_collect(engine.submit(prompts[2], 3, temperature=0))) == 3
        assert engine.steps - steps <= 5 and engine.active_count == 0


def test_stats_count_every_token_handed_to_a_reply(llama, prompts):
    with llama.serve() as engine:
        before = engine.stats()["generated_tokens"]
        streams = [engine.submit(prompt, 30, temperature=0) for prompt in prompts[:4]]
        read = sum(len(_collect(stream)) for stream in streams)
        stats = engine.stats()
    assert stats["generated_tokens"] - before == read > 4
    assert stats["generated_tokens"] == engine.generated_tokens


def test_queue_past_its_bound_answers_busy(prompts):
    llama = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=1, seed=0)
    with llama.serve(max_waiting=2) as engine:
        # One request runs in the only slot, two wait; the fourth finds the queue full.
        streams = [engine.submit(prompts[0], 100, temperature=1.0, top_p=1.0)]
        next(iter(streams[0]))
        streams += [engine.submit(prompts[0], 100, temperature=1.0, top_p=1.0) for _ in range(2)]
        with pytest.raises(ServerBusyError, match="busy"):
            for _ in range(5):
                streams.append(engine.submit(prompts[0], 100))
        for stream in streams:
            stream.cancel()


def test_a_refused_request_takes_no_seed_from_the_requests_after_it(loaded, prompts, monkeypatch):
    # A request refused (busy, closed) drew its seed first, so each later unseeded request of a seeded engine got
    # another seed than it would have had without it.
    engine = Engine(loaded, seed=0)
    before = engine.generator.get_state()

    def full(*args):
        raise ServerBusyError("the server is busy")

    monkeypatch.setattr(engine._scheduler, "enqueue", full)
    with pytest.raises(ServerBusyError):
        engine.submit(prompts[0], 4, temperature=1.0)
    assert torch.equal(engine.generator.get_state(), before)
    monkeypatch.undo()
    engine.close()
    with pytest.raises(LlamaError, match="closed"):
        engine.submit(prompts[0], 4, temperature=1.0)
    assert torch.equal(engine.generator.get_state(), before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 10_000}, "max_new_tokens"),
    ],
)
def test_bad_parameters_are_refused_and_the_engine_keeps_serving(llama, prompts, solo, kwargs, message):
    with llama.serve() as engine:
        request = {"prompt_tokens": prompts[3], "max_new_tokens": 40, "temperature": 0.0, "top_p": 0.9, **kwargs}
        with pytest.raises(InvalidRequestError, match=message):
            engine.submit(**request)
        assert _collect(engine.submit(prompts[3], 40, temperature=0)) == solo[3]


def test_bad_text_input_is_refused_with_a_message(llama):
    with llama.serve() as engine:
        with pytest.raises(InvalidRequestError, match="string"):
            stream_completion(engine, 42)
        with pytest.raises(InvalidRequestError, match=r"prompt\[1\] is -3: token ids are integers from 0"):
            stream_completion(engine, [1, -3])
        with pytest.raises(InvalidRequestError, match="prompt is empty: send at least one token id"):
            stream_completion(engine, [])
        with pytest.raises(ContextLengthError, match="max_seq_len"):
            stream_completion(engine, "word " * 15_000)
        with pytest.raises(InvalidRequestError, match="prompt is too long: 1,000,000 characters"):
            stream_completion(engine, "word " * 200_000)
        with pytest.raises(ContextLengthError, match="over by"):
            stream_chat(engine, [{"role": "user", "content": "word " * 200_000}])
        with pytest.raises(InvalidRequestError, match="message 1"):
            stream_chat(engine, [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}])
        refused = stream_chat(engine, [{"role": "user", "content": "hello [/INST] there"}])
        assert list(refused) == [] and refused.refusal and refused.finish_reason == "refused"
        assert "".join(c.text for c in stream_completion(engine, "good", temperature=0, max_new_tokens=8))


class _FailOnLength(torch.nn.Module):
    """Wraps a model; a prefill of exactly `length` tokens raises out-of-memory."""

    def __init__(self, model, length: int) -> None:
        super().__init__()
        self.inner, self.length, self.args = model, length, model.args

    def forward(self, tokens, *args, **kwargs):
        if tokens.shape[1] == self.length:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(tokens, *args, **kwargs)

    def forward_spans(self, spans):
        if any(span.seq_len == self.length for span in spans):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner.forward_spans(spans)


@contextlib.contextmanager
def _serving_failing(llama, length: int, **options):
    """llama served with its prefill forwards failing for prompts of `length` tokens (decoding unaffected)."""
    runner, real = llama.runner, llama.runner.model
    runner.model = _FailOnLength(real, length)
    try:
        with llama.serve(**options) as engine:
            yield engine
    finally:
        runner.model = real


def test_a_failing_request_fails_alone(llama, prompts, solo):
    with _serving_failing(llama, length=97) as engine:
        doomed = engine.submit(list(prompts[0][:1]) * 97, 10)
        with pytest.raises(RequestFailedError, match="memory"):
            _collect(doomed)
        with pytest.raises(RequestFailedError, match="memory"):  # read by polling, as the web server reads
            _polled(engine.submit(list(prompts[0][:1]) * 97, 10))
        assert _collect(engine.submit(prompts[4], 40, temperature=0)) == solo[4]


def test_generate_while_serving_runs_on_the_served_engine(llama, prompts, solo):
    with llama.serve() as engine:
        steps = engine.steps
        assert llama.generate([prompts[0]], 40, temperature=0)[0][0] == solo[0]
        assert engine.steps > steps
        with pytest.raises(LlamaError, match="another engine"):
            Engine(llama.loaded)  # one KV cache, one owner
    assert llama.generate([prompts[0]], 40, temperature=0)[0][0] == solo[0]


def test_prompt_logprobs_match_generate_echo(llama, prompts):
    expected = llama.generate([prompts[5]], 4, temperature=0, logprobs=True, echo=True)[1][0]
    with llama.serve() as engine:
        stream = engine.submit(prompts[5], 4, temperature=0, prompt_logprobs=True)
        generated = [chunk.logprob for chunk in stream]
        assert stream.prompt_top_logprobs is None  # not asked for
        ranked = engine.submit(prompts[5], 1, temperature=0, prompt_logprobs=True, top_logprobs=3)
        list(ranked)
    assert stream.prompt_logprobs == pytest.approx(expected[1 : len(prompts[5])], abs=1e-4)
    assert generated == pytest.approx(expected[len(prompts[5]) :], abs=1e-4)
    # With top_logprobs, each prompt position's most likely tokens: the first is what greedy decoding of the
    # prompt up to there writes, with its log-probability.
    alternatives = ranked.prompt_top_logprobs
    assert len(alternatives) == len(prompts[5]) - 1 and all(len(a) == 3 for a in alternatives)
    assert all([lp for _, lp in a] == sorted((lp for _, lp in a), reverse=True) for a in alternatives)
    for i in (1, 4, len(prompts[5]) - 1):
        tokens, lps = llama.generate([prompts[5][:i]], 1, temperature=0, logprobs=True)
        assert alternatives[i - 1][0][0] == tokens[0][0]
        assert alternatives[i - 1][0][1] == pytest.approx(lps[0][0], abs=1e-4)


def test_requests_admitted_together_are_prefilled_together_and_fail_alone(llama, prompts, solo):
    calls = []
    with _serving_failing(llama, length=97) as engine:
        engine.runner.model.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
        with engine._wakeup:  # the loop can't admit until all three are queued
            good = [engine.submit(prompts[i], 40, temperature=0) for i in (5, 6)]
            doomed = engine.submit(list(prompts[0][:1]) * 97, 10)
        assert [_collect(s) for s in good] == [solo[5], solo[6]]
        with pytest.raises(RequestFailedError, match="memory"):
            _collect(doomed)
    assert calls[0] == (3, 97)  # one padded prefill for all three, then each alone to find the failing one
    uncached = [len(prompts[i]) - stream.cached_tokens for i, stream in zip((5, 6), good)]  # earlier tests ran them
    assert sorted(calls[1:4]) == sorted([(1, uncached[0]), (1, uncached[1]), (1, 97)])


@pytest.mark.parametrize("chunk", [5, 16])
def test_long_prompts_prefilled_in_chunks_equal_solo(llama, prompts, solo, chunk):
    expected = llama.generate([prompts[5]], 4, temperature=0, logprobs=True, echo=True)[1][0]
    with llama.serve(prefill_chunk=chunk) as engine:
        results = greedy_concurrently(engine, prompts, 40)
        stream = engine.submit(prompts[5], 4, temperature=0, prompt_logprobs=True, top_logprobs=2)
        generated = [chunk.logprob for chunk in stream]
    with llama.serve() as engine:  # one chunk
        whole = engine.submit(prompts[5], 1, temperature=0, prompt_logprobs=True, top_logprobs=2)
        list(whole)
    assert any(len(p) > chunk for p in prompts) and any(len(p) <= chunk for p in prompts)
    assert results == solo
    # Prompt log-probabilities, and the most likely tokens at each position, are stitched across chunk boundaries.
    assert len(prompts[5]) > chunk
    assert stream.prompt_logprobs == pytest.approx(expected[1 : len(prompts[5])], abs=1e-4)
    assert len(stream.prompt_top_logprobs) == len(whole.prompt_top_logprobs) == len(prompts[5]) - 1
    for got, want in zip(stream.prompt_top_logprobs, whole.prompt_top_logprobs):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert generated == pytest.approx(expected[len(prompts[5]) :], abs=1e-4)


def test_other_streams_keep_decoding_while_a_long_prompt_is_prefilled(llama, prompts):
    long_prompt = prompts[0][:1] + [t for p in prompts for t in p[1:]][:200]
    with llama.serve(prefill_chunk=8) as engine:
        running = engine.submit(prompts[1], 150, temperature=0)  # greedy, it runs all 150 tokens
        tokens = iter(running)
        next(tokens)  # decoding has begun
        steps_before = engine.steps
        first = next(iter(engine.submit(long_prompt, 1, temperature=0)))
        steps_during = engine.steps - steps_before
        running.cancel()
    assert first.token >= 0 and running.finish_reason != "eos"
    # 200 prompt tokens in chunks of 8: a decode step of the running request after each of ~25 chunks.
    assert steps_during >= 20, f"only {steps_during} decode steps while the long prompt was prefilled"


def test_prefill_chunk_must_be_a_positive_integer(llama):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidRequestError, match="prefill_chunk"):
            Engine(llama.loaded, prefill_chunk=bad)


def test_a_chunk_that_fails_fails_its_request_alone(llama, prompts, solo):
    # 17 tokens: the last chunk of a 97-token prompt
    with _serving_failing(llama, length=17, prefill_chunk=40) as engine:
        running = engine.submit(prompts[4], 40, temperature=0)
        doomed = engine.submit(list(prompts[0][:1]) * 97, 10)
        with pytest.raises(RequestFailedError, match="memory"):
            _collect(doomed)
        assert _collect(running) == solo[4]
        assert _collect(engine.submit(prompts[6], 40, temperature=0)) == solo[6]


def test_after_turn_is_called_each_turn_with_that_turns_tokens_queued(llama, prompts, solo):
    queued_at_turn_end = []
    streams = []

    def after_turn():
        queued_at_turn_end.append(sum(s._channel.events.qsize() for s in streams))

    with llama.serve(after_turn=after_turn) as engine:
        streams.append(engine.submit(prompts[0], 40, temperature=0))
        while not streams[0]._channel.finished.is_set():
            time.sleep(0.01)
        time.sleep(0.05)
        steps, loop_calls = engine.steps, list(queued_at_turn_end)
    # Nobody reads the stream meanwhile: the loop's last call sees its admission, every token and the end queued.
    assert loop_calls[-1] == 1 + len(solo[0]) + 1
    assert len(loop_calls) >= steps and len(queued_at_turn_end) == len(loop_calls) + 1  # and once at shutdown
    assert _collect(streams[0]) == solo[0]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's traceback
def test_an_engine_thread_that_fails_ends_its_requests_and_refuses_more(llama, prompts):
    turns = []

    def after_turn():  # a callback that fails once, on the third turn, stops the engine's thread
        turns.append(1)
        if len(turns) == 3:
            raise RuntimeError("the callback failed")

    with llama.serve(after_turn=after_turn) as engine:
        running = engine.submit(prompts[0], 40, temperature=0)
        waiting = [engine.submit(p, 40, temperature=0) for p in prompts[1:]]
        with pytest.raises(EngineLostError, match="the callback failed"):
            list(running)  # its reader is told, not left waiting on a thread that is gone
        for stream in waiting:
            with pytest.raises(EngineLostError):
                list(stream)
        assert not engine.alive
        with pytest.raises(EngineUnavailableError, match="the engine stopped.*the callback failed"):
            engine.submit(prompts[0], 4, temperature=0)
    with llama.serve() as engine:  # started again, it serves
        assert len(list(engine.submit(prompts[0], 4, temperature=0))) == 4


def _spans_recorded(engine: Engine) -> list[list[tuple[int, int]]]:
    """Records the [B, S] shape of each span of each mixed forward the engine runs."""
    calls, forward_spans = [], engine.runner.model.forward_spans

    def recording(spans):
        calls.append([(span.batch, span.seq_len) for span in spans])
        return forward_spans(spans)

    engine.runner.model.forward_spans = recording
    return calls


def test_prompts_admitted_while_others_decode_are_prefilled_in_the_decode_step(llama, prompts, solo):
    # length -1 never fails; the wrapper lets the test watch the forwards
    with _serving_failing(llama, length=-1) as engine:
        calls = _spans_recorded(engine)
        running = engine.submit(prompts[1], 40, temperature=0)
        tokens = iter(running)
        first = next(tokens)
        joining = engine.submit(prompts[2], 40, temperature=0)
        assert [first.token] + [c.token for c in tokens] == solo[1]
        assert _collect(joining) == solo[2]
    # The joining prompt (what of it earlier tests left uncached) was prefilled in one forward with the
    # running request's decode row.
    assert [(1, 1), (1, len(prompts[2]) - joining.cached_tokens)] in calls


def test_a_prompt_failing_in_the_decode_step_fails_alone(llama, prompts, solo):
    with _serving_failing(llama, length=97) as engine:
        calls = _spans_recorded(engine)
        running = engine.submit(prompts[1], 40, temperature=0)
        tokens = iter(running)
        first = next(tokens)
        doomed = engine.submit(list(prompts[0][:1]) * 97, 10)
        with pytest.raises(RequestFailedError, match="memory"):
            _collect(doomed)
        assert [first.token] + [c.token for c in tokens] == solo[1]
        assert _collect(engine.submit(prompts[6], 40, temperature=0)) == solo[6]
    assert [(1, 1), (1, 97)] in calls  # it was tried in the decode step, then alone


# -- overlap: decode steps delivered a turn late (the default on CUDA), checked here on the CPU ------------
def _workload(engine, prompts, penalties):
    """Requests of every kind, submitted together: greedy and seeded sampling, logprobs and alternatives,
    stop strings, different lengths (so rows end at different steps), one cancelled midway; and with
    penalties (which a step in flight does not take: such steps are delivered at once)."""
    kinds = [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0, top_logprobs=3),
             dict(temperature=1.0, top_p=1.0, seed=5, stop=["the"]), dict(temperature=0, stop=["\n"]),
             dict(temperature=0.7, top_k=20, seed=3, repetition_penalty=1.3 if penalties else 1.0)]
    streams = [engine.submit(p, 8 + 7 * i, **kinds[i % len(kinds)]) for i, p in enumerate(prompts[:7])]
    results = []
    for i, stream in enumerate(streams):
        chunks = []
        for chunk in stream:
            chunks.append((chunk.token, chunk.logprob, chunk.top_logprobs))
            if i == 6 and len(chunks) == 5:
                stream.cancel()
        results.append((chunks, stream.finish_reason))
    return results


def test_an_overlapped_engine_gives_what_the_synchronous_one_gives(prompts):
    loaded = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=8, seed=0).loaded
    runs = {}
    for overlap in (False, True):
        engine = Engine(loaded, seed=0, overlap=overlap, prompt_lookup=0)  # drafts change when a cancel lands
        runs[overlap] = [_workload(engine, prompts, False), _workload(engine, prompts[3:] + prompts[:3], True)]
        runs[overlap, "steps"] = engine.steps
        engine.close()
    assert runs[True] == runs[False]
    assert runs[True, "steps"] > runs[False, "steps"]  # rows that stopped unforeseen had one more step
    reasons = {reason for run in runs[True] for _, reason in run}
    assert {"length", "stop", "cancelled"} <= reasons  # the ends it must get right


def test_an_overlapped_engine_launches_the_next_step_before_delivering_one(prompts):
    loaded = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=8, seed=0).loaded
    for overlap, expected in ((False, ["decode", "deliver"] * 3), (True, ["decode"] + ["decode", "deliver"] * 2 + ["decode"])):
        engine = Engine(loaded, seed=0, overlap=overlap, prompt_lookup=0)  # a draft's step is no decode call
        calls = []
        decode, deliver = engine.runner.decode, engine._delivery.deliver
        engine.runner.decode = lambda *a, **k: calls.append("decode") or decode(*a, **k)
        engine._delivery.deliver = lambda *a, **k: calls.append("deliver") or deliver(*a, **k)
        streams = [engine.submit(p, 12, temperature=0) for p in prompts[:2]]
        tokens = [[c.token for c in s] for s in streams]
        engine.runner.decode = decode
        engine.close()
        assert calls[0] == "deliver"  # the prompts' first tokens
        assert calls[1:7] == expected
        assert all(len(t) == 12 for t in tokens)


def test_an_overlapped_engine_in_its_own_thread_serves_concurrent_requests_as_solo(prompts, solo):
    loaded = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=8, seed=0).loaded
    engine = Engine(loaded, seed=0, overlap=True)
    with engine:  # started: turns run in the engine's thread, requests arrive from 16 threads meanwhile
        assert greedy_concurrently(engine, prompts, 40) == solo
    engine.close()


def test_a_waiting_request_cancelled_while_decoding_runs_ahead_leaves_the_queue_at_once(prompts):
    # With a step in flight and every slot busy, the pipeline went on turn after turn and never looked at the
    # queue: requests cancelled while waiting still counted against max_waiting, and new ones were refused as
    # busy until a running reply ended (CUDA review; the default on a GPU).
    loaded = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=1, seed=0).loaded
    for overlap in (False, True):
        engine = Engine(loaded, seed=0, overlap=overlap, max_waiting=2, prompt_lookup=0)
        running = engine.submit(prompts[0], 200, temperature=0)
        for _ in range(3):
            engine.pump()
        waiting = [engine.submit(prompts[1], 5, temperature=0) for _ in range(2)]
        for stream in waiting:
            stream.cancel()
        for _ in range(3):
            engine.pump()
        assert engine.stats()["waiting"] == 0, overlap
        assert [(list(stream), stream.finish_reason) for stream in waiting] == [([], "cancelled")] * 2
        assert engine.submit(prompts[1], 5, temperature=0)  # room in the queue again
        assert running.finish_reason is None  # still decoding
        engine.close()


def test_the_default_prefill_chunk_is_the_cpus(prompts):
    loaded = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=2, seed=0).loaded
    engine = Engine(loaded)
    assert engine.prefill_chunk == 512 and not engine.overlap
    engine.close()


def test_overlap_must_be_true_false_or_none(llama):
    with pytest.raises(InvalidRequestError, match="overlap must be true or false"):
        Engine(llama.loaded, overlap="yes")


# -- any schedule ---------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_KINDS = [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0, top_logprobs=2),
          dict(temperature=1.0, top_p=1.0, seed=5, stop=["the"]), dict(temperature=0.7, top_k=20, seed=3,
          repetition_penalty=1.3), dict(temperature=0.8, seed=2, presence_penalty=0.5, frequency_penalty=0.3),
          dict(temperature=0.6, min_p=0.1, seed=9, stop=["\n"])]
_alone: dict = {}


@pytest.fixture(scope="module")
def loaded():
    """A model of its own, for engines made and closed one after another (the Llama's own engine stays)."""
    return Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=8, seed=0).loaded


def _run_alone(loaded, prompts, prompt: int, kind: int, max_new_tokens: int):
    """(tokens, logprobs, finish_reason) of one request on an engine serving nothing else."""
    key = (prompt, kind, max_new_tokens)
    if key not in _alone:
        engine = Engine(loaded, seed=0, prefix_caching=False, prompt_lookup=0)
        stream = engine.submit(prompts[prompt], max_new_tokens, **_KINDS[kind])
        chunks = list(stream)
        engine.close()
        _alone[key] = ([c.token for c in chunks], [c.logprob for c in chunks], stream.finish_reason)
    return _alone[key]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.lists(st.tuples(st.integers(0, 5), st.integers(0, len(_KINDS) - 1), st.integers(1, 12),
                                   st.integers(0, 3), st.one_of(st.none(), st.integers(1, 6))), min_size=1, max_size=12),
       overlap=st.booleans(), prompt_lookup=st.sampled_from([0, 2, 7]))
def test_any_schedule_gives_each_request_what_it_gets_alone(loaded, prompts, schedule, overlap, prompt_lookup):
    """Requests of every kind (greedy, seeded sampling with each control, stop strings, alternatives) arriving
    between any steps of the others, some cancelled, more of them than slots, the same prompt more than once
    (served from the prefix cache), with a decode step kept in flight or not (overlap: CUDA's default), with
    drafts from prompt lookup or not: each gets the tokens it gets alone without drafts, and a cancelled one
    a prefix of them."""
    if not loaded.runner.decodes_rows_alike:  # a drafted row may round differently: drafts give other replies
        prompt_lookup = 0
    engine = Engine(loaded, seed=0, overlap=overlap, prompt_lookup=prompt_lookup)
    live = []  # [iterator, chunks, cancel after, stream, request, done]
    for prompt, kind, max_new_tokens, wait, cancel_after in schedule:
        for _ in range(wait):  # the requests so far run that many more chunks first
            if live:
                _read_one(live[0])
                live = [entry for entry in live if not entry[5]]
        stream = engine.submit(prompts[prompt], max_new_tokens, **_KINDS[kind])
        live.append([iter(stream), [], cancel_after, stream, (prompt, kind, max_new_tokens), False])
    finished = list(live)
    while any(not entry[5] for entry in finished):
        for entry in finished:
            if not entry[5]:
                _read_one(entry)
    engine.close()
    for _, chunks, cancel_after, stream, request, _ in finished:
        tokens, logprobs, reason = _run_alone(loaded, prompts, *request)
        got = [c.token for c in chunks]
        if stream.finish_reason == "cancelled":
            assert cancel_after is not None and got == tokens[:len(got)], request
        else:
            assert (got, stream.finish_reason) == (tokens, reason), request
            assert [c.logprob for c in chunks] == pytest.approx(logprobs, abs=1e-4)


def _read_one(entry) -> None:
    """One more chunk of a live request (cancelling it once it has cancel-after chunks); marks it done at
    its end."""
    iterator, chunks, cancel_after, stream = entry[:4]
    try:
        chunks.append(next(iterator))
    except StopIteration:
        entry[5] = True
        return
    if cancel_after is not None and len(chunks) == cancel_after:
        stream.cancel()


def test_a_compiled_step_is_warmed_up_on_the_engines_own_thread_as_it_starts(meta_ckpt_dir, monkeypatch):
    """torch.compile's CUDA graphs are recorded per thread: warmed up in the loading thread, the step would be
    captured again in the engine's, on the first request. The engine warms it up on its own thread, and
    start() waits for that and raises what it raised."""
    import shutil
    import threading

    from llama_core.loader import load

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    loaded = load(meta_ckpt_dir, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32", compile=True,
                  warm_up=False)
    step = loaded.runner.decode_step
    threads = []  # the thread of each call of the compiled step
    compiled = step._step
    monkeypatch.setattr(step, "_step", lambda *args: (threads.append(threading.get_ident()), compiled(*args))[1])
    engine = Engine(loaded, seed=0)
    assert threads == []  # not warmed up as it loaded
    with engine:
        warmed_up_on = list(threads)  # the calls within start()
        assert len(_collect(engine.submit([1, 5, 9], 4, temperature=0))) == 4
    assert len(warmed_up_on) == 1 and warmed_up_on[0] != threading.get_ident()
    assert len(threads) > 1 and set(threads) == set(warmed_up_on)  # every step ran on the thread it warmed up on

    def fails() -> None:
        raise RuntimeError("the step does not compile")

    monkeypatch.setattr(step, "warm_up", fails)
    with pytest.raises(RuntimeError, match="the step does not compile"):
        engine.start()
    assert not engine.running and not engine.alive


def test_a_compiled_llama_warms_its_step_up_once_on_the_thread_that_runs_its_steps(meta_ckpt_dir, monkeypatch):
    """Llama.build(compile=True) leaves the warm-up to the thread that will run the steps: serve()'s engine thread,
    or, unserved, the thread of the first generation. Warmed up as it loaded too, a served Llama warmed up twice
    (on CUDA, two sets of CUDA graphs: one captured for a thread that never runs a step)."""
    import shutil
    import threading

    from llama_core.runner import DecodeStep

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    warmed_up_on = []  # the thread of each warm-up
    warm_up = DecodeStep.warm_up
    monkeypatch.setattr(DecodeStep, "warm_up", lambda step: (warmed_up_on.append(threading.get_ident()), warm_up(step)))
    build = dict(max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32", compile=True, seed=0)

    served = Llama.build(meta_ckpt_dir, **build)
    assert warmed_up_on == []  # not as it loaded
    with served.serve() as engine:
        assert len(warmed_up_on) == 1 and warmed_up_on[0] != threading.get_ident()  # on the engine's thread
        assert len(_collect(engine.submit([1, 5, 9], 4, temperature=0))) == 4
    assert len(warmed_up_on) == 1

    warmed_up_on.clear()
    unserved = Llama.build(meta_ckpt_dir, **build)
    assert warmed_up_on == []
    for _ in range(2):
        assert len(unserved.generate([[1, 5, 9]], 4, temperature=0)[0][0]) == 4
    assert warmed_up_on == [threading.get_ident()]  # once, on the thread that ran the steps

    # A Llama over a model in memory, the same way (it warmed up as it was made, and again on serve()'s thread).
    warmed_up_on.clear()
    model = Llama.build(meta_ckpt_dir, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32").model
    served = Llama.from_model(model, unserved.tokenizer, 64, 2, seed=0, compile=True)
    assert warmed_up_on == []
    with served.serve() as engine:
        assert len(_collect(engine.submit([1, 5, 9], 4, temperature=0))) == 4
    assert len(warmed_up_on) == 1 and warmed_up_on[0] != threading.get_ident()
    warmed_up_on.clear()
    unserved = Llama.from_model(model, unserved.tokenizer, 64, 2, seed=0, compile=True)
    unserved.warm_up()  # now, rather than in the first generation
    assert warmed_up_on == [threading.get_ident()]
    assert len(unserved.generate([[1, 5, 9]], 4, temperature=0)[0][0]) == 4
    unserved.warm_up()
    assert warmed_up_on == [threading.get_ident()]


def test_the_apps_engine_in_this_process_is_closed_when_it_fails_to_start(meta_ckpt_dir, monkeypatch):
    """open_engine(single_process=True) whose engine fails as it starts (its compiled step does not warm up):
    the engine is closed, giving the model's KV cache back, not left holding it for no one."""
    from llama_core.runner import ModelRunner
    from llama_core.serving import launch

    loaded = []
    load = launch.load
    monkeypatch.setattr(launch, "load", lambda **build: loaded.append(load(**build)) or loaded[-1])

    def fails(self) -> None:
        raise RuntimeError("the step does not compile")

    monkeypatch.setattr(ModelRunner, "warm_up", fails)
    with pytest.raises(RuntimeError, match="the step does not compile"):
        launch.open_engine(meta_ckpt_dir, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32", threads=1,
                           single_process=True)
    monkeypatch.undo()
    with Engine(loaded[0], seed=0) as engine:  # another engine may serve the model
        assert len(_collect(engine.submit([1, 5, 9], 4, temperature=0))) == 4


# -- a prompt that fills the context ---------------------------------------------------------------------
FULL = 64  # the context of the engines below


@pytest.fixture(scope="module")
def short_context(llama) -> Llama:
    """The same weights with a context of FULL tokens."""
    return Llama.build(engine_model_dir(), max_seq_len=FULL, max_batch_size=2, seed=0)


def _words(llama, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    tokens = [llama.tokenizer.bos_id]
    while len(tokens) < count:
        tokens += llama.tokenizer.encode(" " + rng.choice("the king and queen of my lord good night".split()),
                                         bos=False, eos=False)
    return tokens[:count]


def _scored(engine, prompt: list[int]) -> tuple[list[float], int, float, str]:
    """(prompt logprobs, the token drawn after it greedily, its logprob, finish reason) of a one-token reply."""
    stream = engine.submit(prompt, 1, temperature=0, prompt_logprobs=True)
    chunks = list(stream)
    assert len(chunks) == 1
    return stream.prompt_logprobs, chunks[0].token, chunks[0].logprob, stream.finish_reason


@pytest.mark.parametrize("prefill_chunk", [None, 16])
def test_a_prompt_filling_the_context_is_scored_as_in_a_longer_one(llama, short_context, prefill_chunk):
    """echo with max_tokens 0 (lm-evaluation-harness's windows): one token drawn after a prompt of max_seq_len
    tokens needs no place in the cache, so the prompt is accepted, whole or a chunk at a time, and scored as a
    model with room to spare scores it."""
    prompt = _words(llama, FULL, seed=3)
    with llama.serve() as roomy:
        expected = _scored(roomy, prompt)
    with contextlib.closing(Engine(short_context.loaded, seed=0, prefill_chunk=prefill_chunk).start()) as engine:
        lps, token, logprob, finish = _scored(engine, prompt)
        assert len(lps) == FULL - 1 and lps == pytest.approx(expected[0], abs=1e-4)
        assert (token, finish) == (expected[1], "length") and logprob == pytest.approx(expected[2], abs=1e-4)
        with pytest.raises(ContextLengthError, match=f"prompt has {FULL + 1} tokens, but max_seq_len is {FULL}: "
                                                     f"it must be at most {FULL}$"):
            engine.submit(prompt + [prompt[1]], 1, prompt_logprobs=True)
        with pytest.raises(ContextLengthError, match=f"it must be at most {FULL - 1} to leave room for a reply"):
            engine.submit(prompt, 2)


def test_a_prompt_filling_the_context_is_prefilled_alone_not_padded_over(llama, short_context):
    """Its last position is the cache's last: a padded batch would write a longer batch-mate's padding there.
    Its prefix cached (63 tokens) and admitted with a 40-token prompt, it draws what it draws alone."""
    prompt, other = _words(llama, FULL, seed=4), _words(llama, 40, seed=5)
    with contextlib.closing(Engine(short_context.loaded, seed=0, prefix_caching=False).start()) as engine:
        alone = [(c.token, c.logprob) for c in engine.submit(prompt, 1, temperature=0)]
    with contextlib.closing(Engine(short_context.loaded, seed=0).start()) as engine:
        list(engine.submit(prompt, 1, temperature=0))  # its slot now holds it
        with engine._wakeup:  # the loop can't admit until both are queued
            cached, beside = engine.submit(prompt, 1, temperature=0), engine.submit(other, 1, temperature=0)
        drawn = [(c.token, c.logprob) for c in cached]
        list(beside)
    assert cached.cached_tokens == FULL - 1
    assert [t for t, _ in drawn] == [t for t, _ in alone] and drawn[0][1] == pytest.approx(alone[0][1], abs=1e-4)
