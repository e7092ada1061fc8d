"""Prefix caching: a request computes only what follows the longest prefix of its prompt that a KV-cache slot
holds (its own chat's earlier turns, another user's system prompt), and gets the tokens and log-probabilities
it gets without the cache, however the cached part came there."""

from __future__ import annotations

import pytest
import torch

from conftest import build_llama
from llama_core import InvalidRequestError, Llama, load
from llama_core.quantize import quantize_int8
from llama_core.runner import DecodeStep
from llama_core.serving import Engine, EngineProcess, RequestFailedError, stream_chat
from llama_core.serving.launch import open_engine
from llama_core.serving.prefix_cache import MIN_SHARED_PREFIX, Placement, PrefixCache, shared_prefix_length
from test_engine import _FailOnLength

CHAT = [
    "Good morrow, my lord. How fares the king?", "What news from Verona?", "Who comes here?",
    "Speak, what trade art thou?", "Where is Romeo?", "Tell me, good friar, what hath chanced?",
    "Shall we go see the revels of the city?", "I pray you, sir, what is your name?", "Why dost thou weep?",
    "Farewell, and God be with you.",
]
SYSTEM = "You are a courteous player in a Shakespeare company."
LOGPROB_TOLERANCE = 1e-4  # the cached part was computed in forwards of other shapes: float sums differ in the last bits


def _embedded_engine(prefix_caching: bool, **options) -> Engine:
    loaded = load(None, max_seq_len=512, max_batch_size=options.pop("max_batch_size", 4), device="cpu", dtype="float32")
    return Engine(loaded, seed=0, prefix_caching=prefix_caching, **options)


