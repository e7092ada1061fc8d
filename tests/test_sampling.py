"""Sampling as pure functions: the filters' exact output (against Hugging Face's logits processors), draw
frequencies, greedy at temperature 0, per-row parameters, and seeded draws that ignore the batch."""

from __future__ import annotations

import pytest
import torch

from conftest import build_llama
from llama_core.sampling import (
    NUCLEUS_GUESS,
    apply_penalties,
    draw,
    logits_to_probs,
    sample,
    seeded_uniform,
    token_logprobs,
    top_logprobs,
    top_p_filter,
)


def seeds(n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of distinct seeds, each at counter 0: n independent draws."""
    return torch.arange(start, start + n) * 7919 + 17, torch.zeros(n, dtype=torch.long)

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
    tokens = sample(logits, 1.0, 0.9, *seeds(n))
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
    tokens = sample(probs.log().repeat(n, 1), 1.0, top_p.repeat(n), *seeds(4 * n)).view(n, 4)
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
    counts = torch.bincount(draw(probs, *seeds(n)), minlength=4).float() / n
    assert counts[2] == 0
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.6, 0.0, 0.3]), atol=0.02, rtol=0)


def test_draw_never_picks_a_token_of_zero_weight():
    # Zero weights first, last and between: the cumulative draw must step over all of them.
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]]).repeat(5000, 1)
    tokens = draw(weights, *seeds(10000)).view(5000, 2)
    assert set(tokens[:, 0].tolist()) == {1, 4}
    assert tokens[:, 1].eq(5).all()


def test_top_p_one_draws_from_the_whole_distribution():
    # Every row with top_p 1 over a vocabulary larger than NUCLEUS_GUESS: drawn from the unsorted row.
    vocab, n = 600, 4000
    gen = torch.Generator().manual_seed(13)
    probs = torch.softmax(torch.randn(2, vocab, generator=gen) * torch.tensor([[0.3], [3.0]]), -1)
    tokens = sample(probs.log().repeat(n, 1), 1.0, 1.0, *seeds(2 * n)).view(n, 2)
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
    assert torch.equal(sample(logits, 0.0, 0.9, *seeds(64)), logits.argmax(-1))
    assert torch.equal(sample(logits, 0, 1.0, *seeds(64)), logits.argmax(-1))


def test_per_row_tensor_temperature_and_top_p():
    n = 4000
    logits = torch.tensor([PROBS]).log().repeat(3 * n, 1)
    # Rows cycle through: greedy; temperature 1 with the full distribution; temperature 1 with top_p 0.5.
    temperature = torch.tensor([0.0, 1.0, 1.0]).repeat(n)
    top_p = torch.tensor([0.9, 1.0, 0.5]).repeat(n)
    tokens = sample(logits, temperature, top_p, *seeds(3 * n)).view(n, 3)
    assert tokens[:, 0].eq(0).all(), "rows with temperature 0 must be argmax"
    assert set(tokens[:, 1].tolist()) == set(range(len(PROBS))), "top_p 1 must reach every token"
    assert set(tokens[:, 2].tolist()) == {0, 1}, "top_p 0.5 keeps 0.4 and 0.3 only"
    share_of_0 = tokens[:, 2].eq(0).float().mean()
    assert abs(float(share_of_0) - 4 / 7) < 0.04


def test_same_seed_reproduces_draws_and_other_seeds_or_counters_do_not():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(5))
    first = [sample(logits, 1.0, 1.0, *seeds(8)) for _ in range(2)]
    other_seeds = sample(logits, 1.0, 1.0, *seeds(8, start=100))
    row_seeds, counters = seeds(8)
    next_step = sample(logits, 1.0, 1.0, row_seeds, counters + 1)
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0], other_seeds) and not torch.equal(first[0], next_step)


@pytest.mark.parametrize("top_p, top_k, min_p", [(0.9, 0, 0.0), (1.0, 0, 0.0), (0.8, 40, 0.0), (1.0, 0, 0.05)])
def test_a_rows_draw_does_not_depend_on_its_batch(top_p, top_k, min_p):
    # Each row alone, then all together in a shuffled batch: the same tokens, draw after draw.
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 700, generator=gen) * torch.tensor([[0.5], [1.0], [2.0], [4.0], [0.2], [3.0]])
    row_seeds = torch.tensor([3, 1_000_003, 2**62 + 5, 77, 12345, 9])
    for counter in range(5):
        counters = torch.full((6,), counter)
        alone = [int(sample(logits[i : i + 1], 0.9, top_p, row_seeds[i : i + 1], counters[:1], top_k, min_p))
                 for i in range(6)]
        order = torch.tensor([4, 0, 5, 2, 1, 3])
        together = sample(logits[order], 0.9, top_p, row_seeds[order], counters, top_k, min_p)
        assert together.tolist() == [alone[i] for i in order.tolist()]


def test_seeded_uniforms_are_uniform():
    u = seeded_uniform(torch.arange(50_000) * 31 + 7, torch.zeros(50_000, dtype=torch.long))
    assert 0 < float(u.min()) and float(u.max()) < 1
    histogram = torch.histc(u.float(), bins=10, min=0, max=1) / 50_000
    assert float((histogram - 0.1).abs().max()) < 0.01
    steps = seeded_uniform(torch.full((50_000,), 5), torch.arange(50_000))  # one request, step after step
    assert float((torch.histc(steps.float(), bins=10, min=0, max=1) / 50_000 - 0.1).abs().max()) < 0.01


# -- filters against Hugging Face's logits processors ---------------------------------------------------
def _hf_kept(warper, logits: torch.Tensor) -> torch.Tensor:
    return warper(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone()) > float("-inf")


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.1), (8, 0.6, 0.0)])
def test_filters_keep_what_hugging_face_keeps(top_k, top_p, min_p):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(31)) * 2.5
    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    expected = scores > float("-inf")
    kept = logits_to_probs(logits, 1.0, top_p, top_k, min_p) > 0
    assert torch.equal(kept, expected)
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p, top_k, min_p), torch.softmax(scores, -1))


def test_top_k_one_and_min_p_one_are_greedy():
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(32)) * 3
    assert torch.equal(sample(logits, 1.0, 1.0, *seeds(32), top_k=1), logits.argmax(-1))
    assert torch.equal(sample(logits, 1.0, 1.0, *seeds(32), min_p=1.0), logits.argmax(-1))


def test_repetition_penalty_equals_hugging_face():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(33)
    logits = torch.randn(4, 50, generator=gen) * 3
    history = torch.randint(0, 50, (4, 12), generator=gen)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, history, True)
    penalty = 1.3
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    ones, zeros = torch.full((4, 1), penalty), torch.zeros(4, 1)
    got = apply_penalties(logits, seen, torch.zeros(4, 50, dtype=torch.int32), ones, zeros, zeros)
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_penalties_follow_openai():
    gen = torch.Generator().manual_seed(34)
    logits = torch.randn(3, 20, generator=gen)
    counts = torch.randint(0, 4, (3, 20), generator=gen, dtype=torch.int32)
    presence, frequency = torch.tensor([[0.5], [0.0], [-1.0]]), torch.tensor([[0.25], [1.5], [0.0]])
    got = apply_penalties(logits, torch.zeros(3, 20, dtype=torch.bool), counts, torch.ones(3, 1), presence, frequency)
    expected = logits - frequency * counts - presence * (counts > 0).float()
    torch.testing.assert_close(got, expected)
    neutral = apply_penalties(logits, counts > 0, counts, torch.ones(3, 1), torch.zeros(3, 1), torch.zeros(3, 1))
    assert torch.equal(neutral, logits)


def test_top_logprobs_are_the_models_most_likely_tokens():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(35))
    values, ids = top_logprobs(logits, 4)
    expected = torch.log_softmax(logits, -1).topk(4)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(token_logprobs(logits, ids[:, 0]), values[:, 0])


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
