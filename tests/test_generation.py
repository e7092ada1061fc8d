"""Llama.generate / text_completion / stream semantics on the tiny model: batching, echo, logprobs,
EOS, length limits and streaming."""

from __future__ import annotations

import copy
import math
import signal

import pytest
import torch

from conftest import MAX_SEQ_LEN, build_llama, hf_greedy
from llama_core import Llama, LlamaError, StreamChunk


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Four prompts of clearly different lengths (1 to ~30 tokens)."""
    texts = ["Once upon a time", "import torch", "def forward(self, tokens, input_pos=None, cache_rows=None):"]
    return [[tokenizer.bos_id]] + [tokenizer.encode(t, bos=True, eos=False) for t in texts]


def test_prompt_lengths_differ(prompts):
    lengths = [len(p) for p in prompts]
    assert len(set(lengths)) == 4 and max(lengths) > 20


def test_batched_rows_equal_solo_greedy(llama, prompts):
    batch_tokens, batch_lps = llama.generate(prompts, max_gen_len=24, temperature=0, logprobs=True)
    for row, prompt in enumerate(prompts):
        solo_tokens, solo_lps = llama.generate([prompt], max_gen_len=24, temperature=0, logprobs=True)
        assert batch_tokens[row] == solo_tokens[0], f"row {row} differs from its solo generation"
        torch.testing.assert_close(torch.tensor(batch_lps[row]), torch.tensor(solo_lps[0]), atol=1e-5, rtol=0)


def test_batched_echo_logprobs_equal_solo(llama, prompts):
    batch_tokens, batch_lps = llama.generate(prompts[::-1], max_gen_len=6, temperature=0, logprobs=True, echo=True)
    for row, prompt in enumerate(prompts[::-1]):
        solo_tokens, solo_lps = llama.generate([prompt], max_gen_len=6, temperature=0, logprobs=True, echo=True)
        assert batch_tokens[row] == solo_tokens[0]
        torch.testing.assert_close(torch.tensor(batch_lps[row]), torch.tensor(solo_lps[0]), atol=1e-5, rtol=0)


def test_results_do_not_depend_on_earlier_requests(meta_ckpt_dir, llama, prompts):
    # A long generation leaves keys/values deep in the cache; a later short one must not see them.
    llama.generate([prompts[-1]] * 4, max_gen_len=60, temperature=0)
    used, _ = llama.generate([prompts[0], prompts[1]], max_gen_len=30, temperature=0)
    fresh, _ = build_llama(meta_ckpt_dir).generate([prompts[0], prompts[1]], max_gen_len=30, temperature=0)
    assert used == fresh


def test_greedy_matches_hf_across_batch(llama, hf_model, prompts, tokenizer):
    tokens, _ = llama.generate(prompts, max_gen_len=32, temperature=0)
    for row, prompt in enumerate(prompts):
        expected, _ = hf_greedy(hf_model, prompt, 32, tokenizer.eos_id)
        assert tokens[row] == expected


def test_echo_returns_prompt_first_with_zero_first_logprob(llama, prompts):
    for prompt in prompts:
        tokens, logprobs = llama.generate([prompt], max_gen_len=5, temperature=0, logprobs=True, echo=True)
        plain, plain_lps = llama.generate([prompt], max_gen_len=5, temperature=0, logprobs=True)
        assert tokens[0] == prompt + plain[0]
        assert len(logprobs[0]) == len(tokens[0])
        assert logprobs[0][0] == 0.0
        assert all(lp <= 0.0 for lp in logprobs[0])
        assert logprobs[0][len(prompt):] == pytest.approx(plain_lps[0], abs=1e-5)


def test_without_logprobs_returns_none(llama, prompts):
    tokens, logprobs = llama.generate(prompts[:2], max_gen_len=3, temperature=0)
    assert logprobs is None
    assert [len(t) for t in tokens] == [3, 3]


def test_greedy_logprobs_are_those_of_the_most_likely_token(llama, prompts, tokenizer):
    tokens, logprobs = llama.generate([prompts[1]], max_gen_len=8, temperature=0, logprobs=True)
    assert len(logprobs[0]) == len(tokens[0]) == 8
    # The argmax of a distribution over V tokens has probability at least 1/V.
    assert all(-math.log(tokenizer.n_words) <= lp < 0.0 for lp in logprobs[0])


@pytest.mark.parametrize("max_gen_len", [1, 2, 7])
def test_max_gen_len_is_respected(llama, prompts, max_gen_len):
    tokens, _ = llama.generate(prompts, max_gen_len=max_gen_len, temperature=0)
    longer, _ = llama.generate(prompts, max_gen_len=20, temperature=0)
    for row in range(len(prompts)):
        assert len(tokens[row]) == max_gen_len  # the tiny model emits no EOS this early
        assert tokens[row] == longer[row][:max_gen_len]


def test_generation_stops_when_context_is_full(llama, hf_model, tokenizer, prompts):
    gen = torch.Generator().manual_seed(11)
    long_prompt = [tokenizer.bos_id] + torch.randint(3, tokenizer.n_words, (MAX_SEQ_LEN - 4,), generator=gen).tolist()
    assert len(long_prompt) == MAX_SEQ_LEN - 3
    tokens, logprobs = llama.generate([long_prompt, prompts[1]], max_gen_len=50, temperature=0, logprobs=True)
    assert len(tokens[0]) <= 3
    expected, _ = hf_greedy(hf_model, long_prompt, 3, tokenizer.eos_id)
    assert tokens[0] == expected
    assert len(logprobs[0]) == len(tokens[0])
    # The short prompt beside it is not cut short by its neighbour's full context.
    solo, _ = llama.generate([prompts[1]], max_gen_len=50, temperature=0)
    assert tokens[1] == solo[0] and len(tokens[1]) > 3


def test_prompt_of_max_seq_len_minus_one_gets_one_token(llama, tokenizer):
    prompt = [tokenizer.bos_id] + [5] * (MAX_SEQ_LEN - 2)
    tokens, _ = llama.generate([prompt], max_gen_len=10, temperature=0)
    assert len(tokens[0]) <= 1


# -- EOS -------------------------------------------------------------------------------------------
def llama_with_eos_for(llama: Llama, token: int) -> Llama:
    """A copy of the model whose output rows for `token` and EOS are swapped: wherever the original would
    say `token` this one says EOS, and everything before is unchanged (softmax is permutation-invariant)."""
    model = copy.deepcopy(llama.model)
    eos = llama.tokenizer.eos_id
    weight = model.output.weight.detach().clone()  # a copy where the output layer holds a layout of its own
    weight[[token, eos]] = weight[[eos, token]].clone()
    model.output = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.output.weight = torch.nn.Parameter(weight, requires_grad=False)
    return Llama.from_model(model, llama.tokenizer, max_seq_len=MAX_SEQ_LEN, max_batch_size=4, seed=0)


def test_generation_stops_at_eos_without_returning_it(llama, prompts, tokenizer):
    prompt, other = prompts[2], prompts[1]
    greedy, greedy_lps = llama.generate([prompt], max_gen_len=20, temperature=0, logprobs=True)
    greedy, greedy_lps = greedy[0], greedy_lps[0]
    stop_at = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    eos_llama = llama_with_eos_for(llama, greedy[stop_at])

    tokens, logprobs = eos_llama.generate([prompt], max_gen_len=20, temperature=0, logprobs=True)
    assert tokens[0] == greedy[:stop_at]
    assert tokenizer.eos_id not in tokens[0]
    assert logprobs[0] == pytest.approx(greedy_lps[:stop_at], abs=1e-5)

    echoed, echoed_lps = eos_llama.generate([prompt], max_gen_len=20, temperature=0, logprobs=True, echo=True)
    assert echoed[0] == prompt + greedy[:stop_at] and len(echoed_lps[0]) == len(echoed[0])

    # In a batch, the row that ended keeps its result and the other row runs on to its own end.
    batch, _ = eos_llama.generate([prompt, other], max_gen_len=20, temperature=0)
    solo_other, _ = eos_llama.generate([other], max_gen_len=20, temperature=0)
    assert batch == [greedy[:stop_at], solo_other[0]]


def test_immediate_eos_gives_empty_generation(llama, prompts):
    first, _ = llama.generate([prompts[1]], max_gen_len=1, temperature=0)
    eos_llama = llama_with_eos_for(llama, first[0][0])
    tokens, logprobs = eos_llama.generate([prompts[1]], max_gen_len=10, temperature=0, logprobs=True)
    assert tokens == [[]] and logprobs == [[]]
    assert eos_llama.text_completion(["Once upon a time"], temperature=0, max_gen_len=10)[0]["generation"] == ""


# -- text_completion ------------------------------------------------------------------------------
def test_text_completion_returns_generation_text(llama, tokenizer):
    texts = ["Once upon a time", "import torch"]
    results = llama.text_completion(texts, temperature=0, max_gen_len=12)
    assert [set(r) for r in results] == [{"generation"}, {"generation"}]
    for text, result in zip(texts, results):
        tokens, _ = llama.generate([tokenizer.encode(text, bos=True, eos=False)], max_gen_len=12, temperature=0)
        assert result["generation"] == tokenizer.decode(tokens[0])


def test_text_completion_with_logprobs_gives_tokens_and_logprobs(llama, tokenizer):
    results = llama.text_completion(["Once upon a time"], temperature=0, max_gen_len=12, logprobs=True)
    result = results[0]
    assert set(result) == {"generation", "tokens", "logprobs"}
    ids, lps = llama.generate([tokenizer.encode("Once upon a time", bos=True, eos=False)], 12, 0, logprobs=True)
    assert result["tokens"] == [tokenizer.decode([t]) for t in ids[0]]
    assert all(isinstance(t, str) for t in result["tokens"])
    assert len(result["logprobs"]) == len(result["tokens"]) == 12
    assert result["logprobs"] == pytest.approx(lps[0], abs=1e-6)


def test_text_completion_echo_starts_with_the_prompt(llama):
    result = llama.text_completion(["Once upon a time"], temperature=0, max_gen_len=5, echo=True, logprobs=True)[0]
    assert result["generation"].startswith("Once upon a time")
    assert result["logprobs"][0] == 0.0 and len(result["logprobs"]) == len(result["tokens"])


# -- stream ---------------------------------------------------------------------------------------
def streamed(llama, prompt, n):
    chunks = list(llama.stream(prompt, n, temperature=0))
    assert all(isinstance(c, StreamChunk) for c in chunks)
    return chunks


@pytest.mark.parametrize("text", ["Once upon a time", "import torch", "héllo wörld 🙂"])
def test_stream_tokens_and_text_equal_generate(llama, tokenizer, text):
    prompt = tokenizer.encode(text, bos=True, eos=False)
    tokens, logprobs = llama.generate([prompt], max_gen_len=24, temperature=0, logprobs=True)
    chunks = streamed(llama, prompt, 24)
    assert [c.token for c in chunks if c.token != -1] == tokens[0]
    assert [c.logprob for c in chunks if c.token != -1] == pytest.approx(logprobs[0], abs=1e-5)
    assert "".join(c.text for c in chunks) == tokenizer.decode(tokens[0])


@pytest.fixture(scope="module")
def prompt_answered_with_a_word_start(llama, tokenizer):
    """A prompt whose first greedy token is a word-initial piece ('▁...'), which decode() renders without
    its leading space when it begins the text."""
    for token in range(3, tokenizer.n_words):
        prompt = [tokenizer.bos_id, token]
        first, _ = llama.generate([prompt], max_gen_len=1, temperature=0)
        if first[0] and tokenizer.sp_model.id_to_piece(first[0][0]).startswith("▁"):
            return prompt
    pytest.fail("no prompt of the tiny model starts its answer with a word-initial piece")


def test_stream_text_equals_decode_when_answer_starts_a_word(llama, tokenizer, prompt_answered_with_a_word_start):
    prompt = prompt_answered_with_a_word_start
    tokens, _ = llama.generate([prompt], max_gen_len=16, temperature=0)
    # As a reply (chat): the pieces join to what text_completion / chat_completion return.
    reply = list(llama.stream(prompt, 16, temperature=0, continue_prompt=False))
    assert [c.token for c in reply if c.token != -1] == tokens[0]
    assert "".join(c.text for c in reply) == tokenizer.decode(tokens[0])
    # As a continuation (completion): the prompt's text plus the pieces reads as the whole sequence,
    # so the space that starts the first generated word is kept.
    continuation = "".join(c.text for c in llama.stream(prompt, 16, temperature=0))
    assert tokenizer.decode(prompt) + continuation == tokenizer.decode(prompt + tokens[0])
    assert continuation.startswith(" ") and not tokenizer.decode(tokens[0]).startswith(" ")


def test_stream_text_arrives_token_by_token(llama, tokenizer):
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    chunks = streamed(llama, prompt, 24)
    assert sum(1 for c in chunks if c.text) > 1, "stream must not hold all text back until the end"


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM to bound a possible hang")
def test_generate_beside_an_unfinished_stream_neither_hangs_nor_corrupts_it(meta_ckpt_dir, tokenizer):
    # A client that stops reading a stream leaves its generator suspended. Another call on the same Llama
    # (here on the same thread) must either run or refuse with a LlamaError; waiting forever is a deadlock.
    llama = build_llama(meta_ckpt_dir)
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    uninterrupted = [c.token for c in llama.stream(prompt, 10, temperature=0)]
    stream = llama.stream(prompt, 10, temperature=0)
    first = next(stream).token

    def timeout(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(5)
    try:
        try:
            llama.generate([tokenizer.encode("import torch", bos=True, eos=False)], 8, temperature=0)
        except LlamaError:
            pass  # a clear refusal is acceptable
        except TimeoutError:
            pytest.fail("generate() waits forever while a stream of the same Llama is unfinished")
        finally:
            signal.alarm(0)
        # Whatever generate did, the suspended stream must continue with its own tokens.
        assert [first] + [c.token for c in stream] == uninterrupted
    finally:
        signal.signal(signal.SIGALRM, previous)
        stream.close()
