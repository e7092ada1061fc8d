"""Replies held to a grammar (llama_core.grammar): JSON schemas, regular expressions and Lark grammars, on the
embedded trained model, through the facade and the engine."""

from __future__ import annotations

import functools
import json
import pickle
import random
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import needs_stories
from llama_core import Grammar, InvalidRequestError, Llama, SamplingParams
from llama_core.dialog import SPECIAL_TAGS
from llama_core.serving import GrammarFailedError, RequestFailedError, stream_chat
from llama_core.serving.grammar_matcher import GrammarMatcher, allowed_tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad", "wroth"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "lines"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llama() -> Llama:
    """The embedded trained model (tiny-shakespeare), four slots."""
    return Llama.build(max_seq_len=384, max_batch_size=4, seed=0)


def follows_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "mood", "lines"}
            and isinstance(value["name"], str) and len(value["name"]) <= 24
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120
            and value["mood"] in ("merry", "sad", "wroth")
            and isinstance(value["lines"], list) and len(value["lines"]) <= 2
            and all(isinstance(line, str) and len(line) <= 16 for line in value["lines"]))


# -- making grammars -------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, named", [
    (lambda: Grammar.json({"type": "foo"}), "schema is not valid: Invalid type: foo"),
    (lambda: Grammar.json({"properties": {"x": {"$ref": "#/nowhere"}}}), "schema is not valid"),
    (lambda: Grammar.json({"type": "string", "pattern": "(("}), "schema is not valid"),
    (lambda: Grammar.json([1, 2]), "schema must be a JSON Schema object, got list"),
    (lambda: Grammar.json({"enum": [{1, 2}]}), "schema must hold only JSON values"),
    (lambda: Grammar.json({"type": "foo"}, name="response_format.json_schema.schema"),
     "response_format.json_schema.schema is not valid"),
    (lambda: Grammar.json_text("{type", name="--json-schema"), "--json-schema is not JSON"),
    (lambda: Grammar.json_text("null"), "schema must be a JSON Schema object, got NoneType"),
    (lambda: Grammar.json(False), "schema is false, which no reply can match"),
    (lambda: Grammar.regex("(("), "pattern is not valid: regex parse error"),
    (lambda: Grammar.regex(""), "pattern must be a non-empty string"),
    (lambda: Grammar.lark("start: missing"), "grammar is not valid"),
    (lambda: Grammar.lark(3), "grammar must be a non-empty string"),
    (lambda: Grammar.regex("a" * 100_001), "pattern must be at most 100,000 characters"),
    (lambda: SamplingParams(grammar='{"type": "object"}'), "grammar must be a llama_core.Grammar"),
    (lambda: Grammar("xml", "{}"), "a Grammar is made by Grammar.json"),
    # valid, but past llguidance's lexer at the first token (a million bytes forced): refused when made
    (lambda: Grammar.regex("(a{1000}){1000}"), "pattern is too large or too complex for this server to follow"),
    (lambda: Grammar.regex("[A-Z]{2}-a{1000000}"), "pattern is too large or too complex"),
    (lambda: Grammar.lark('start: "hi " /(a{1000}){1000}/'), "grammar is too large or too complex"),
    (lambda: Grammar.json({"type": "object", "properties": {"name": {"type": "string"}, "code": {
        "type": "string", "pattern": "(a{1000}){1000}"}}}), "schema is too large or too complex"),  # met late
])
def test_a_bad_grammar_is_refused_naming_what_is_wrong(make, named):
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        make()


def test_a_grammar_travels_to_an_engine_process_intact():
    grammar = Grammar.json(PERSON).forbidding(("[INST]",))
    assert pickle.loads(pickle.dumps(SamplingParams(grammar=grammar))).grammar == grammar


# -- masks -----------------------------------------------------------------------------------------------
def token_ids(llama: Llama, text: str) -> list[int]:
    """text's tokens as they follow other text (no leading space added)."""
    newline = llama.tokenizer.encode("\n", bos=False, eos=False)
    return llama.tokenizer.encode("\n" + text, bos=False, eos=False)[len(newline):]


