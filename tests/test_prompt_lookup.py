"""Prompt-lookup decoding: the drafts (llama_core.serving.lookup), and an engine that verifies them giving
every request the tokens, log-probabilities and endings it gets without drafts, in fewer steps."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from llama_core import InvalidRequestError, Llama, cpu_kernels
from llama_core.serving import Engine
from llama_core.serving.engine import DRAFT_PRICE_ROWS_AS_ONE, DRAFT_PRICE_ROWS_APART, DRAFT_ROWS
from llama_core.serving.lookup import NGRAM_SIZES, DraftPrice, PromptLookup
from llama_core.serving.prefix_cache import MIN_SHARED_PREFIX

from conftest import STORIES_DIR, engine_model_dir, needs_stories


# -- the drafts -------------------------------------------------------------------------------------------
def _latest_continuation(tokens: list[int], limit: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest matching suffix, searched from the end."""
    for n in NGRAM_SIZES:
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), cut=st.integers(0, 60), limit=st.integers(0, 9))
def test_the_candidate_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix(tokens, cut, limit):
    lookup = PromptLookup(tokens[:cut])
    lookup.extend(tokens[cut:])  # built in two goes, as the engine does (prompt, then each new token)
    assert lookup.tokens == tokens
    assert lookup.candidate(limit) == _latest_continuation(tokens, limit)


def test_a_sequence_with_no_earlier_occurrence_has_no_candidate():
    assert PromptLookup([5, 6, 7, 8]).candidate(4) == []
    assert PromptLookup([5, 6, 7, 5, 6]).candidate(4) == [7, 5, 6]  # "5 6" was followed by "7 5 6"
    assert PromptLookup([1, 2, 3, 9, 2, 3, 8, 1, 2, 3]).candidate(2) == [9, 2]  # "1 2 3" before the later "2 3"
    assert PromptLookup([4, 2, 3, 9, 2, 3, 8, 1, 2, 3]).candidate(2) == [8, 1]  # the latest "2 3"


def test_a_prediction_is_drafted_from_while_the_reply_follows_it_and_near_the_reply_s_place_after():
    prompt, prediction = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 12, 13, 20]
    lookup = PromptLookup(prompt + [10, 11], prediction=prediction, reply_start=3)
    assert lookup.candidate(4) == [12, 13, 14, 15]  # the reply so far is the prediction's beginning
    lookup.extend([99])  # the reply leaves it: "11 99" is nowhere in the prediction or before
    assert lookup.candidate(4) == []
    lookup.extend([12, 13])  # "12 13" is in the prediction twice: the place nearer the reply's 5 tokens wins
    assert lookup.candidate(4) == [14, 15, 16, 12]
    lookup.extend([14, 15, 16, 12, 13])
    assert lookup.candidate(4) == [20]  # now the later one
    assert PromptLookup(prompt + [10], prediction=[], reply_start=3).candidate(4) == []  # no prediction: as before


def test_drafts_lengthen_while_accepted_and_stop_while_rejected():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9] * 2)
    assert len(lookup.draft(7)) == 2  # an even chance to start with
    for _ in range(8):
        draft = lookup.draft(7)
        lookup.extend(draft + [draft[-1] % 9 + 1])  # all kept, and the token after them
    assert lookup.acceptance > 0.9 and len(lookup.draft(7)) == 7
    rng = random.Random(0)
    lookup = PromptLookup([rng.randrange(3) for _ in range(20)])
    for _ in range(200):  # text that a draft guesses one time in three, where a drafted token costs 0.4 of a step
        lookup.draft(7, price=0.4)
        lookup.extend([rng.randrange(3)])
    assert lookup.acceptance < 0.4 and lookup.draft(7, price=0.4) == [] and lookup.candidate(7) != []


def test_drafts_are_longer_where_drafted_tokens_cost_less():
    """At acceptance 0.6: 4 drafted tokens give 2.31 tokens a step for 1.2 steps' time at a price of 0.05, the
    most tokens per time; at 0.5 a step, 1 drafted token (1.6 tokens for 1.5) beats 2 (1.96 for 2)."""
    cheap, dear = (PromptLookup(list(range(10)) * 3, accepted=6.0, rejected=4.0) for _ in range(2))
    assert (len(cheap.draft(7, price=0.05)), len(dear.draft(7, price=0.5))) == (4, 1)


