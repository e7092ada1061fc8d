"""The embedded default model: it loads, writes the plays' words, beats a unigram model, and chats."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from llama_core import DEFAULT_CKPT_DIR, Llama

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
needs_plays = pytest.mark.skipif(not PLAYS.is_file(), reason="../shared/data/tinyshakespeare.txt (the training text) is not present")

sys.path.insert(0, str(ROOT / "scripts"))
import train_tiny  # noqa: E402


@pytest.fixture(scope="module")
def llama() -> Llama:
    return Llama.build(None, max_seq_len=512, max_batch_size=8, seed=0)


@pytest.fixture(scope="module")
def training_record() -> dict:
    return json.loads((DEFAULT_CKPT_DIR / "training.json").read_text())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())


def test_default_model_loads_from_the_repository(llama):
    assert llama.ckpt_dir == DEFAULT_CKPT_DIR
    assert llama.args.n_kv_heads < llama.args.n_heads  # grouped-query attention
    assert llama.tokenizer.n_words == llama.args.vocab_size
    assert (llama.tokenizer.bos_id, llama.tokenizer.eos_id) == (1, 2)


@needs_plays
def test_greedy_completion_uses_the_plays_words(llama):
    vocabulary = set(_words(PLAYS.read_text()))
    prompts = ["ROMEO:\nBut soft, what light", "KING RICHARD III:\nNow is the winter of our", "First Citizen:\nWe are"]
    results = llama.text_completion(prompts, temperature=0, max_gen_len=48)
    words = [w for r in results for w in _words(r["generation"])]
    assert len(words) >= 30
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.8, f"only {known:.0%} of generated words occur in the plays: {words}"


@needs_plays
def test_validation_loss_is_well_below_a_unigram_model(llama, training_record):
    text = PLAYS.read_text()
    train_text, val_text = train_tiny.split_text(text, training_record["val_fraction"])
    assert len(train_text) == training_record["val_start_char"]
    model = llama.model
    model.remove_caches()
    try:
        losses = train_tiny.held_out_losses(model, llama.tokenizer, train_text, val_text, training_record["seq_len"], windows=16)
    finally:
        model.setup_caches(llama.max_batch_size, llama.max_seq_len)
    assert losses["val_loss_plain"] < losses["unigram_val_loss_plain"] - 1.0
    # The README's figures come from the same procedure on more windows.
    assert training_record["val_loss_plain"] < training_record["unigram_val_loss_plain"] - 1.0
    assert losses["val_loss_plain"] == pytest.approx(training_record["val_loss_plain"], abs=0.25)


def test_a_chat_turn_gets_a_reply_that_ends_on_its_own(llama):
    questions = [
        "Good morrow, my lord. What news from the court?",
        "Wilt thou come with me to the feast tonight?",
        "Why dost thou weep?",
        "Who goes there?",
        "Speak, what is thy name?",
        "Shall we fight, or fly?",
        "I love thee, dost thou love me?",
        "What say you to this, good friar?",
    ]
    dialogs = [[{"role": "system", "content": "You are Juliet. Speak as Juliet would."}, {"role": "user", "content": q}]
               for q in questions]
    max_gen_len = 200
    replies = llama.chat_completion(dialogs, temperature=0.6, top_p=0.9, max_gen_len=max_gen_len, logprobs=True)
    assert all(r["generation"]["role"] == "assistant" and r["generation"]["content"].strip() for r in replies)
    ended_at_eos = sum(len(r["tokens"]) < max_gen_len for r in replies)
    assert ended_at_eos >= 6, f"only {ended_at_eos} of {len(replies)} replies ended with EOS"


def test_a_chat_replys_stop_strings_are_found_in_its_text_as_shown(llama):
    """A chat reply's content reads alone (its first word without SentencePiece's space): a stop string
    is found there, in the engine as in the text shown, not in the text as it would read after the prompt."""
    from llama_core.dialog import SPECIAL_TAGS
    from llama_core.serving import stream_chat
    from llama_core.tokenizer import StreamDecoder

    for question in ["Good morrow, what news?", "Who art thou?", "Where is the king?", "What say you, sir?"]:
        dialog = [{"role": "user", "content": question}]
        prompt = llama.prepare_chat(dialog, 24).prompt_tokens
        ids = llama.generate([prompt], 24, temperature=0, stop=list(SPECIAL_TAGS))[0][0]
        alone = llama.chat_completion([dialog], temperature=0, max_gen_len=24)[0]["generation"]["content"]
        decoder = StreamDecoder(llama.tokenizer, prompt)
        after_prompt = "".join(decoder.push(t) for t in ids) + decoder.flush()
        words = alone.split()
        if words and after_prompt.startswith(" " + words[0]) and " " + words[0] not in alone:
            break
    else:
        pytest.fail("no reply starts with a word piece that appears nowhere else")
    stop = " " + words[0]  # in the reply as it reads after the prompt, not in the reply shown
    assert llama.chat_completion([dialog], temperature=0, max_gen_len=24, stop=[stop])[0]["generation"][
        "content"] == alone
    with llama.serve() as engine:
        stream = stream_chat(engine, dialog, temperature=0, max_new_tokens=24, stop=[stop])
        assert "".join(c.text for c in stream) == alone and stream.finish_reason != "stop"