def test_the_mask_allows_exactly_the_tokens_that_keep_the_grammar(llama):
    tokenizer = llama.tokenizer
    matcher = GrammarMatcher(Grammar.regex("(ROMEO|JULIET): [a-z]+"), tokenizer)
    allowed = matcher.allowed(llama.args.vocab_size)
    for token in range(tokenizer.n_words):
        text = tokenizer.sp_model.id_to_piece(token).replace("\u2581", " ")
        fits = not tokenizer.sp_model.is_control(token) and not tokenizer.sp_model.is_byte(token) and any(
            name.startswith(text) for name in ("ROMEO: ", "JULIET: ")) and text != ""
        if fits:
            assert allowed[token], text
        elif not tokenizer.sp_model.is_byte(token):
            assert not allowed[token], text
    assert not allowed[tokenizer.eos_id]
    for token in token_ids(llama, "ROMEO: a"):
        assert matcher.allowed(llama.args.vocab_size)[token]
        assert matcher.accept(token)
    now = matcher.allowed(llama.args.vocab_size)
    assert now[tokenizer.eos_id] and not matcher.complete  # "a" may end it, or go on
    assert not now[token_ids(llama, " ")[-1]]


def test_an_end_id_of_generation_config_may_come_only_where_the_reply_may_end(llama):
    """An id generation_config.json lists beside EOS ends the reply as EOS does (the engine's end_ids): under a
    grammar it may come only where EOS may, whatever the grammar reads it as."""
    tokenizer, vocab_size = llama.tokenizer, llama.args.vocab_size
    grammar = Grammar.regex("(ROMEO|JULIET): [a-z]+")
    end = token_ids(llama, "ROMEO")[0]  # text the grammar allows first
    assert GrammarMatcher(grammar, tokenizer).allowed(vocab_size)[end]
    matcher = GrammarMatcher(grammar, tokenizer, end_ids=(tokenizer.eos_id, end))
    assert not matcher.allowed(vocab_size)[end]
    for token in token_ids(llama, "ROMEO: a"):
        assert matcher.accept(token)
    allowed = matcher.allowed(vocab_size)
    assert allowed[tokenizer.eos_id] and allowed[end]


def test_a_model_vocabulary_beyond_the_tokenizers_is_never_allowed(llama):
    matcher = GrammarMatcher(Grammar.json({}), llama.tokenizer)
    allowed = allowed_tokens([matcher, None], llama.tokenizer.n_words + 40)
    assert not allowed[0, llama.tokenizer.n_words:].any() and allowed[0, : llama.tokenizer.n_words].any()
    assert allowed[1].all()


def test_several_rows_masks_are_each_rows_own(llama):
    # Rows with grammars and rows without, in one step: each row's mask is its own matcher's.
    tokenizer, vocab_size = llama.tokenizer, llama.args.vocab_size
    grammars = [Grammar.regex("(ROMEO|JULIET): [a-z]+"), Grammar.json({"type": "object"}), Grammar.regex("[0-9]+"),
                Grammar.lark('start: "ay" | "nay"')]
    matchers = [GrammarMatcher(grammar, tokenizer) for grammar in grammars]
    for token in token_ids(llama, "ROMEO: a"):
        assert matchers[0].accept(token)
    rows = [matchers[0], None, matchers[1], matchers[2], None, matchers[3]]
    together = allowed_tokens(rows, vocab_size)
    for i, matcher in enumerate(rows):
        alone = allowed_tokens([matcher], vocab_size)[0]
        assert torch.equal(together[i], alone), i
    assert together[0, tokenizer.eos_id] and not together[3, tokenizer.eos_id]  # "ROMEO: a" may end; "" may not
    assert len({tuple(row.nonzero().flatten().tolist()) for row in together[[0, 2, 3, 5]]}) == 4