@pytest.fixture(scope="module")
def on() -> Engine:
    """The embedded model with prefix caching; its turns run in the thread that reads a stream."""
    engine = _embedded_engine(True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def off() -> Engine:
    engine = _embedded_engine(False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def text(on) -> list[int]:
    """A long prompt of the embedded model (BOS first)."""
    lines = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 3
    return on.tokenizer.encode(lines, bos=True, eos=False)


def _run(engine, prompt, max_new_tokens: int = 12, **options):
    """(tokens, log-probabilities, cached_tokens) of one greedy request."""
    stream = engine.submit(list(prompt), max_new_tokens, temperature=0, **options)
    chunks = list(stream)
    return [c.token for c in chunks], [c.logprob for c in chunks], stream.cached_tokens


def _assert_same_reply(got, expected) -> None:
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=LOGPROB_TOLERANCE)


# -- choosing a slot ---------------------------------------------------------------------------------------
def test_shared_prefix_length_across_blocks_and_types():
    a = list(range(200))
    assert shared_prefix_length(a, a) == 200
    assert shared_prefix_length(a, a[:130] + [-1]) == 130
    assert shared_prefix_length(tuple(a), a[:64]) == 64
    assert shared_prefix_length(a, [5]) == 0 and shared_prefix_length((), a) == 0


def test_a_prompt_goes_to_the_free_slot_holding_its_longest_prefix_else_the_least_recently_used():
    cache = PrefixCache(4)
    history = tuple(range(100))
    cache.release(2, history)
    cache.release(0, tuple(range(500, 600)))
    cache.release(1, history[:40])
    assert cache.place(history + (7, 8), [0, 1, 2, 3]) == Placement(2, 100)
    assert cache.place((999,) * 50, [0, 1, 2, 3]) == Placement(3)  # never used: least recently
    assert cache.place((999,) * 50, [0, 1, 2]) == Placement(2)  # released first
    # Sharing too little is sharing nothing: the slot's history is not given up for it.
    assert cache.place(history[: MIN_SHARED_PREFIX - 1] + (-1,) * 20, [0, 1, 2, 3]) == Placement(3)


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(2)
    cache.release(0, tuple(range(50)))
    assert cache.place(tuple(range(50)), [0, 1]) == Placement(0, 49)
    assert cache.place(tuple(range(30)), [0, 1]).cached_tokens == 29


def test_a_prefix_held_elsewhere_is_copied_into_the_least_recently_used_free_slot():
    cache = PrefixCache(4)
    system = tuple(range(60))
    cache.release(3, tuple(range(1000, 1010)))
    busy = {0: system + (1, 2, 3)}
    assert cache.place(system + (9,), [1, 2, 3], busy) == Placement(1, 60, copy_from=0)
    # An idle slot holding more than twice the prefix keeps its history; the prefix is copied.
    cache.release(2, system + tuple(range(2000, 2200)))
    assert cache.place(system + (9,), [1, 2, 3], busy={}) == Placement(1, 60, copy_from=2)
    cache.release(1, system[:30])
    assert cache.place(system + (9,), [1, 2, 3], busy={}) == Placement(3, 60, copy_from=2)


def test_a_request_kept_to_some_slots_moves_the_history_there_out_rather_than_losing_it():
    cache = PrefixCache(4)
    history, other = tuple(range(100, 140)), tuple(range(200, 240))
    cache.release(3, other)
    cache.release(0, history)  # the most recent
    # A new prompt kept to slot 0: slot 0's history goes to the least recently used other free slot.
    assert cache.place((7, 8, 9), [0, 1, 2, 3], targets=[0]) == Placement(0, keep_held_in=1)
    # Its own prefix reused in place, the history being mostly that prefix: nothing to move.
    assert cache.place(history[:30] + (9,), [0, 1, 2, 3], targets=[0]) == Placement(0, 30)
    # A short prefix of it reused in place: the rest of the history is moved out first.
    assert cache.place(history[:16] + (9,), [0, 1, 2, 3], targets=[0]) == Placement(0, 16, keep_held_in=1)
    # A prefix held outside the targets is copied in; the copy's source is never the one overwritten.
    assert cache.place(other[:20] + (9,), [0, 3], targets=[0]) == Placement(0, 20, copy_from=3)
    # A history older than the one it would displace stays, and a short one is not worth moving.
    cache.release(1, tuple(range(300, 340)))
    assert cache.place((7, 8, 9), [0, 1], targets=[0]) == Placement(0)
    cache.release(2, (5, 6))
    assert cache.place((7, 8, 9), [1, 2, 3], targets=[2]) == Placement(2)
    moved = PrefixCache(2)
    moved.release(0, history)
    moved.moved(0, 1)
    assert moved.held(1) == history and moved.place(history + (9,), [1]) == Placement(1, len(history))


def test_a_request_waits_for_a_prefix_another_is_computing():
    cache = PrefixCache(4)
    system = tuple(range(60))
    computing = [system + (1,)]
    assert cache.place(system + (2,), [1, 2, 3], {0: system[:10]}, computing) is None
    # Once written, it is copied; a prompt sharing less than MIN_SHARED_PREFIX never waits.
    assert cache.place(system + (2,), [1, 2, 3], {0: system}, computing) == Placement(1, 60, copy_from=0)
    assert cache.place(system[:MIN_SHARED_PREFIX - 1] + (-5,), [1, 2, 3], {0: ()}, computing) == Placement(1)


def test_without_caching_or_with_prompt_logprobs_nothing_is_reused():
    disabled = PrefixCache(3, enabled=False)
    disabled.release(2, tuple(range(50)))
    assert disabled.place(tuple(range(50)), [1, 2]) == Placement(1)
    cache = PrefixCache(3)
    cache.release(0, tuple(range(50)))
    assert cache.place(tuple(range(50)), [0, 1, 2], reuse=False) == Placement(1)
    cache.forget(0)
    assert cache.held(0) == () and cache.place((5,) * 20, [0, 1, 2]) == Placement(0)


def test_copy_prefix_copies_each_layers_rows_and_refuses_bad_slots(meta_ckpt_dir):
    runner = build_llama(meta_ckpt_dir).runner
    caches = [layer.attention.kv_cache for layer in runner.model.layers]
    for cache in caches:
        cache.k_cache[1].normal_()
        cache.v_cache[1].normal_()
    runner.copy_prefix(1, 3, 10)
    for cache in caches:
        assert torch.equal(cache.k_cache[3, :, :10], cache.k_cache[1, :, :10])
        assert torch.equal(cache.v_cache[3, :, :10], cache.v_cache[1, :, :10])
    for bad in ((1, 1, 5), (0, 4, 5), (0, 1, 0), (0, 1, runner.max_seq_len + 1)):
        with pytest.raises(ValueError):
            runner.copy_prefix(*bad)


# -- the same replies, with less computed ----------------------------------------------------------------
def test_a_ten_turn_chat_computes_little_more_than_each_new_message(on, off):
    dialog = [{"role": "system", "content": SYSTEM}]
    fractions = []
    for message in CHAT:
        dialog.append({"role": "user", "content": message})
        cached, plain = stream_chat(on, dialog, temperature=0, max_new_tokens=16), stream_chat(off, dialog, temperature=0, max_new_tokens=16)
        replies = [list(cached), list(plain)]
        _assert_same_reply(*[([c.token for c in r], [c.logprob for c in r if c.token >= 0]) for r in replies])
        assert cached.dropped_pairs == 0 and plain.cached_tokens == 0
        fractions.append(cached.cached_tokens / cached.prompt_tokens)
        dialog.append({"role": "assistant", "content": "".join(c.text for c in replies[0])})
    # Each later turn's prompt is the last one's, its reply and the new message: the first two are cached.
    assert fractions[0] == 0 and all(f >= 0.75 for f in fractions[1:]), fractions
    assert sum(fractions[4:]) / len(fractions[4:]) >= 0.85, fractions


def test_interleaved_users_each_reuse_their_own_history(on, off):
    users = [f"I am {name}, and I come from {town}." for name, town in (("Hal", "York"), ("Kate", "Padua"), ("Tom", "Kent"))]
    dialogs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}] for u in users]
    for turn in range(4):
        if turn % 2:  # one user first, the others joining while it decodes (prefilled in its decode steps)
            first = [stream_chat(engine, dialogs[0], temperature=0, max_new_tokens=12) for engine in (on, off)]
            heads = [next(iter(s)) for s in first]
            rest = [[stream_chat(engine, d, temperature=0, max_new_tokens=12) for d in dialogs[1:]] for engine in (on, off)]
            streams = [[s] + r for s, r in zip(first, rest)]
            replies = [[[h] + list(s[0])] + [list(x) for x in s[1:]] for h, s in zip(heads, streams)]
        else:  # all at once: one padded prefill of prompts that start after their own cached prefixes
            streams = [[stream_chat(engine, d, temperature=0, max_new_tokens=12) for d in dialogs] for engine in (on, off)]
            replies = [[list(s) for s in row] for row in streams]
        for got, expected in zip(*replies):
            _assert_same_reply(([c.token for c in got], [c.logprob for c in got if c.token >= 0]),
                               ([c.token for c in expected], [c.logprob for c in expected if c.token >= 0]))
        if turn:
            assert all(s.cached_tokens >= 0.6 * s.prompt_tokens for s in streams[0]), [s.cached_tokens for s in streams[0]]
        for dialog, reply in zip(dialogs, replies[0]):
            dialog += [{"role": "assistant", "content": "".join(c.text for c in reply)},
                       {"role": "user", "content": f"And then, on day {turn}?"}]