def test_the_price_of_a_drafted_token_is_learned_from_each_width_s_fastest_recent_forward():
    price = DraftPrice(prior=0.3, window=10, least=2)
    assert price.price == 0.3
    for width, seconds in ((3, 0.012), (3, 0.012), (1, 0.010)):
        price.record(width, seconds)
    assert price.price == 0.3  # one one-token forward is too few to compare with
    price.record(1, 0.010)
    assert price.price == pytest.approx(0.1)  # 2 drafted tokens added 20 % of a step
    price.record(5, 0.018)
    assert price.price == pytest.approx(0.1)  # a width timed once does not count yet
    price.record(5, 0.018)  # 4 drafted tokens added 80 %
    assert price.price == pytest.approx((0.1 + 0.2) / 2)
    for width, seconds in ((3, 0.5), (1, 0.25), (3, 0.5), (1, 0.25)):  # a busy moment: slow forwards change nothing
        price.record(width, seconds)
    assert price.price == pytest.approx((0.1 + 0.2) / 2)
    for _ in range(5):  # forwards got slower for good (a longer context): the last 10 alone count
        price.record(1, 0.020)
        price.record(3, 0.028)
    assert price.price == pytest.approx(0.2)
    for _ in range(2):
        price.record(2, 0.001)
    assert price.price == 0.03  # never below the floor


@settings(max_examples=200, deadline=None)
@given(records=st.lists(st.tuples(st.integers(1, 4), st.floats(0.001, 1.0)), max_size=40))
def test_the_learned_price_is_the_mean_share_of_each_width_s_fastest_forward_in_the_window(records):
    price = DraftPrice(prior=0.3, window=8, least=2)
    for i, (width, seconds) in enumerate(records):
        price.record(width, seconds)
        recent = records[max(0, i + 1 - 8) : i + 1]
        fastest = {w: min(s for v, s in recent if v == w) for w, _ in recent
                   if sum(v == w for v, _ in recent) >= 2}
        one = fastest.pop(1, None)
        expected = 0.3 if one is None or not fastest else max(
            0.03, sum((s / one - 1) / (w - 1) for w, s in fastest.items()) / len(fastest))
        assert price.price == pytest.approx(expected)


def test_a_fixed_price_is_never_learned():
    price = DraftPrice(prior=0.2, fixed=True)
    for width, seconds in [(1, 0.01), (4, 0.5)] * 5:
        price.record(width, seconds)
    assert price.price == 0.2


def test_a_sequence_that_stopped_drafting_starts_again_when_its_guesses_come_true():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9] * 2, accepted=0.0, rejected=5.0)
    assert lookup.draft(7) == []
    drafted = []
    for _ in range(30):
        drafted.append(lookup.draft(7))
        lookup.extend([lookup.tokens[-9]])  # the text goes on repeating: each guess was right
    assert drafted[0] == [] and len(drafted[-1]) == 7


def test_a_draft_is_no_longer_than_asked():
    lookup = PromptLookup([1, 2, 3] * 10, accepted=50.0, rejected=0.0)
    assert [len(lookup.draft(limit)) for limit in (0, 1, 3)] == [0, 1, 3]


# -- the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    return Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=4, seed=0).loaded


def _needs_rows_alike(loaded) -> None:
    if not loaded.runner.decodes_rows_alike:
        pytest.skip("a drafted reply is the undrafted one bit for bit only where a row's logits do not depend on "
                    "the forward it is in: llama_core's CPU kernels, which are not built or not used here")


PRICE = 0.1  # fixed, so that how far each step drafts does not follow the machine's timings

KINDS = [dict(temperature=0), dict(temperature=0.8, top_p=0.95, seed=3), dict(temperature=0, top_logprobs=3),
         dict(temperature=1.0, top_p=1.0, seed=5, stop=["the"]), dict(temperature=0.6, top_k=20, min_p=0.05, seed=9),
         dict(temperature=0, stop=["\n\n"])]


def _replies(engine: Engine, prompts: list[list[int]], kinds: list[dict], max_new_tokens: int,
             together: int = 1) -> list[tuple[list, str]]:
    """(chunks, finish reason) of each request, `together` of them submitted at a time."""
    replies = []
    for first in range(0, len(prompts), together):
        streams = [engine.submit(p, max_new_tokens, **kind)
                   for p, kind in zip(prompts[first : first + together], kinds[first : first + together])]
        for stream in streams:
            chunks = [(c.token, c.logprob, c.top_logprobs) for c in stream]
            replies.append((chunks, stream.finish_reason))
    return replies


