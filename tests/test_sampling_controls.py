"""Every sampling control per request, through the engine and the Llama API: the real stories260K model
against Hugging Face's generate, seeds that hold alone, batched and under load, stop strings across tokens
and streamed chunks, chat replies that never write a dialog tag, top log-probabilities, and bad values."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import STORIES_DIR, build_hf_model, needs_stories
from llama_core import InvalidRequestError, Llama, SamplingParams
from llama_core.dialog import SPECIAL_TAGS
from llama_core.serving import Channel, Finished, StreamChunk, TextStream, TokenStream, stream_chat, stream_completion
from llama_core.tokenizer import StreamDecoder


@pytest.fixture(scope="module")
def stories() -> Llama:
    if not (STORIES_DIR / "consolidated.00.pth").is_file():
        pytest.skip(f"../shared not present: no stories260K at {STORIES_DIR}")
    return Llama.build(STORIES_DIR, max_seq_len=256, max_batch_size=8, device="cpu", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def stories_hf(stories):
    state = torch.load(STORIES_DIR / "consolidated.00.pth", map_location="cpu", weights_only=True)
    return build_hf_model(state, stories.args, max_position_embeddings=512)


@pytest.fixture(scope="module")
def prompts(stories) -> list[list[int]]:
    bos = stories.tokenizer.bos_id
    return [[bos], [bos, 461, 461, 401], [bos, 300, 301, 302, 13, 400, 77, 200, 150], [bos, 264, 283, 452]]


def _hf_greedy(hf, prompt: list[int], n: int, eos_id: int, **options) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id, **options)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


@needs_stories
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_greedy_equals_hugging_face_generate(stories, stories_hf, prompts, penalty):
    eos = stories.tokenizer.eos_id
    for prompt in prompts:
        ours = stories.generate([prompt], 40, temperature=0, repetition_penalty=penalty)[0][0]
        assert ours == _hf_greedy(stories_hf, prompt, 40, eos, repetition_penalty=penalty)
    plain = stories.generate([prompts[0]], 40, temperature=0)[0][0]
    assert stories.generate([prompts[0]], 40, temperature=0, repetition_penalty=1.3)[0][0] != plain


@needs_stories
def test_presence_and_frequency_penalties_equal_a_reference_loop(stories, prompts):
    presence, frequency = 0.4, 0.7
    for prompt in prompts[:2]:
        tokens, generated = list(prompt), []
        with torch.inference_mode():
            for _ in range(30):
                logits = stories.model(torch.tensor([tokens]), kv_len=len(tokens))[0, -1]
                counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]).float()
                token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
                if token == stories.tokenizer.eos_id:
                    break
                tokens.append(token)
                generated.append(token)
        ours = stories.generate([prompt], 30, temperature=0, presence_penalty=presence, frequency_penalty=frequency)
        assert ours[0][0] == generated


@needs_stories
def test_top_k_one_and_min_p_one_sample_greedily(stories, prompts):
    greedy = stories.generate(prompts, 30, temperature=0)[0]
    assert stories.generate(prompts, 30, temperature=1.0, top_p=1.0, top_k=1)[0] == greedy
    assert stories.generate(prompts, 30, temperature=1.0, top_p=1.0, min_p=1.0)[0] == greedy


@needs_stories
def test_a_seed_gives_the_same_tokens_alone_batched_and_under_load(stories, prompts):
    controls = dict(temperature=1.0, top_p=0.95, seed=1234)
    alone = stories.generate([prompts[2]], 40, **controls)[0][0]
    assert stories.generate([prompts[2]], 40, **controls)[0][0] == alone
    batched = stories.generate([prompts[0], prompts[2], prompts[1]], 40, **controls)[0]
    assert batched[1] == alone
    assert stories.generate([prompts[2]], 40, temperature=1.0, top_p=0.95, seed=4321)[0][0] != alone
    with stories.serve() as engine:  # other requests come and go around it
        stop = threading.Event()

        def noise(i: int) -> None:
            while not stop.is_set():
                list(engine.submit(prompts[i % 4], 7, temperature=0.9))

        threads = [threading.Thread(target=noise, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            under_load = [c.token for c in engine.submit(prompts[2], 40, **controls)]
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert under_load == alone


def test_stop_strings_end_generation_and_are_never_shown(llama, tokenizer):
    prompt = "Once upon a time"
    full = llama.text_completion([prompt], temperature=0, max_gen_len=40)[0]["generation"]
    stream_tokens = tokenizer.encode(prompt, bos=True, eos=False)
    pieces = [c.text for c in llama.stream(stream_tokens, 40, temperature=0)]
    text = "".join(pieces)
    # A stop string that spans a token boundary, from inside the greedy text, found there first.
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    stop = next(text[b - 2 : b + 3] for b in ends if b >= 4 and b + 3 <= len(text)
                and text.index(text[b - 2 : b + 3]) == b - 2 and text[b - 2 : b + 3] in full)
    assert len(stop) == 5
    expected_full, expected = full[: full.index(stop)], text[: text.index(stop)]
    assert llama.text_completion([prompt], temperature=0, max_gen_len=40, stop=[stop])[0]["generation"] == expected_full
    chunks = list(llama.stream(stream_tokens, 40, temperature=0, stop=[stop]))
    assert "".join(c.text for c in chunks) == expected
    shown = ""
    for chunk in chunks:  # no streamed prefix ever reaches into the stop string
        shown += chunk.text
        assert shown == expected[: len(shown)]
    with llama.serve() as engine:
        stream = stream_completion(engine, prompt, temperature=0, max_new_tokens=40, stop=[stop, "zzz"])
        batches = ["".join(c.text for c in batch) for batch in stream.batches(0.0)]
        assert "".join(batches) == expected and stream.finish_reason == "stop"
        assert stream.generated_tokens < 40


@pytest.mark.parametrize("chat", [False, True])
def test_a_results_tokens_and_logprobs_end_with_its_text_not_the_stop_string(llama, tokenizer, chat):
    dialog = [{"role": "user", "content": "Speak of the king."}]
    prompt = llama.prepare_chat(dialog, 40).prompt_tokens if chat else tokenizer.encode("Once upon a", True, False)
    ids = llama.generate([prompt], 40, temperature=0, stop=list(SPECIAL_TAGS) if chat else None)[0][0]
    full = tokenizer.decode(ids)
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # inside the text: several tokens are the stop's alone
    if chat:
        cut = llama.chat_completion([dialog], temperature=0, max_gen_len=40, stop=[stop], logprobs=True)[0]
        text = cut["generation"]["content"]
    else:
        cut = llama.text_completion(["Once upon a"], temperature=0, max_gen_len=40, stop=[stop], logprobs=True)[0]
        text = cut["generation"]
    kept = len(cut["tokens"])
    assert text == full[: full.index(stop)] and len(cut["logprobs"]) == kept
    assert cut["tokens"] == [tokenizer.decode([t]) for t in ids[:kept]]
    # the tokens kept write the text, and one fewer would not
    assert len(tokenizer.decode(ids[:kept])) >= len(text) > len(tokenizer.decode(ids[: kept - 1]))


def _fake_tokens(tokenizer, text: str) -> tuple[TokenStream, str]:
    """A finished token stream of text's tokens, and the text they decode to."""
    channel = Channel()
    ids = tokenizer.encode(text, bos=False, eos=False)
    for token in ids:
        channel.events.put(StreamChunk(token, 0.0))
    channel.events.put(Finished("length"))
    channel.finished.set()
    return TokenStream(channel, prompt_len=1), tokenizer.decode(ids)