def test_prompts_sharing_less_or_more_than_the_cache_holds(on, off, text):
    first = _run(on, text, 20)
    _assert_same_reply(first, _run(off, text, 20))
    cases = {
        "strict prefix of the cache": (text[:30], 29),
        "the cache is longer: prompt and part of its reply": (text + first[0][:5], len(text) + 5 - 1),
        "diverges at token 1": ([text[0], text[1] + 1] + text[2:], 0),
        "the same prompt again": (text, len(text) - 1),
    }
    for name, (prompt, expected_cached) in cases.items():
        got = _run(on, prompt)
        _assert_same_reply(got, _run(off, prompt))
        assert got[2] == expected_cached, name


def test_a_prefix_in_a_busy_slot_is_copied_not_computed(on, off, text):
    system = text[:40]
    asking = system + on.tokenizer.encode(" JULIET: Ay me!", bos=False, eos=False)
    joining = system + on.tokenizer.encode(" NURSE: Madam!", bos=False, eos=False)
    on.prefix_cache.forget_all()  # nothing idle holds the system prompt: only the busy slot will
    expected = [_run(off, asking, 30), _run(off, joining)]
    running = on.submit(asking, 30, temperature=0)
    chunks = iter(running)
    head = next(chunks)
    before = on.prefilled_tokens
    joined = _run(on, joining)
    rest = list(chunks)
    _assert_same_reply(([head.token] + [c.token for c in rest], [head.logprob] + [c.logprob for c in rest]), expected[0])
    _assert_same_reply(joined, expected[1])
    shared = shared_prefix_length(asking, joining)  # the system prompt, and the space both questions begin with
    assert shared >= len(system) and joined[2] == shared and on.prefilled_tokens - before == len(joining) - shared