def _prompts(loaded) -> list[list[int]]:
    texts = ["ROMEO:", "First Citizen:\nWe are accounted poor citizens", "To be, or not to be",
             "the king and the queen and the king", "Good night, good night!", "O Romeo, Romeo!"]
    return [loaded.tokenizer.encode(text, bos=True, eos=False) for text in texts]


@pytest.mark.parametrize("together", [1, 2])
def test_drafted_replies_are_the_undrafted_ones_in_fewer_steps(loaded, together):
    """Greedy and seeded sampling with each control, log-probabilities and alternatives, stop strings; one
    request at a time and two together (a step over both, drafts of different lengths)."""
    _needs_rows_alike(loaded)
    prompts, runs = _prompts(loaded), {}
    for prompt_lookup in (0, 7):
        engine = Engine(loaded, seed=0, prompt_lookup=prompt_lookup, draft_price=PRICE)
        runs[prompt_lookup] = _replies(engine, prompts, KINDS, 120, together)
        runs[prompt_lookup, "steps"] = engine.steps
        runs[prompt_lookup, "accepted"] = engine.accepted_tokens
        engine.close()
    assert runs[7] == runs[0]
    assert runs[7, "accepted"] > 0 and runs[7, "steps"] < runs[0, "steps"]
    if together == 1:  # each kept draft token is a step saved
        assert runs[7, "steps"] + runs[7, "accepted"] == runs[0, "steps"]
    assert {reason for _, reason in runs[0]} >= {"length", "stop"}


def test_drafts_stop_at_the_token_limit_and_the_end_of_the_context():
    llama = Llama.build(engine_model_dir(), max_seq_len=64, max_batch_size=2, seed=0)
    _needs_rows_alike(llama.loaded)
    prompt = llama.tokenizer.encode("the king and the queen and the king and the queen", bos=True, eos=False)
    runs = {}
    for prompt_lookup in (0, 7):
        engine = Engine(llama.loaded, seed=0, prompt_lookup=prompt_lookup, draft_price=PRICE)
        runs[prompt_lookup] = _replies(engine, [prompt] * 3, [dict(temperature=0)] * 3, 64 - len(prompt))
        runs[prompt_lookup] += _replies(engine, [prompt], [dict(temperature=0)], 13)
        runs[prompt_lookup, "accepted"] = engine.accepted_tokens
        engine.close()
    assert runs[7] == runs[0] and runs[7, "accepted"] > 0
    assert [len(chunks) for chunks, _ in runs[7]] == [64 - len(prompt)] * 3 + [13]
    assert all(reason == "length" for _, reason in runs[7])


def test_a_conversation_goes_on_from_the_prefix_cache_after_drafted_steps(loaded):
    """What a slot is said to hold after drafted steps (the kept tokens, not the rejected drafts nor the last
    token, never written) serves the next turn, which sends the conversation so far again. Turns that end
    at a stop string, an end of sequence or their limit, so that some end inside a drafted step."""
    _needs_rows_alike(loaded)
    turn = loaded.tokenizer.encode("\n\nJULIET:", bos=False, eos=False)
    runs = {}
    for prompt_lookup in (0, 7):
        engine = Engine(loaded, seed=0, prompt_lookup=prompt_lookup, draft_price=PRICE)
        runs[prompt_lookup] = []
        for i, conversation in enumerate(_prompts(loaded) * 2):
            held = 0
            for limit in (9 + i, 20, 31 - i):
                stream = engine.submit(conversation, limit, temperature=0, stop=[",", ";"])
                reply = [(c.token, c.logprob) for c in stream]
                runs[prompt_lookup].append((reply, stream.cached_tokens, held if held >= MIN_SHARED_PREFIX else 0))
                # its slot holds the conversation and reply but the last token, unless that led to an end of sequence
                held = len(conversation) + len(reply) - (stream.finish_reason != "eos")
                conversation = conversation + [token for token, _ in reply] + turn
        runs[prompt_lookup, "accepted"] = engine.accepted_tokens
        engine.close()
    assert runs[7] == runs[0] and runs[7, "accepted"] > 0
    assert all(cached == held for _, cached, held in runs[7])


def test_requests_with_penalties_are_not_drafted(loaded):
    prompts = _prompts(loaded)[:2]
    kinds = [dict(temperature=0, repetition_penalty=1.2), dict(temperature=0.7, seed=1, frequency_penalty=0.5)]
    engine = Engine(loaded, seed=0, prompt_lookup=7)
    drafted = _replies(engine, prompts, kinds, 60, together=2)
    assert engine.drafted_tokens == 0
    engine.close()
    engine = Engine(loaded, seed=0, prompt_lookup=0)
    assert _replies(engine, prompts, kinds, 60, together=2) == drafted
    engine.close()