def test_a_chat_reply_never_shows_a_dialog_tag(llama, tokenizer):
    for tag in SPECIAL_TAGS:
        tokens, decoded = _fake_tokens(tokenizer, f"Good day to you. {tag} and more")
        assert tag in decoded
        reply = TextStream(tokens, StreamDecoder(tokenizer), 1, 128, stop=SPECIAL_TAGS)
        text = "".join(c.text for c in reply)
        assert text == decoded[: decoded.index(tag)] and reply.finish_reason == "stop"
    with llama.serve() as engine:
        stream = stream_chat(engine, [{"role": "user", "content": "hello"}], temperature=0, max_new_tokens=20)
        assert set(SPECIAL_TAGS) <= set(stream._stops.stops)


def test_top_logprobs_list_the_models_alternatives(llama, tokenizer):
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    with llama.serve() as engine:
        chunks = list(engine.submit(prompt, 12, temperature=0, top_logprobs=3))
        plain = list(engine.submit(prompt, 12, temperature=0))
    assert [c.token for c in chunks] == [c.token for c in plain]
    for chunk in chunks:
        assert len(chunk.top_logprobs) == 3
        ids, values = zip(*chunk.top_logprobs)
        assert ids[0] == chunk.token and values[0] == pytest.approx(chunk.logprob, abs=1e-5)
        assert list(values) == sorted(values, reverse=True)
    assert all(c.top_logprobs is None for c in plain)


