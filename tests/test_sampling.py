"""Temperature and nucleus (top-p) sampling: the filter's exact output, draw frequencies, greedy at
temperature 0, per-row parameters, and reproducibility under a seed."""

from __future__ import annotations

import pytest
import torch

from conftest import build_llama
from llama_core.sampling import NUCLEUS_GUESS, draw, draw_top_p, logits_to_probs, sample, token_logprobs, top_p_filter

PROBS = [0.4, 0.3, 0.2, 0.05, 0.03, 0.02]
NUCLEUS = [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0, 0.0, 0.0]  # top_p 0.9: the three tokens whose mass reaches 0.9


def test_top_p_keeps_smallest_set_reaching_mass_and_renormalises():
    filtered = top_p_filter(torch.tensor([PROBS]), 0.9)
    torch.testing.assert_close(filtered, torch.tensor([NUCLEUS]))
    assert filtered[0, 3:].eq(0).all()


def test_top_p_filter_is_order_independent():
    order = torch.tensor([3, 0, 5, 2, 4, 1])
    filtered = top_p_filter(torch.tensor([PROBS])[:, order], 0.9)
    torch.testing.assert_close(filtered, torch.tensor([NUCLEUS])[:, order])


def test_top_p_one_keeps_every_token_and_tiny_top_p_keeps_the_argmax():
    probs = torch.tensor([PROBS])
    torch.testing.assert_close(top_p_filter(probs, 1.0), probs)
    torch.testing.assert_close(top_p_filter(probs, 1e-6), torch.tensor([[1.0, 0, 0, 0, 0, 0]]))


def test_draws_stay_in_the_nucleus_with_its_frequencies():
    n = 20000
    logits = torch.tensor([PROBS]).log().expand(n, -1)
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, temperature=1.0, top_p=0.9, generator=gen)
    counts = torch.bincount(tokens, minlength=len(PROBS)).float() / n
    assert counts[3:].sum() == 0, f"tokens outside the top-p nucleus were drawn: {counts.tolist()}"
    torch.testing.assert_close(counts[:3], torch.tensor(NUCLEUS[:3]), atol=0.02, rtol=0)


def test_top_p_draws_over_a_large_vocabulary_follow_the_filtered_distribution():
    # Rows whose nucleus fits in the first NUCLEUS_GUESS tokens and rows that need the full sort, mixed.
    vocab, n = 500, 6000
    gen = torch.Generator().manual_seed(11)
    peaky = torch.softmax(torch.randn(vocab, generator=gen) * 4, -1)
    flat = torch.softmax(torch.randn(vocab, generator=gen) * 0.3, -1)
    probs = torch.stack([peaky, flat, peaky, flat])
    top_p = torch.tensor([0.9, 0.9, 0.5, 1.0])
    nucleus_sizes = [(top_p_filter(probs[i : i + 1], float(top_p[i])) > 0).sum() for i in range(4)]
    assert nucleus_sizes[0] < NUCLEUS_GUESS < nucleus_sizes[1]  # both paths are exercised
    expected = top_p_filter(probs, top_p)
    tokens = draw_top_p(probs.repeat(n, 1), top_p.repeat(n), gen).view(n, 4)
    for row in range(4):
        counts = torch.bincount(tokens[:, row], minlength=vocab).float() / n
        assert counts[expected[row] == 0].sum() == 0, f"row {row} drew tokens outside its nucleus"
        # Compare the mass drawn in rank buckets: the most likely tokens, the rest of the first
        # NUCLEUS_GUESS, and the ranks past it.
        ranked = probs[row].argsort(descending=True)
        for bucket in (ranked[:4], ranked[4:NUCLEUS_GUESS], ranked[NUCLEUS_GUESS:]):
            assert abs(float(counts[bucket].sum() - expected[row, bucket].sum())) < 0.03, f"row {row}"


