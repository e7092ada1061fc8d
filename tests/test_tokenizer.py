"""Tokenizer ids against the real Llama-2 vocabulary, and StreamDecoder's incremental text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import needs_llama2_tokenizer
from llama_core import StreamDecoder

TEXTS = [
    "héllo wörld 你好 🙂",
    "line one\nline two\n\n  indented\ttab",
    "  leading spaces and trailing  ",
    "🙂🙂 emoji run, then ascii",
    "I believe the meaning of life is",
]

# Unicode with a bias to what breaks incremental decoding: spaces, newlines, multi-byte characters.
unicode_text = st.text(
    st.one_of(st.characters(codec="utf-8"), st.sampled_from(list(" \n\t é你好🙂ab"))), max_size=40
)
hypothesis_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream_text(tokenizer, ids, context=()):
    decoder = StreamDecoder(tokenizer, context)
    pieces = [decoder.push(t) for t in ids]
    return pieces, decoder.flush()


# -- the real Llama-2 tokenizer --------------------------------------------------------------------
@needs_llama2_tokenizer
def test_llama2_ids_of_a_known_sentence(llama2_tokenizer):
    ids = llama2_tokenizer.encode("I believe the meaning of life is", bos=True, eos=False)
    assert ids == [1, 306, 4658, 278, 6593, 310, 2834, 338]
    assert llama2_tokenizer.encode("I believe the meaning of life is", bos=False, eos=True) == ids[1:] + [2]


@needs_llama2_tokenizer
def test_llama2_special_ids(llama2_tokenizer):
    t = llama2_tokenizer
    assert (t.n_words, t.bos_id, t.eos_id, t.pad_id) == (32000, 1, 2, -1)


@needs_llama2_tokenizer
@pytest.mark.parametrize("text", TEXTS)
def test_llama2_stream_decoder_reproduces_decode(llama2_tokenizer, text):
    ids = llama2_tokenizer.encode(text, bos=True, eos=False)
    pieces, tail = stream_text(llama2_tokenizer, ids)
    assert "".join(pieces) + tail == llama2_tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


@needs_llama2_tokenizer
def test_llama2_partial_emoji_is_held_back(llama2_tokenizer):
    ids = llama2_tokenizer.encode("a 🙂", bos=False, eos=False)
    assert ids[-4:] == [243, 162, 156, 133]  # the emoji spelled as four byte-fallback pieces
    decoder = StreamDecoder(llama2_tokenizer)
    before = "".join(decoder.push(t) for t in ids[:-4])
    held = [decoder.push(t) for t in ids[-4:-1]]
    assert held == ["", "", ""]
    last = decoder.push(ids[-1])
    assert before + last == "a 🙂" and last.endswith("🙂")
    assert decoder.flush() == ""


# -- the small fixture tokenizer (byte fallback) -------------------------------------------------
def test_fixture_tokenizer_specials(tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, -1)
    assert tokenizer.sp_model.id_to_piece(0) == "<unk>"
    ids = tokenizer.encode("x", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_reproduces_decode(tokenizer, text):
    ids = tokenizer.encode(text, bos=True, eos=False)
    pieces, tail = stream_text(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert tail == ""  # text ends on a whole character: nothing is left for flush
    assert not any("\ufffd" in p for p in pieces)


def test_partial_multibyte_character_is_held_back(tokenizer):
    for char in "é你🙂":
        ids = tokenizer.encode("a" + char, bos=False, eos=False)
        n_bytes = len(char.encode("utf-8"))
        assert len(ids) >= n_bytes  # each byte is its own fallback piece in this small vocabulary
        decoder = StreamDecoder(tokenizer)
        pieces = [decoder.push(t) for t in ids]
        assert pieces[-n_bytes:-1] == [""] * (n_bytes - 1), f"{char!r}: text released before its last byte"
        assert pieces[-1].endswith(char)
        assert "".join(pieces) == "a" + char


def test_flush_releases_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 🙂", bos=False, eos=False)[:-1]  # drop the emoji's last byte
    pieces, tail = stream_text(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert "\ufffd" in tail and "\ufffd" not in "".join(pieces)


@hypothesis_settings
@given(text=unicode_text)
def test_stream_decoder_reproduces_decode_of_random_text(tokenizer, text):
    ids = tokenizer.encode(text, bos=True, eos=False)
    pieces, tail = stream_text(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces), "a piece was released before its character was complete"


@hypothesis_settings
@given(before=unicode_text, after=unicode_text)
def test_stream_decoder_continues_after_context(tokenizer, before, after):
    context = tokenizer.encode(before, bos=True, eos=False)
    ids = tokenizer.encode(after, bos=False, eos=False)
    assume(ids)
    pieces, tail = stream_text(tokenizer, ids, context)
    # The context is already shown; the pieces are exactly what decoding the whole sequence adds to it.
    assert tokenizer.decode(context) + "".join(pieces) + tail == tokenizer.decode(context + ids)


def test_a_context_ending_within_a_character_has_it_completed_by_the_new_tokens(tokenizer):
    # A prompt of token ids cut within a character (lm-eval style): the reply completes it. Its text, and the
    # spaces after it, were lost ("" then a slice at the wrong place), and stop strings never saw them.
    ids = tokenizer.encode("ok 🙂 two", bos=True, eos=False)
    assert tokenizer.decode(ids) == "ok 🙂 two"
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd" * 2))  # 2 of its 4 bytes
    pieces, tail = stream_text(tokenizer, ids[cut:], ids[:cut])
    assert "".join(pieces) + tail == "🙂 two"
    assert pieces[:2] == ["", "🙂"]  # held back until its last byte, then given whole


@hypothesis_settings
@given(text=unicode_text, at=st.floats(0, 1))
def test_stream_decoder_after_a_context_cut_anywhere_loses_no_text(tokenizer, text, at):
    assume("\ufffd" not in text)
    ids = tokenizer.encode(text, bos=True, eos=False)
    cut = round(at * len(ids))
    pieces, tail = stream_text(tokenizer, ids[cut:], ids[:cut])
    # What the context shows whole, then the pieces: the whole text.
    assert tokenizer.decode(ids[:cut]).rstrip("\ufffd") + "".join(pieces) + tail == tokenizer.decode(ids)