def test_a_forbidden_text_is_never_completed_even_where_the_grammar_allows_it(llama):
    grammar = Grammar.regex(r"\[INST\] (hi|ho)")
    vocab, eos = llama.args.vocab_size, llama.tokenizer.eos_id
    plain, guarded = (GrammarMatcher(g, llama.tokenizer) for g in (grammar, grammar.forbidding(SPECIAL_TAGS)))
    whole = token_ids(llama, "[INST]")  # this tokenizer spells the tag as one token
    assert len(whole) == 1 and plain.allowed(vocab)[whole[0]] and not guarded.allowed(vocab)[whole[0]]
    for character in "[INST":  # spelled a character at a time, the tag's last one is refused
        (token,) = token_ids(llama, character)
        assert plain.accept(token) and guarded.accept(token)
    (close,) = token_ids(llama, "]")
    assert plain.allowed(vocab)[close]
    # the grammar's only way on writes the tag: the reply may only end
    assert guarded.allowed(vocab).nonzero().flatten().tolist() == [eos]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_no_walk_through_the_allowed_tokens_writes_a_forbidden_text(llama, seed):
    """Any reply drawn from the allowed tokens alone, here uniformly at random over an alphabet that spells every
    dialog tag, holds none of them."""
    rng = random.Random(seed)
    matcher = GrammarMatcher(Grammar.regex(r"[\[\]A-Z/<> ]{1,24}").forbidding(SPECIAL_TAGS), llama.tokenizer)
    tokens = []
    while not matcher.complete and len(tokens) < 24:
        choices = matcher.allowed(llama.args.vocab_size).nonzero().flatten().tolist()
        # lean towards the tags' own characters and tokens, so that most walks come near a tag
        near = [t for t in choices if any(c in llama.tokenizer.token_text(t) for c in "[]<>/")]
        token = rng.choice(near if near and rng.random() < 0.8 else choices)
        if token == llama.tokenizer.eos_id:
            break
        assert matcher.accept(token)
        tokens.append(token)
    text = llama.tokenizer.decode(tokens)
    assert not any(tag in text for tag in SPECIAL_TAGS), text


def _tokenizers() -> list:
    from conftest import LLAMA2_TOKENIZER, STORIES_DIR
    from llama_core import DEFAULT_CKPT_DIR

    paths = [DEFAULT_CKPT_DIR / "tokenizer.model", LLAMA2_TOKENIZER, STORIES_DIR / "tokenizer.model"]
    return [pytest.param(path, marks=pytest.mark.skipif(not path.is_file(), reason=f"../shared not present: no {path}"),
                         id=path.parent.name) for path in paths]


@pytest.mark.parametrize("path", _tokenizers())
@settings(max_examples=80, deadline=None)
@given(text=st.lists(st.sampled_from(list('{}[]":, \n\tab1é🙂') + ["Romeo", "[INST]", "  "]), min_size=1,
                     max_size=12).map("".join))
def test_the_grammars_tokenizer_spells_text_exactly_as_it_follows_other_text(path, text):
    """llguidance tokenizes the text a grammar forces with this (a SentencePiece tokenizer adds a space at a text's
    start, and some drop newlines): the tokens must spell exactly the text's bytes, or a forced "{" would come as
    " {" and leave the grammar."""
    vocabulary = _vocabulary(path)
    assert b"".join(vocabulary.tokens[t] for t in vocabulary(text)) == text.encode()


@functools.lru_cache(maxsize=None)
def _vocabulary(path):
    from llama_core import Tokenizer

    return GrammarMatcher(Grammar.json(), Tokenizer(path))._vocabulary


@needs_stories
def test_a_tokenizer_that_drops_newlines_still_writes_json():
    """stories260K's tokenizer normalizes newlines away and has no "{" token but its byte: the reply still
    starts with "{" (not " "), and follows its schema."""
    from conftest import STORIES_DIR, build_llama

    stories = build_llama(STORIES_DIR, device="cpu", dtype="float32", max_seq_len=256, max_batch_size=2)
    grammar = Grammar.json({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {
        "type": "integer", "maximum": 99}}, "required": ["name", "age"], "additionalProperties": False})
    for seed in range(3):
        reply = stories.text_completion(["Once upon a time"], temperature=1.0, seed=seed, max_gen_len=60,
                                        grammar=grammar)[0]["generation"]
        assert set(json.loads(reply)) == {"name", "age"}, reply


# -- replies ---------------------------------------------------------------------------------------------
def test_a_grammar_the_free_reply_already_matches_changes_nothing(llama):
    free = llama.generate([token_ids(llama, "ROMEO:")], 40, temperature=0)[0][0]
    text = llama.tokenizer.decode(free)
    held = llama.generate([token_ids(llama, "ROMEO:")], 40, temperature=0, grammar=Grammar.regex(re.escape(text)))
    assert held[0][0] == free