def test_draw_follows_the_given_probabilities():
    n = 20000
    probs = torch.tensor([[0.1, 0.6, 0.0, 0.3]]).expand(n, -1)
    counts = torch.bincount(draw(probs, torch.Generator().manual_seed(1)), minlength=4).float() / n
    assert counts[2] == 0
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.6, 0.0, 0.3]), atol=0.02, rtol=0)


def test_draw_never_picks_a_token_of_zero_weight():
    # Zero weights first, last and between: the cumulative draw must step over all of them.
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]]).repeat(5000, 1)
    tokens = draw(weights, torch.Generator().manual_seed(12)).view(5000, 2)
    assert set(tokens[:, 0].tolist()) == {1, 4}
    assert tokens[:, 1].eq(5).all()


def test_top_p_one_draws_from_the_whole_distribution():
    # Every row with top_p 1 over a vocabulary larger than NUCLEUS_GUESS: drawn from the unsorted row.
    vocab, n = 600, 4000
    gen = torch.Generator().manual_seed(13)
    probs = torch.softmax(torch.randn(2, vocab, generator=gen) * torch.tensor([[0.3], [3.0]]), -1)
    tokens = draw_top_p(probs.repeat(n, 1), 1.0, gen).view(n, 2)
    for row in range(2):
        counts = torch.bincount(tokens[:, row], minlength=vocab).float() / n
        ranked = probs[row].argsort(descending=True)
        for bucket in (ranked[:10], ranked[10:NUCLEUS_GUESS], ranked[NUCLEUS_GUESS:]):
            assert abs(float(counts[bucket].sum() - probs[row, bucket].sum())) < 0.03, f"row {row}"


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 2.0):
        torch.testing.assert_close(logits_to_probs(logits, temperature, 1.0), torch.softmax(logits / temperature, -1))


def test_temperature_zero_is_argmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(sample(logits, 0.0, 0.9, gen), logits.argmax(-1))
    assert torch.equal(sample(logits, 0, 1.0, gen), logits.argmax(-1))


def test_per_row_tensor_temperature_and_top_p():
    n = 4000
    logits = torch.tensor([PROBS]).log().repeat(3 * n, 1)
    # Rows cycle through: greedy; temperature 1 with the full distribution; temperature 1 with top_p 0.5.
    temperature = torch.tensor([0.0, 1.0, 1.0]).repeat(n)
    top_p = torch.tensor([0.9, 1.0, 0.5]).repeat(n)
    tokens = sample(logits, temperature, top_p, torch.Generator().manual_seed(4)).view(n, 3)
    assert tokens[:, 0].eq(0).all(), "rows with temperature 0 must be argmax"
    assert set(tokens[:, 1].tolist()) == set(range(len(PROBS))), "top_p 1 must reach every token"
    assert set(tokens[:, 2].tolist()) == {0, 1}, "top_p 0.5 keeps 0.4 and 0.3 only"
    share_of_0 = tokens[:, 2].eq(0).float().mean()
    assert abs(float(share_of_0) - 4 / 7) < 0.04


def test_same_generator_seed_reproduces_draws():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(5))
    first = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(6)) for _ in range(2)]
    other = sample(logits, 1.0, 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0], other)


def test_token_logprobs_is_log_softmax_of_the_chosen_token():
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(8))
    tokens = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(9))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("Once upon a time", bos=True, eos=False)


def sampled(llama, prompt):
    tokens, _ = llama.generate([prompt], max_gen_len=24, temperature=1.0, top_p=1.0)
    return tokens[0]


def test_seeded_build_reproduces_sampled_generation(meta_ckpt_dir, prompt):
    first = sampled(build_llama(meta_ckpt_dir, seed=123), prompt)
    again = sampled(build_llama(meta_ckpt_dir, seed=123), prompt)
    other = sampled(build_llama(meta_ckpt_dir, seed=124), prompt)
    assert len(first) > 4
    assert first == again
    assert first != other


def test_sampling_advances_the_generator(meta_ckpt_dir, prompt):
    llama = build_llama(meta_ckpt_dir, seed=123)
    assert sampled(llama, prompt) != sampled(llama, prompt)
