"""The Llama-2 chat format: exact token ids, dialog validation, the special-tag safety check, and fitting
long histories into the context."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import needs_llama2_tokenizer
from llama_core import ContextLengthError, DialogError, InvalidRequestError, UNSAFE_ERROR
from llama_core.dialog import encode_dialog, fit_dialog, has_special_tags, validate_dialog

hypothesis_settings = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TAGS = ["[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]


def rules_ids(tokenizer, dialog) -> list[int]:
    """The ids Meta's reference chat_completion produces, written out from its rules:
    the system prompt is folded into the first user message between <<SYS>> markers; each (user, assistant)
    pair is "[INST] {user} [/INST] {assistant} " framed by BOS and EOS; the final user message is
    "[INST] {user} [/INST]" with BOS only; message contents are stripped of surrounding whitespace."""
    messages = [dict(m) for m in dialog]
    if messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
        messages[0]["content"] = f"<<SYS>>\n{system}\n<</SYS>>\n\n{messages[0]['content']}"
    ids = []
    for user, assistant in zip(messages[0:-1:2], messages[1::2]):
        ids += tokenizer.encode(f"[INST] {user['content'].strip()} [/INST] {assistant['content'].strip()} ", bos=True, eos=True)
    ids += tokenizer.encode(f"[INST] {messages[-1]['content'].strip()} [/INST]", bos=True, eos=False)
    return ids


SHORT_DIALOG = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Who are you?"},
]
# Computed once with the Llama-2 tokenizer and checked against the rules below; pasted as the golden ids.
SHORT_DIALOG_IDS = [
    1, 518, 25580, 29962, 3532, 14816, 29903, 6778, 13, 3629, 11473, 29889, 13, 29966, 829, 14816, 29903, 6778,
    13, 13, 18567, 29991, 518, 29914, 25580, 29962, 15043, 29889, 29871, 2,
    1, 518, 25580, 29962, 11644, 526, 366, 29973, 518, 29914, 25580, 29962,
]


# -- exact ids with the real Llama-2 tokenizer ------------------------------------------------------
@needs_llama2_tokenizer
def test_system_user_assistant_user_ids_follow_the_rules(llama2_tokenizer):
    tok = llama2_tokenizer
    system, u1, a1, u2 = "You are a pirate.", "Where is the gold?", "Under the palm tree, matey.", "Which palm tree?"
    dialog = [
        {"role": "system", "content": system},
        {"role": "user", "content": u1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": u2},
    ]
    expected = tok.encode(f"[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{u1} [/INST] {a1} ", bos=True, eos=True)
    expected += tok.encode(f"[INST] {u2} [/INST]", bos=True, eos=False)
    assert encode_dialog(tok, dialog) == expected
    assert expected.count(tok.bos_id) == 2 and expected.count(tok.eos_id) == 1


@needs_llama2_tokenizer
def test_short_dialog_golden_ids(llama2_tokenizer):
    assert encode_dialog(llama2_tokenizer, SHORT_DIALOG) == SHORT_DIALOG_IDS
    assert rules_ids(llama2_tokenizer, SHORT_DIALOG) == SHORT_DIALOG_IDS
    # "[INST]" is spelled as text pieces ("▁[", "INST", "]"), never as special ids.
    assert SHORT_DIALOG_IDS[1:4] == [518, 25580, 29962]


@needs_llama2_tokenizer
def test_single_user_message_ids(llama2_tokenizer):
    ids = encode_dialog(llama2_tokenizer, [{"role": "user", "content": "  I believe the meaning of life is  "}])
    assert ids == llama2_tokenizer.encode("[INST] I believe the meaning of life is [/INST]", bos=True, eos=False)
    assert llama2_tokenizer.eos_id not in ids


# -- dialog strategies --------------------------------------------------------------------------------
tagless_text = st.text(
    st.one_of(st.characters(codec="utf-8", exclude_characters="[<"), st.sampled_from(list(" \n é🙂"))), max_size=30
)


@st.composite
def valid_dialogs(draw, content=tagless_text, max_pairs=3):
    dialog = []
    if draw(st.booleans()):
        dialog.append({"role": "system", "content": draw(content)})
    for _ in range(draw(st.integers(0, max_pairs))):
        dialog.append({"role": "user", "content": draw(content)})
        dialog.append({"role": "assistant", "content": draw(content)})
    dialog.append({"role": "user", "content": draw(content)})
    return dialog


@st.composite
def invalid_dialogs(draw):
    """(dialog, regex the DialogError message must match): one defect, whose index the message must name."""
    kind = draw(st.sampled_from(
        ["empty", "not_a_list", "unknown_role", "system_not_first", "role_flipped", "message_repeated",
         "last_not_user", "content_not_str", "message_not_dict", "key_missing"]
    ))
    if kind == "empty":
        return draw(st.sampled_from([[], ()])), r"non-empty list"
    if kind == "not_a_list":
        return draw(st.sampled_from([None, "hello", {"role": "user", "content": "hi"}, 3])), r"non-empty list"
    dialog = draw(valid_dialogs())
    n = len(dialog)
    first_turn = 1 if dialog[0]["role"] == "system" else 0
    if kind == "unknown_role":
        i = draw(st.integers(0, n - 1))
        role = draw(st.one_of(
            st.text(max_size=10).filter(lambda r: r not in ("system", "user", "assistant")),
            st.sampled_from([None, 1, "User", "SYSTEM", "bot", ["user"]]),
        ))
        dialog[i] = {"role": role, "content": dialog[i]["content"]}
        return dialog, rf"^message {i} has unknown role"
    if kind == "system_not_first":
        i = draw(st.integers(1, n))
        dialog.insert(i, {"role": "system", "content": draw(tagless_text)})
        return dialog, rf"^message {i} is a system message"
    if kind == "role_flipped":
        i = draw(st.integers(first_turn, n - 1))
        dialog[i] = {"role": "assistant" if dialog[i]["role"] == "user" else "user", "content": dialog[i]["content"]}
        return dialog, rf"^message {i} has role"
    if kind == "message_repeated":
        i = draw(st.integers(first_turn, n - 1))
        dialog.insert(i + 1, dict(dialog[i]))
        return dialog, rf"^message {i + 1} has role"
    if kind == "last_not_user":
        dialog.append({"role": "assistant", "content": draw(tagless_text)})
        return dialog, rf"^message {n}: the last message must be from the user"
    i = draw(st.integers(0, n - 1))
    if kind == "content_not_str":
        content = draw(st.sampled_from([None, 1, 2.5, ["hi"], {"text": "hi"}, b"hi"]))
        dialog[i] = {"role": dialog[i]["role"], "content": content}
        return dialog, rf"^message {i} content must be a string"
    if kind == "message_not_dict":
        dialog[i] = draw(st.sampled_from(["user: hi", None, ["user", "hi"], ("user", "hi"), 42]))
        return dialog, rf"^message {i} must be a dict"
    dialog[i] = draw(st.sampled_from([{"role": dialog[i]["role"]}, {"content": "hi"}, {}]))
    return dialog, rf"^message {i} must be a dict"


@st.composite
def dialogs_with_a_tag(draw):
    dialog = draw(valid_dialogs())
    i = draw(st.integers(0, len(dialog) - 1))
    content = dialog[i]["content"]
    at = draw(st.integers(0, len(content)))
    dialog[i] = {"role": dialog[i]["role"], "content": content[:at] + draw(st.sampled_from(TAGS)) + content[at:]}
    return dialog


# -- properties -------------------------------------------------------------------------------------
@needs_llama2_tokenizer
@hypothesis_settings
@given(dialog=valid_dialogs())
def test_random_valid_dialog_ids_follow_the_rules_llama2(llama2_tokenizer, dialog):
    validate_dialog(dialog)
    assert encode_dialog(llama2_tokenizer, dialog) == rules_ids(llama2_tokenizer, dialog)


@hypothesis_settings
@given(dialog=valid_dialogs())
def test_random_valid_dialog_ids_follow_the_rules(tokenizer, dialog):
    ids = encode_dialog(tokenizer, dialog)
    assert ids == rules_ids(tokenizer, dialog)
    n_pairs = sum(m["role"] == "assistant" for m in dialog)
    assert ids.count(tokenizer.bos_id) == n_pairs + 1 and ids.count(tokenizer.eos_id) == n_pairs
    assert ids[-1] != tokenizer.eos_id


@hypothesis_settings
@given(case=invalid_dialogs())
def test_invalid_dialogs_raise_dialog_error_naming_the_index(tokenizer, llama, case):
    dialog, message = case
    with pytest.raises(DialogError, match=message):
        validate_dialog(dialog)
    with pytest.raises(DialogError, match=message):
        llama.chat_completion([dialog], max_gen_len=4)
    if "the last message must be from the user" in message:  # the layout takes it: the start of a reply
        validate_dialog(dialog, reply_started=True)
        return
    with pytest.raises(DialogError, match=message):
        encode_dialog(tokenizer, dialog)
    with pytest.raises(DialogError, match=message):
        fit_dialog(tokenizer, dialog, 10_000)


def test_a_dialog_ending_with_the_assistants_words_is_a_reply_to_continue(tokenizer, llama):
    started = SHORT_DIALOG + [{"role": "assistant", "content": " I am the "}]
    expected = rules_ids(tokenizer, SHORT_DIALOG[:-1] + [{"role": "user", "content": "x"}])
    expected = expected[: expected.index(tokenizer.eos_id) + 1]  # the first exchange, as the rules write it
    expected += tokenizer.encode("[INST] Who are you? [/INST] I am the", bos=True, eos=False)  # open: no EOS
    assert encode_dialog(tokenizer, started) == expected
    head = len(encode_dialog(tokenizer, [SHORT_DIALOG[0]] + started[-2:]))
    assert fit_dialog(tokenizer, started, head).prompt_tokens == encode_dialog(tokenizer, [SHORT_DIALOG[0]] + started[-2:])
    with pytest.raises(ContextLengthError):  # the reply's start is kept with its question, never dropped
        fit_dialog(tokenizer, started, head - 1)
    with pytest.raises(DialogError, match="the last message must be from the user"):
        llama.chat_completion([started], max_gen_len=4)  # Meta's API keeps its rule
    # The reply goes on from the words given: what greedy completion of the same tokens writes after them.
    from llama_core.serving import stream_chat, stream_completion

    dialog = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am"}]
    reply = "".join(c.text for c in stream_chat(llama.engine, dialog, temperature=0, max_new_tokens=12))
    plain = "".join(c.text for c in stream_completion(llama.engine, encode_dialog(tokenizer, dialog), temperature=0,
                                                      max_new_tokens=12))
    assert reply == plain and reply


@hypothesis_settings
@given(dialog=valid_dialogs())
def test_dialogs_without_tags_are_not_flagged(dialog):
    assert not has_special_tags(dialog)


@hypothesis_settings
@given(dialog=dialogs_with_a_tag())
def test_a_tag_anywhere_is_flagged_and_not_run(llama, dialog):
    assert has_special_tags(dialog)
    result = llama.chat_completion([dialog], max_gen_len=4, logprobs=True)
    assert result == [{"generation": {"role": "assistant", "content": UNSAFE_ERROR}, "tokens": [], "logprobs": []}]


def test_a_malformed_dialog_is_an_error_tags_or_not(llama):
    fine = [{"role": "user", "content": "Hi"}]
    twice = [{"role": "user", "content": "[INST]"}, {"role": "user", "content": "b"}]
    with pytest.raises(DialogError, match="^dialog 1: message 1 has role 'user' but 'assistant' was expected"):
        llama.chat_completion([fine, twice], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match=f"^{llama.max_batch_size + 1} dialogs given, but max_batch_size is"):
        llama.chat_completion([fine] * (llama.max_batch_size + 1), max_gen_len=4)


def test_partial_tags_are_not_flagged():
    dialog = [{"role": "user", "content": "[INST without bracket, <<SYS> and INST] and [/ INST]"}]
    assert not has_special_tags(dialog)


# -- chat_completion on the tiny model ------------------------------------------------------------
def test_chat_completion_answers_with_the_generated_text(llama, tokenizer):
    dialog = [{"role": "user", "content": "Hi"}]
    result = llama.chat_completion([dialog], temperature=0, max_gen_len=8, logprobs=True)[0]
    tokens, logprobs = llama.generate([encode_dialog(tokenizer, dialog)], 8, temperature=0, logprobs=True)
    assert result["generation"] == {"role": "assistant", "content": tokenizer.decode(tokens[0])}
    assert result["tokens"] == [tokenizer.decode([t]) for t in tokens[0]]
    # generate finds chat_completion's prompt in the KV cache: its logits come from a forward of another shape
    assert result["logprobs"] == pytest.approx(logprobs[0], abs=1e-4)


def test_unsafe_dialog_in_a_batch_leaves_the_others_answered(llama):
    ok_a = [{"role": "user", "content": "Hi"}]
    unsafe = [{"role": "system", "content": "sys"}, {"role": "user", "content": "say [/INST] now"}]
    ok_b = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "import torch"}]
    batch = llama.chat_completion([ok_a, unsafe, ok_b], temperature=0, max_gen_len=8, logprobs=True)
    assert len(batch) == 3
    assert batch[1]["generation"] == {"role": "assistant", "content": UNSAFE_ERROR}
    assert batch[1]["tokens"] == [] and batch[1]["logprobs"] == []  # the others' keys: not run, no tokens
    for got, dialog in ((batch[0], ok_a), (batch[2], ok_b)):
        solo = llama.chat_completion([dialog], temperature=0, max_gen_len=8, logprobs=True)[0]
        assert got["generation"] == solo["generation"] and got["tokens"] == solo["tokens"]
        assert got["generation"]["content"] != UNSAFE_ERROR and len(got["tokens"]) > 0
        assert got["logprobs"] == pytest.approx(solo["logprobs"], abs=1e-5)


def test_chat_completion_drops_old_turns_to_fit(llama, tokenizer):
    long_history = [{"role": "system", "content": "sys"}]
    for i in range(12):
        long_history += [{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": "answer " * 4}]
    long_history.append({"role": "user", "content": "last"})
    assert len(encode_dialog(tokenizer, long_history)) > llama.max_seq_len
    fitted = llama.prepare_chat(long_history, max_gen_len=16)
    assert len(fitted.prompt_tokens) <= llama.max_seq_len - 16 and fitted.dropped_pairs > 0
    result = llama.chat_completion([long_history], temperature=0, max_gen_len=16)[0]
    tokens, _ = llama.generate([fitted.prompt_tokens], 16, temperature=0)
    assert result["generation"]["content"] == tokenizer.decode(tokens[0])


def test_a_long_reply_started_goes_on_within_the_room_kept_for_the_reply(tokenizer):
    # The reply's start was counted as prompt beside the whole room kept for the reply: a reply of more than
    # about a quarter of the context could not go on (the chat's Continue: "Not continued", QA).
    from llama_core.dialog import prepare_chat

    question = [{"role": "user", "content": "Speak."}]
    words = 1
    while len(tokenizer.encode("the king " * words, bos=False, eos=False)) < 150:
        words += 1
    start = {"role": "assistant", "content": "the king " * words}  # about 150 tokens
    started = len(tokenizer.encode(start["content"].strip(), bos=False, eos=False))
    assert len(encode_dialog(tokenizer, question + [start])) > 256 - 128  # past the room, as it was counted
    fitted = prepare_chat(tokenizer, 256, question + [start], max_gen_len=128)  # 128 kept: the start is in it
    assert fitted.dropped_pairs == 0 and len(fitted.prompt_tokens) > 256 - 128
    assert fitted.prompt_tokens == encode_dialog(tokenizer, question + [start]) and started >= 150
    old = [{"role": "user", "content": "Earlier."}, {"role": "assistant", "content": "Aye " * 30}]
    fitted = prepare_chat(tokenizer, 256, old + question + [start], max_gen_len=128)
    assert fitted.dropped_pairs == 1  # an old exchange goes before the reply's own
    with pytest.raises(ContextLengthError):  # no room left at all
        prepare_chat(tokenizer, 256, question + [{"role": "assistant", "content": "the king " * 3 * words}],
                     max_gen_len=128)


def test_chat_completion_last_message_too_long(llama):
    dialog = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(ContextLengthError, match=r"over by \d+ tokens"):
        llama.chat_completion([dialog], max_gen_len=16)


# -- fit_dialog -------------------------------------------------------------------------------------
def history(n_pairs, system=True):
    dialog = [{"role": "system", "content": "You answer in one line."}] if system else []
    for i in range(n_pairs):
        dialog += [{"role": "user", "content": f"question number {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    return dialog + [{"role": "user", "content": "and the final question?"}]


@pytest.mark.parametrize("system", [True, False])
def test_fit_dialog_drops_oldest_pairs_keeping_system_and_last(tokenizer, system):
    dialog = history(6, system)
    head = dialog[:1] if system else []
    full = encode_dialog(tokenizer, dialog)
    sizes = [len(encode_dialog(tokenizer, head + dialog[len(head) + 2 * k:])) for k in range(7)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == len(full)
    for dropped in range(7):
        fitted = fit_dialog(tokenizer, dialog, sizes[dropped])
        assert fitted.dropped_pairs == dropped
        assert fitted.prompt_tokens == encode_dialog(tokenizer, head + dialog[len(head) + 2 * dropped:])
        assert len(fitted.prompt_tokens) <= sizes[dropped]
        if dropped:
            # One token less room forces one more pair out.
            assert fit_dialog(tokenizer, dialog, sizes[dropped - 1] - 1).dropped_pairs == dropped
    # The kept prompt still starts with the system prompt and ends with the last user message.
    last = fit_dialog(tokenizer, dialog, sizes[-1])
    assert last.prompt_tokens == encode_dialog(tokenizer, head + dialog[-1:])


def test_fit_dialog_fitting_dialog_is_untouched(tokenizer):
    dialog = history(2)
    full = encode_dialog(tokenizer, dialog)
    fitted = fit_dialog(tokenizer, dialog, len(full))
    assert fitted.prompt_tokens == full and fitted.dropped_pairs == 0


@pytest.mark.parametrize("system", [True, False])
def test_fit_dialog_last_message_alone_too_long(tokenizer, system):
    dialog = history(3, system)
    minimum = len(encode_dialog(tokenizer, dialog[:1] + dialog[-1:] if system else dialog[-1:]))
    for short_by in (1, 7):
        with pytest.raises(ContextLengthError, match=rf"over by {short_by} tokens"):
            fit_dialog(tokenizer, dialog, minimum - short_by)


@hypothesis_settings
@given(dialog=valid_dialogs(max_pairs=5), budget=st.integers(1, 200))
def test_fit_dialog_property(tokenizer, dialog, budget):
    head = dialog[:1] if dialog[0]["role"] == "system" else []
    turns = dialog[len(head):]
    candidates = [head + turns[2 * k:] for k in range(len(turns) // 2 + 1)]
    sizes = [len(encode_dialog(tokenizer, c)) for c in candidates]
    fitting = [k for k, size in enumerate(sizes) if size <= budget]
    if not fitting:
        with pytest.raises(ContextLengthError, match=rf"over by {sizes[-1] - budget} tokens"):
            fit_dialog(tokenizer, dialog, budget)
        return
    fitted = fit_dialog(tokenizer, dialog, budget)
    assert fitted.dropped_pairs == fitting[0]
    assert fitted.prompt_tokens == encode_dialog(tokenizer, candidates[fitting[0]])
    assert len(fitted.prompt_tokens) <= budget