@pytest.mark.parametrize("seed", range(6))
def test_json_replies_follow_their_schema(llama, seed):
    reply = llama.text_completion(["Enter ROMEO."], temperature=1.0, top_p=1.0, max_gen_len=120, seed=seed,
                                  grammar=Grammar.json(PERSON))[0]["generation"]
    assert follows_person(json.loads(reply)), reply


def test_any_json_object_without_a_schema(llama):
    complete = 0
    for seed in range(6):
        reply = llama.chat_completion([[{"role": "user", "content": "Speak, in JSON."}]], temperature=1.0,
                                      max_gen_len=80, seed=seed, grammar=Grammar.json(), logprobs=True)[0]
        text = reply["generation"]["content"]
        assert text.startswith("{"), text
        if len(reply["tokens"]) < 80:  # not cut short by max_gen_len
            assert isinstance(json.loads(text), dict), text
            complete += 1
    assert complete


def test_a_reply_ends_where_its_grammar_is_complete(llama):
    stream = llama.engine.submit(token_ids(llama, "Say yes or no:"), 50, temperature=1.0, seed=3,
                                 grammar=Grammar.lark('start: ("yes" | "no" | "ay" | "nay") "!"'))
    text = llama.tokenizer.decode([chunk.token for chunk in stream])
    assert text in ("yes!", "no!", "ay!", "nay!") and stream.finish_reason == "eos"


def test_a_chat_reply_with_a_grammar_never_writes_a_dialog_tag(llama):
    for seed in range(4):
        reply = llama.chat_completion([[{"role": "user", "content": "Who comes?"}]], temperature=1.0, seed=seed,
                                      max_gen_len=60, grammar=Grammar.regex(r"[A-Za-z\[\]/<> ]{1,40}"))[0]
        text = reply["generation"]["content"]
        assert text and not any(tag in text for tag in SPECIAL_TAGS)


def test_a_reply_may_end_where_its_grammar_is_matched_though_it_allows_more(llama):
    stream = llama.engine.submit(token_ids(llama, "ROMEO:"), 40, temperature=0, logit_bias={llama.tokenizer.eos_id: 100},
                                 grammar=Grammar.regex(r" [a-z]+( [a-z]+)*"))
    text = llama.tokenizer.decode([chunk.token for chunk in stream])
    assert re.fullmatch(r"[a-z]+( [a-z]+)*", text) and stream.finish_reason == "eos"  # decode drops the first space


def test_a_chat_grammar_that_needs_a_dialog_tag_is_refused_or_fails_saying_so(llama):
    tags = r"a text a chat reply may not hold \(\[INST\], \[/INST\], <<SYS>>, <</SYS>>\)"
    with pytest.raises(InvalidRequestError, match=f"no reply can follow the grammar without writing {tags}"):
        stream_chat(llama.engine, [{"role": "user", "content": "hi"}], grammar=Grammar.regex(r"\[INST\] hi"))
    stream = stream_chat(llama.engine, [{"role": "user", "content": "hi"}], temperature=0,
                         grammar=Grammar.regex(r"ay \[INST\] hi"))  # a tag needed after a start
    with pytest.raises(GrammarFailedError, match=f"cannot follow its grammar without writing {tags}"):
        list(stream)  # not a reply that ended as if complete


def test_a_grammar_past_the_lexers_limits_after_its_start_fails_as_the_requests_own_error(llama):
    """`a|[b-z]{2}a{1000000}` passes the check of its first steps (`a`) and the reply (two letters) then needs
    more of llguidance's lexer than it allows: the request fails as an InvalidRequestError, not as the engine's
    failure, and the engine goes on."""
    stream = llama.engine.submit(token_ids(llama, "ROMEO:"), 8, temperature=0,
                                 grammar=Grammar.regex("a|[b-z]{2}a{1000000}"))
    with pytest.raises(GrammarFailedError, match="the reply left its grammar: lexer error") as failure:
        list(stream)
    assert isinstance(failure.value, InvalidRequestError) and isinstance(failure.value, RequestFailedError)
    assert len(llama.generate([token_ids(llama, "ROMEO:")], 4, temperature=0)[0][0]) == 4