def test_a_system_prompt_shared_by_eight_users_is_computed_once(text):
    engines = [_embedded_engine(caching, max_batch_size=8) for caching in (True, False)]
    tokenizer = engines[0].tokenizer
    system = text[:100]
    questions = [tokenizer.encode(f" {name}: what news?", bos=False, eos=False)
                 for name in ("Romeo", "Juliet", "Tybalt", "Mercutio", "Benvolio", "Paris", "Capulet", "Friar")]
    try:
        replies = []
        for engine in engines:
            streams = [engine.submit(system + q, 8, temperature=0) for q in questions]  # all before any turn runs
            chunks = [list(s) for s in streams]
            replies.append([([c.token for c in r], [c.logprob for c in r], s.cached_tokens) for r, s in zip(chunks, streams)])
        for got, expected in zip(*replies):
            _assert_same_reply(got, expected)
        shared = [shared_prefix_length(system + questions[0], system + q) for q in questions[1:]]
        assert min(shared) >= len(system) and [r[2] for r in replies[0]] == [0] + shared
        assert engines[0].prefilled_tokens == sum(len(system) + len(q) for q in questions) - sum(shared)
        assert engines[1].prefilled_tokens == sum(len(system) + len(q) for q in questions)
    finally:
        for engine in engines:
            engine.close()


def test_a_cancelled_prefill_keeps_what_it_wrote(text):
    engines = [_embedded_engine(caching, prefill_chunk=8) for caching in (True, False)]
    prompt = text[:60]
    try:
        expected = _run(engines[1], prompt)
        stream = engines[0].submit(prompt, 12, temperature=0)
        for _ in range(3):  # three chunks of eight
            engines[0].pump()
        stream.cancel()
        engines[0].pump()
        assert stream.finish_reason is None and list(stream) == [] and stream.finish_reason == "cancelled"
        again = _run(engines[0], prompt)
        _assert_same_reply(again, expected)
        assert again[2] == 24
    finally:
        for engine in engines:
            engine.close()


def test_prompt_logprobs_are_computed_never_taken_from_the_cache(on, off, text):
    _run(on, text)
    got, expected = (engine.submit(text, 4, temperature=0, prompt_logprobs=True) for engine in (on, off))
    got_lps, expected_lps = [c.logprob for c in got], [c.logprob for c in expected]
    assert got.cached_tokens == 0
    assert got.prompt_logprobs == pytest.approx(expected.prompt_logprobs, abs=LOGPROB_TOLERANCE)
    assert got_lps == pytest.approx(expected_lps, abs=LOGPROB_TOLERANCE)
    assert _run(on, text)[2] == len(text) - 1  # and what it computed serves the next request


def test_a_failed_request_leaves_nothing_cached(text):
    engine = _embedded_engine(True, prefill_chunk=20)
    runner, real = engine.runner, engine.runner.model
    prompt = text[:50]  # chunks of 20, 20 and 10: the last one fails
    try:
        runner.model = _FailOnLength(real, 10)
        with pytest.raises(RequestFailedError, match="memory"):
            _run(engine, prompt)
        runner.model = real
        assert _run(engine, prompt)[2] == 0
    finally:
        runner.model = real
        engine.close()


def test_the_model_run_directly_makes_the_engine_forget_what_slots_hold(on, off, text):
    _run(on, text)
    with torch.inference_mode():
        on.runner.model(torch.tensor([text[:1] * 10]), kv_len=10)  # writes rows 0 and on, behind the engine's back
    got = _run(on, text)
    _assert_same_reply(got, _run(off, text))
    assert got[2] == 0


