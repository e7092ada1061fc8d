"""Prompt-lookup decoding: guessing a sequence's next tokens from its own earlier text.

A reply often repeats what came before it: a name, a line of code, a sentence of the document it
summarizes. Where the last few tokens of a sequence (prompt and reply) occurred earlier, the tokens that
followed them then are a draft of what follows now. The engine feeds the draft to the model after the last
token, in one forward, and keeps each drafted token only while it equals the token the model itself draws
at that position (with the request's own seed and sampling controls), so the reply is the one decoding
without drafts gives; a forward of a few rows costs little more than one where reading the weights
dominates, so each accepted token comes almost free.

A wrong draft is not free, so a sequence drafts only as far as its recent drafts were right: the length
follows an estimate of how often a drafted token is accepted, kept up to date even while it does not draft
(its next guess is compared with the token that comes), so a reply that starts copying starts drafting.
"""

from __future__ import annotations

import math
from typing import Iterable

NGRAM_SIZES = (3, 2)  # the longest of these suffixes found earlier decides the draft
DECAY = 0.9  # weight of the previous estimate at each draft: about the last ten drafts count
# A draft of k tokens pays if the k-th one is accepted with chance at least this (acceptance ** k): on a CPU
# a forward of 1 + k rows costs 1.3-1.9 times one row (k = 1..7), so drafting starts where acceptance is
# about 0.5 (1 + 0.5 tokens for 1.3-1.45 times the time).
MIN_CHANCE_OF_LAST = 0.25
MIN_ACCEPTANCE = 0.45


class PromptLookup:
    """One sequence's tokens, indexed to draft its continuation, and how well its drafts have done."""

    def __init__(self, tokens: Iterable[int] = (), accepted: float = 1.0, rejected: float = 1.0) -> None:
        """tokens: the sequence so far. accepted, rejected: the starting estimate's counts (1 and 1: one
        token in two accepted)."""
        self.tokens: list[int] = []
        self._follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.accepted, self.rejected = accepted, rejected
        self._guess: list[int] = []  # the drafted tokens still to be compared with the coming ones
        self.extend(tokens)

    @property
    def acceptance(self) -> float:
        """The estimated chance that a drafted token is accepted, given those before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends the sequence's next tokens, scoring the last draft against them."""
        for token in tokens:
            if self._guess:
                if token == self._guess[0]:
                    self.accepted += 1
                    self._guess = self._guess[1:]
                else:
                    self.rejected += 1
                    self._guess = []
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the suffixes ending just before the new token now lie in the past
            for n, follows in self._follows.items():
                if end >= n:
                    follows[tuple(self.tokens[end - n : end])] = end

    def candidate(self, limit: int) -> list[int]:
        """Up to limit tokens that followed the latest earlier occurrence of the sequence's longest
        matching suffix (NGRAM_SIZES); empty where none occurred."""
        for n, follows in self._follows.items():
            if len(self.tokens) >= n and limit > 0:
                start = follows.get(tuple(self.tokens[-n:]))
                if start is not None:
                    return self.tokens[start : start + limit]
        return []

    def worth_drafting(self) -> int:
        """How many tokens a draft should have now: 0 below MIN_ACCEPTANCE, else as many as keep the chance
        of the last being accepted at least MIN_CHANCE_OF_LAST."""
        acceptance = self.acceptance
        if acceptance < MIN_ACCEPTANCE:
            return 0
        if acceptance >= 1.0:
            return 1 << 30
        return max(1, int(math.log(MIN_CHANCE_OF_LAST) / math.log(acceptance)))

    def draft(self, limit: int) -> list[int]:
        """The tokens to feed after the last one, at most limit (empty: decode one token as usual); the
        coming tokens are scored against them, or, where it drafts none, against its first guess."""
        self.accepted *= DECAY
        self.rejected *= DECAY
        guess = self.candidate(limit if limit > 0 else 1)
        drafted = guess[: min(limit, self.worth_drafting())]
        self._guess = drafted or guess[:1]
        return drafted