def test_a_wide_batch_is_not_drafted(loaded):
    prompts = _prompts(loaded)[:4]
    engine = Engine(loaded, seed=0, prompt_lookup=7)
    streams = [engine.submit(p, 4, temperature=0) for p in prompts]  # 4 rows and a draft each would pass 8
    for stream in streams:
        list(stream)
    assert engine.drafted_tokens == 0
    engine.close()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_drafted_replies_of_quantized_weights_are_the_undrafted_ones(quantize):
    """int8 and int4 round each row's activations on their own, so a row's result is its own here too."""
    llama = Llama.build(engine_model_dir(), max_seq_len=256, max_batch_size=2, seed=0, quantize=quantize)
    _needs_rows_alike(llama.loaded)
    prompts = _prompts(llama.loaded)[:3]
    runs = {}
    for prompt_lookup in (0, 7):
        engine = Engine(llama.loaded, seed=0, prompt_lookup=prompt_lookup, draft_price=PRICE)
        runs[prompt_lookup] = _replies(engine, prompts, KINDS[:3], 100)
        runs[prompt_lookup, "accepted"] = engine.accepted_tokens
        engine.close()
    assert runs[7] == runs[0] and runs[7, "accepted"] > 0


@needs_stories
def test_drafted_replies_of_the_real_stories260k_model_are_the_undrafted_ones():
    llama = Llama.build(STORIES_DIR, max_seq_len=256, max_batch_size=2, seed=0, dtype="float32")
    _needs_rows_alike(llama.loaded)
    prompts = [[1], [1, 403, 407], [1, 48]]
    runs = {}
    for prompt_lookup in (0, 7):
        engine = Engine(llama.loaded, seed=0, prompt_lookup=prompt_lookup, draft_price=PRICE)
        runs[prompt_lookup] = _replies(engine, prompts * 2, [KINDS[0]] * 3 + [KINDS[1]] * 3, 200, together=2)
        runs[prompt_lookup, "accepted"] = engine.accepted_tokens
        engine.close()
    assert runs[7] == runs[0] and runs[7, "accepted"] > 0


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_drafts_are_priced_low_where_the_products_read_a_few_rows_for_one(quantize):
    llama = Llama.build(engine_model_dir(), max_seq_len=64, max_batch_size=1, seed=0, quantize=quantize)
    _needs_rows_alike(llama.loaded)
    rows = cpu_kernels.rows_read_as_one("float" if quantize is None else quantize)
    assert llama.loaded.runner.rows_read_as_one == rows
    engine = Engine(llama.loaded)
    assert engine.draft_price.prior == (DRAFT_PRICE_ROWS_AS_ONE if rows >= DRAFT_ROWS else DRAFT_PRICE_ROWS_APART)
    engine.close()


def test_the_default_drafts_on_the_cpu_kernels_only(loaded):
    engine = Engine(loaded)
    assert engine.prompt_lookup == (5 if loaded.runner.decodes_rows_alike else 0)
    assert not engine.overlap
    engine.close()


@pytest.mark.parametrize("value", [-1, 1.5, True, "7"])
def test_a_bad_prompt_lookup_is_refused_naming_it(loaded, value):
    with pytest.raises(InvalidRequestError, match="prompt_lookup must be a non-negative integer"):
        Engine(loaded, prompt_lookup=value)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_a_bad_draft_price_is_refused_naming_it(loaded, value):
    with pytest.raises(InvalidRequestError, match="draft_price must be a number of 0 or more"):
        Engine(loaded, draft_price=value)


def test_llama_build_refuses_a_bad_prompt_lookup_before_reading_a_checkpoint(tmp_path):
    with pytest.raises(InvalidRequestError, match="prompt_lookup"):
        Llama.build(tmp_path / "nowhere", prompt_lookup=-2)


def test_a_llama_serves_with_its_own_prompt_lookup(loaded):
    llama = Llama(loaded, seed=0, prompt_lookup=0)
    llama.generate([loaded.tokenizer.encode("ROMEO:", bos=True, eos=False)], 40, temperature=0)
    assert llama.engine.prompt_lookup == 0 and llama.engine.drafted_tokens == 0
    with llama.serve() as engine:
        assert engine.prompt_lookup == 0
    with llama.serve(prompt_lookup=3) as engine:
        assert engine.prompt_lookup == 3
    llama.engine.close()
