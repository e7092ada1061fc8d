"""Sampling as pure functions over a batch of logits, each row with its own parameters: penalties,
temperature, the top-k / top-p / min-p filters, a seeded draw, and log-probabilities.

The draw is by inverse CDF in token-id order: the first token whose cumulative kept probability, counted
in order of token id, reaches u x the kept total. Its one uniform u per row is a hash of the request's
seed and how many tokens it has generated, so a row's draw depends neither on the other rows of the batch
nor on the order its tokens were sorted in: the same seed gives the same tokens alone, in a batch, and in
a busy engine.
"""

from __future__ import annotations

from typing import Union

import torch

from . import cpu_kernels
from .cpu_kernels import layer_ops

Param = Union[float, torch.Tensor]

# Most nuclei are a few dozen to a few hundred tokens: on CPU the top-k of this many holds them without
# sorting the vocabulary; rows whose filters keep more are drawn from the whole sorted row.
NUCLEUS_GUESS = 256

_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2, _GOLDEN = 0x7FEB352D, 0x5BD1E995, 0x9E3779B9  # odd multipliers below 2^31: no int64 overflow


# -- filters on logits and probabilities -----------------------------------------------------------------
def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised logits [B, V]: for tokens seen in the prompt or output, positive logits divided by
    repetition and negative ones multiplied (Hugging Face / vLLM); then, over generated tokens,
    logit -= frequency x count + presence x (count > 0) (OpenAI).

    Args:
        seen: [B, V] bool, tokens of the prompt and the output so far.
        counts: [B, V] how often each token was generated.
        repetition, presence, frequency: [B, 1] per row (1, 0, 0 leave a row unchanged).
    """
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    counts = counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def top_p_filter(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p, renormalised.

    Args:
        probs: [B, V] probabilities.
        top_p: a float, or [B] per row.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = sorted_probs * _kept_sorted(sorted_probs, _column(top_p, probs), None, None)
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(dim=-1, keepdim=True))


def logits_to_probs(logits: torch.Tensor, temperature: Param, top_p: Param = 1.0, top_k: Param = 0,
                    min_p: Param = 0.0) -> torch.Tensor:
    """Softmax of logits / temperature, filtered to top_k, then top_p (of the mass left), then min_p, and
    renormalised: the distribution `sample` draws from. Rows with temperature 0 are left to the caller."""
    probs = _softmax(logits, temperature)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = _kept_sorted(sorted_probs, _column(top_p, probs), _column(top_k, probs), _column(min_p, probs))
    kept = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(dim=-1, keepdim=True))


# -- the draw ------------------------------------------------------------------------------------------
def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row [B, 1] (float64): a hash of the row's seed [B] (0 <= seed < 2^63)
    and its counter [B], the same on every device and whatever else is in the batch."""
    key = _mix32(_mix32(seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) + _GOLDEN))
    bits = _mix32(key ^ _mix32((counters * _GOLDEN) & _MASK32)) * (1 << 21) + (_mix32(key + counters) >> 11)
    return ((bits.to(torch.float64) + 0.5) / 2.0**53)[:, None]