# -- every way the model runs --------------------------------------------------------------------------------
def _reuse_every_way(engine, prompt: list[int]) -> tuple[list[tuple], list[tuple]]:
    """Runs requests that find their prefix in an idle slot, in an idle slot holding more, and in a busy slot:
    their replies, and the KV-cache copies made."""
    copies, copy_prefix = [], engine.runner.copy_prefix
    engine.runner.copy_prefix = lambda *call: (copies.append(call), copy_prefix(*call))[1]
    results = [_run(engine, prompt, 8)]
    results.append(_run(engine, prompt + results[0][0][:4] + prompt[1:4], 8))
    results.append(_run(engine, prompt[:20], 8))
    running = engine.submit(prompt + prompt[5:9], 10, temperature=0)
    chunks = iter(running)
    head = next(chunks)
    results.append(_run(engine, prompt + prompt[9:12], 8))
    rest = list(chunks)
    results.append(([head.token] + [c.token for c in rest], [head.logprob] + [c.logprob for c in rest], running.cached_tokens))
    del engine.runner.copy_prefix
    return results, copies


@pytest.fixture(scope="module")
def tiny_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Once upon a time there was a little model that read tokens and wrote text", bos=True, eos=False)


@pytest.fixture(scope="module")
def uncached_replies(meta_ckpt_dir, tiny_prompt) -> list[tuple]:
    replies, copies = _reuse_every_way(Engine(build_llama(meta_ckpt_dir).loaded, prefix_caching=False), tiny_prompt)
    assert copies == []
    return replies


def _static_step(llama: Llama) -> Llama:
    llama.runner.decode_step = DecodeStep(llama.model, llama.max_batch_size, static=True)
    return llama


@pytest.mark.parametrize("variant", ["eager", "static step", "int8", "device_map"])
def test_replies_equal_without_the_cache_however_the_model_runs(variant, meta_ckpt_dir, tiny_prompt, uncached_replies):
    if variant == "device_map":  # accelerate's hooks run each layer; each layer's cache is copied where it lives
        layers = {f"layers.{i}": "cpu" for i in range(2)}
        llama = build_llama(meta_ckpt_dir, device="auto", device_map={"tok_embeddings": "cpu", **layers, "norm": "cpu", "output": "cpu"})
    else:
        llama = build_llama(meta_ckpt_dir)
    if variant == "static step":
        _static_step(llama)
    expected = uncached_replies
    if variant == "int8":
        quantize_int8(llama.model)
        reference = build_llama(meta_ckpt_dir)
        quantize_int8(reference.model)
        expected = _reuse_every_way(Engine(reference.loaded, prefix_caching=False), tiny_prompt)[0]
    got, copies = _reuse_every_way(Engine(llama.loaded), tiny_prompt)
    for g, e in zip(got, expected):
        _assert_same_reply(g, e)
    n = len(tiny_prompt)
    assert [g[2] for g in got] == [0, n + 4, 19, n, n]
    if variant == "static step":
        # New requests take the lowest free slot (the static step's rows stay fewest): the history there is
        # moved out first (59 tokens, then the short prompt's 27), and the prefix copied in (n).
        assert [(src, dst, length) for src, dst, length in copies] == [(0, 1, 59), (0, 2, 27), (1, 0, n)]
    else:
        # The short prompt's prefix is copied out of a slot holding a longer history; the last one's out of a busy slot.
        assert [length for _, _, length in copies] == [19, n]


# -- the options ---------------------------------------------------------------------------------------------
def test_prefix_caching_must_be_a_bool(llama):
    with pytest.raises(InvalidRequestError, match="prefix_caching must be true or false"):
        Engine(llama.loaded, prefix_caching="yes")


def test_open_engine_passes_prefix_caching_on():
    engine = open_engine(single_process=True, device="cpu", threads=1, prefix_caching=False)
    try:
        assert engine.prefix_cache.enabled is False
    finally:
        engine.close()


def test_cached_tokens_reach_the_parent_of_an_engine_process(off, text):
    build = dict(ckpt_dir=None, max_seq_len=512, max_batch_size=4, device="cpu", dtype="float32", seed=0)
    expected = [_run(off, text, 8), _run(off, text + text[1:6], 8)]
    for caching in (True, False):
        with EngineProcess(build, threads=1, prefix_caching=caching) as process:
            got = [_run(process, text, 8), _run(process, text + text[1:6], 8)]
            stats = process.prefilled_tokens, process.cached_tokens
        for g, e in zip(got, expected):
            _assert_same_reply(g, e)
        cached = len(text) if caching else 0
        assert [g[2] for g in got] == [0, cached]
        assert stats == (2 * len(text) + 5 - cached, cached)