def test_a_grammar_no_reply_can_begin_is_refused_at_once(llama):
    with pytest.raises(InvalidRequestError, match="schema cannot be followed"):  # when made
        llama.engine.submit(token_ids(llama, "ROMEO:"), 5, grammar=Grammar.json({"$ref": "#"}))


def test_requests_without_a_grammar_are_untouched_by_one_beside_them(llama):
    prompts = [token_ids(llama, "ROMEO:"), token_ids(llama, "JULIET:")]
    alone = llama.generate(prompts[1:], 30, temperature=0.8, seed=5)[0][0]
    engine = llama.engine
    held = engine.submit(prompts[0], 30, temperature=0.8, seed=4, grammar=Grammar.json(PERSON))
    free = engine.submit(prompts[1], 30, temperature=0.8, seed=5)
    assert [chunk.token for chunk in free] == alone
    list(held)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=4)])
def test_the_tokens_a_grammar_forces_are_drafted_and_the_reply_is_the_same(sampling):
    """A JSON object's keys and the punctuation around them are forced: with prompt lookup they are drafted
    (whatever the lookup's estimate), so an object takes far fewer steps, and the reply is the undrafted one."""
    from llama_core.serving import Engine

    llama = Llama.build(max_seq_len=384, max_batch_size=1, seed=0)
    fields = ["speaker", "act", "scene", "mood", "aside", "place", "time", "exits"]
    grammar = Grammar.json({"type": "object", "properties": {name: {"type": "boolean"} for name in fields},
                            "required": fields, "additionalProperties": False})
    replies, steps = {}, {}
    for lookup in (0, 5):
        engine = Engine(llama.loaded, prompt_lookup=lookup, draft_price=0.1)
        stream = engine.submit(token_ids(llama, "ROMEO:"), 300, grammar=grammar, **sampling)
        replies[lookup], steps[lookup] = [c.token for c in stream], engine.steps
        assert stream.finish_reason == "eos"
        engine.close()
    # 90 tokens: 89 steps undrafted, 53 with the lookup's drafts alone, 19 with the forced tokens drafted
    assert replies[5] == replies[0] and steps[5] * 3 < steps[0]
    assert list(json.loads(llama.tokenizer.decode(replies[0]))) == fields


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=11)])
def test_drafts_of_a_reply_held_to_a_grammar_change_nothing_but_its_steps(sampling):
    """Prompt lookup drafts for a request with a grammar (the tokens its grammar accepts) and each drafted
    position is masked as the grammar stands after the draft before it: the reply is the one decoded without
    drafts, in fewer steps where the prediction is right."""
    from llama_core.serving import Engine

    llama = Llama.build(max_seq_len=384, max_batch_size=2, seed=0)
    grammar = Grammar.json({"type": "object", "properties": {"lines": {"type": "array", "maxItems": 6, "items": {
        "type": "string", "maxLength": 30}}}, "required": ["lines"], "additionalProperties": False})
    prompt = token_ids(llama, "ROMEO:")
    plain = Engine(llama.loaded, prompt_lookup=0)
    reply = [c.token for c in plain.submit(prompt, 120, grammar=grammar, **sampling)]
    steps = plain.steps
    plain.close()
    edited = list(reply)
    edited[len(edited) // 2] = token_ids(llama, "x")[0]  # a prediction off at one token
    for prediction in (reply, edited):
        drafting = Engine(llama.loaded, prompt_lookup=5, draft_price=0.1)
        tokens = [c.token for c in drafting.submit(prompt, 120, grammar=grammar, prediction_tokens=prediction,
                                                   **sampling)]
        assert tokens == reply and drafting.accepted_tokens > 0 and drafting.steps < steps
        drafting.close()
    assert json.loads(llama.tokenizer.decode(reply))


def test_a_schema_nested_too_deeply_is_a_bad_request_not_a_crash():
    deep: dict = {}
    for _ in range(100_000):
        deep = {"items": deep}
    with pytest.raises(InvalidRequestError, match="guided_json is nested too deeply"):
        Grammar.json(deep, "guided_json")
    with pytest.raises(InvalidRequestError, match="output_grammar is nested too deeply"):
        Grammar.json_text('{"items":' * 100_000 + "{}" + "}" * 100_000, "output_grammar")