def test_logit_bias_bans_a_token_or_all_but_forces_one(llama, tokenizer):
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    with llama.serve() as engine:
        (first,) = list(engine.submit(prompt, 1, temperature=0, top_logprobs=2))
        best, runner_up = first.top_logprobs[0][0], first.top_logprobs[1][0]
        banned = [c.token for c in engine.submit(prompt, 12, temperature=0, logit_bias={str(best): -100})]
        assert banned[0] == runner_up and best not in banned
        forced = [c for c in engine.submit(prompt, 6, temperature=0.8, seed=3, logit_bias={runner_up: 100})]
        assert [c.token for c in forced] == [runner_up] * 6
        assert forced[0].logprob == pytest.approx(first.top_logprobs[1][1], abs=1e-5)  # the model's own
        # beside a biased request, another is untouched
        alone = [c.token for c in engine.submit(prompt, 12, temperature=0.8, seed=9)]
        biased = engine.submit(prompt, 12, temperature=0.8, seed=9, logit_bias={best: -100, runner_up: -100})
        beside = engine.submit(prompt, 12, temperature=0.8, seed=9)
        assert [c.token for c in beside] == alone and not {best, runner_up} & {c.token for c in biased}


def test_the_app_facing_streams_take_every_control(llama):
    with llama.serve() as engine:
        stream = stream_completion(engine, "Once upon", temperature=0.8, max_new_tokens=10, top_k=5, min_p=0.05,
                                   repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3, seed=7)
        first = "".join(c.text for c in stream)
        again = "".join(c.text for c in stream_completion(
            engine, "Once upon", temperature=0.8, max_new_tokens=10, top_k=5, min_p=0.05, repetition_penalty=1.2,
            presence_penalty=0.3, frequency_penalty=0.3, seed=7))
    assert first == again and first


@pytest.mark.parametrize("controls, message", [
    (dict(top_k=-1), "top_k must be 0 \\(off\\) or more"),
    (dict(top_k=2.5), "top_k must be"),
    (dict(min_p=1.5), "min_p must be a number in \\[0, 1\\]"),
    (dict(min_p=float("nan")), "min_p must be"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number in \\[0.01, 10\\]"),
    (dict(presence_penalty=3), "presence_penalty must be a number in \\[-2, 2\\]"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be"),
    (dict(frequency_penalty=10**400), "frequency_penalty must be"),
    (dict(stop=["a", "b", "c", "d", "e"]), "at most 4"),
    (dict(stop=[""]), "must not be empty"),
    (dict(stop=[3]), "stop must be a string or a list of strings"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(top_logprobs=21), "top_logprobs must be an integer from 0 to 20"),
    (dict(temperature=10**400), "temperature must be a finite number"),
    (dict(bogus=1), "unknown sampling parameter"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be a number from -100 to 100"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={10**6: 1}), r"logit_bias has token 1000000, outside the model's vocabulary"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids to numbers"),
    (dict(logit_bias={t: 1 for t in range(301)}), "logit_bias takes at most 300 tokens"),
])
def test_bad_controls_are_refused_with_the_field_and_range(llama, tokenizer, controls, message):
    prompt = tokenizer.encode("Once upon", bos=True, eos=False)
    with pytest.raises(InvalidRequestError, match=message):
        llama.generate([prompt], 4, **controls)
    with llama.serve() as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.submit(prompt, 4, **controls)
        assert list(engine.submit(prompt, 4, temperature=0))


def test_sampling_params_are_frozen_and_normalised():
    params = SamplingParams(temperature=1, top_k=3.0, stop="END", seed=5)
    assert params.temperature == 1.0 and params.top_k == 3 and params.stop == ("END",)
    with pytest.raises(Exception):
        params.top_k = 4  # frozen
    assert SamplingParams().penalized is False and SamplingParams(presence_penalty=0.1).penalized