def draw(weights: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token per row of weights [B, V] (non-negative, some positive, in token-id order): the first whose
    cumulative weight reaches u x the row's total, u = seeded_uniform(seeds, counters); never a token of
    zero weight."""
    cumulative = weights.cumsum(dim=-1)
    target = (seeded_uniform(seeds, counters) * cumulative[:, -1:].to(torch.float64)).to(cumulative.dtype)
    return torch.searchsorted(cumulative, target).clamp_max(weights.shape[-1] - 1)[:, 0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row of logits [B, V], as torch.argmax gives it (the first of equal
    maxima); float32 rows on the CPU go through llama_core's kernel where it is built, 14x torch's speed at a
    32000-token vocabulary."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 and cpu_kernels.available():
        return layer_ops.argmax(logits)
    return torch.argmax(logits, dim=-1)


def sample(logits: torch.Tensor, temperature: Param, top_p: Param, seeds: torch.Tensor, counters: torch.Tensor,
           top_k: Param = 0, min_p: Param = 0.0) -> torch.Tensor:
    """Next token for each row of logits [B, V]: argmax where temperature is 0, else a seeded draw from
    logits_to_probs(logits, temperature, top_p, top_k, min_p).

    On CPU, a row's candidates are its most likely NUCLEUS_GUESS tokens (or top_k, if more), and only rows
    whose filters keep all of those are drawn from the whole sorted row; elsewhere every row is sorted,
    with no host synchronisation."""
    greedy = greedy_tokens(logits)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    probs = _softmax(logits, temperature)
    top_p, top_k, min_p = (_column(v, probs).expand(probs.shape[0], 1) for v in (top_p, top_k, min_p))
    if probs.device.type != "cpu":
        drawn = _draw_sorted(*probs.sort(dim=-1, descending=True), top_p, top_k, min_p, seeds, counters, probs.shape[-1])[0]
    else:
        drawn = _draw_on_cpu(probs, top_p, top_k, min_p, seeds, counters)
    if isinstance(temperature, (int, float)):
        return drawn
    return torch.where(temperature.to(logits.device) == 0, greedy, drawn)


def _draw_on_cpu(probs, top_p, top_k, min_p, seeds, counters) -> torch.Tensor:
    """sample's draw with the host's help: unfiltered rows race over the unsorted row; the others over
    their most likely tokens first, sorting the whole row only where the filters keep all of those."""
    unfiltered = (top_p[:, 0] >= 1.0) & (top_k[:, 0] <= 0) & (min_p[:, 0] <= 0)
    if bool(unfiltered.all()):
        return draw(probs, seeds, counters)
    vocab = probs.shape[-1]
    guess = min(vocab, max(NUCLEUS_GUESS, int(top_k.max())))
    drawn, wide = _draw_sorted(*probs.topk(guess, dim=-1), top_p, top_k, min_p, seeds, counters, vocab)
    wide &= ~unfiltered
    if guess < vocab and bool(wide.any()):
        rows = wide.nonzero()[:, 0]
        drawn[rows] = _draw_sorted(*probs[rows].sort(dim=-1, descending=True), top_p[rows], top_k[rows],
                                   min_p[rows], seeds[rows], counters[rows], vocab)[0]
    if bool(unfiltered.any()):
        rows = unfiltered.nonzero()[:, 0]
        drawn[rows] = draw(probs[rows], seeds[rows], counters[rows])
    return drawn


# -- log-probabilities --------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Natural-log probability of tokens [...] under logits [..., V] (the model's own distribution)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def top_logprobs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens of each row of logits [B, V] under the model: (log-probabilities [B, n],
    token ids [B, n]), most likely first."""
    return torch.log_softmax(logits.float(), dim=-1).topk(n, dim=-1)


# -- helpers ------------------------------------------------------------------------------------------
def _softmax(logits: torch.Tensor, temperature: Param) -> torch.Tensor:
    return torch.softmax(logits.float() / _column(temperature, logits).clamp_min(1e-5), dim=-1)


def _kept_sorted(sorted_probs: torch.Tensor, top_p: torch.Tensor, top_k, min_p) -> torch.Tensor:
    """Which of the probabilities [B, K] (each row descending, the K most likely of its vocabulary) the
    filters keep: ranks below top_k (when > 0); within those, each token whose predecessors' mass, as a
    share of the top-k mass, is below top_p; and tokens of at least min_p x the top probability."""
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    share = sorted_probs
    if top_k is not None:
        ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
        in_top_k = (top_k <= 0) | (ranks < top_k)
        keep &= in_top_k
        share = sorted_probs * in_top_k
        share = share / torch.where(top_k > 0, share.sum(dim=-1, keepdim=True), torch.ones_like(top_k))
    mass_before = share.cumsum(dim=-1) - share
    keep &= mass_before < top_p
    if min_p is not None:
        keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always stays
    return keep


def _draw_sorted(sorted_probs, order, top_p, top_k, min_p, seeds, counters, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] drawn from the kept ones among each row's K most likely (sorted_probs [B, K] descending,
    their ids order), and whether each row keeps all K, so its kept set may reach past them. The kept
    weights are put back in token-id order before the draw."""
    keep = _kept_sorted(sorted_probs, top_p, top_k, min_p)
    if order.shape[-1] == vocab:  # the whole row: scatter back, O(V)
        by_id = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs * keep)
        return draw(by_id, seeds, counters), keep[:, -1]
    by_id = order.argsort(dim=-1)  # a few hundred candidates: sort their ids
    ids = order.gather(-1, by_id)
    picked = draw((sorted_probs * keep).gather(-1, by_id), seeds, counters)
    return ids.gather(-1, picked[:, None])[:, 0], keep[:, -1]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def _column(value: Param, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float32).reshape(-1, 1)
    return torch.full((1, 1), float(value), device=like.device)
