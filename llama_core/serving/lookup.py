"""Prompt-lookup decoding: guessing a sequence's next tokens from its own earlier text.

A reply often repeats what came before it: a name, a line of code, a sentence of the document it
summarizes. Where the last few tokens of a sequence (prompt and reply) occurred earlier, the tokens that
followed them then are a draft of what follows now. The engine feeds the draft to the model after the last
token, in one forward, and keeps each drafted token only while it equals the token the model itself draws
at that position (with the request's own seed and sampling controls), so the reply is the one decoding
without drafts gives; a forward of a few rows costs little more than one where reading the weights
dominates, so each accepted token comes almost free.

A wrong draft is not free, so a sequence drafts only as far as its recent drafts were right: the length
follows an estimate of how often a drafted token is accepted, weighed against what each drafted token adds
to the step's time, and the estimate is kept up to date even while it does not draft (its next guess is
compared with the token that comes), so a reply that starts copying starts drafting.

A caller who knows roughly what the reply will be (a file to be changed a little) may give it as a
prediction (OpenAI's predicted outputs): drafts come from it first, and the reply is still the model's own.
"""

from __future__ import annotations

import bisect
import collections
from typing import Iterable, Sequence

NGRAM_SIZES = (3, 2)  # the longest of these suffixes found earlier decides the draft
DECAY = 0.9  # weight of the previous estimate at each draft: about the last ten drafts count


class PromptLookup:
    """One sequence's tokens, indexed to draft its continuation, and how well its drafts have done."""

    def __init__(self, tokens: Iterable[int] = (), accepted: float = 1.0, rejected: float = 1.0,
                 prediction: Sequence[int] = (), reply_start: int = 0) -> None:
        """tokens: the sequence so far. accepted, rejected: the starting estimate's counts (1 and 1: one token
        in two accepted). prediction: the reply as the caller expects it (OpenAI's predicted outputs), drafted
        from first: while the reply so far is its beginning, its next tokens; elsewhere, what follows the
        reply's last tokens where they occur in it nearest the reply's length. reply_start: where the reply
        begins in tokens."""
        self.tokens: list[int] = []
        self._follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.accepted, self.rejected = accepted, rejected
        self._guess: list[int] = []  # the drafted tokens still to be compared with the coming ones
        self._prediction = tuple(prediction)
        self._predicted: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in NGRAM_SIZES}
        for n, follows in self._predicted.items():  # where each n tokens of the prediction are followed, ascending
            for end in range(n, len(self._prediction)):
                follows.setdefault(self._prediction[end - n : end], []).append(end)
        self._reply_start = reply_start
        self._on_prediction = bool(self._prediction)  # the reply so far is the prediction's beginning
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
            reply_length = len(self.tokens) - self._reply_start  # before this token
            if self._on_prediction and reply_length >= 0:
                self._on_prediction = reply_length < len(self._prediction) and self._prediction[reply_length] == token
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the suffixes ending just before the new token now lie in the past
            for n, follows in self._follows.items():
                if end >= n:
                    follows[tuple(self.tokens[end - n : end])] = end

    def candidate(self, limit: int) -> list[int]:
        """Up to limit tokens: from the prediction where there is one (see __init__), else those that followed
        the latest earlier occurrence of the sequence's longest matching suffix (NGRAM_SIZES); empty where
        none occurred."""
        if self._prediction and limit > 0:
            reply_length = len(self.tokens) - self._reply_start
            if self._on_prediction:
                return list(self._prediction[reply_length : reply_length + limit])
            for n, follows in self._predicted.items():
                starts = follows.get(tuple(self.tokens[-n:])) if reply_length >= n else None
                if starts:
                    i = bisect.bisect_left(starts, reply_length)
                    start = min(starts[max(i - 1, 0) : i + 1], key=lambda at: abs(at - reply_length))
                    return list(self._prediction[start : start + limit])
        for n, follows in self._follows.items():
            if len(self.tokens) >= n and limit > 0:
                start = follows.get(tuple(self.tokens[-n:]))
                if start is not None:
                    return self.tokens[start : start + limit]
        return []

    def worth_drafting(self, limit: int, price: float) -> int:
        """How many tokens (at most limit) a draft should have now, where each drafted token adds `price` to a
        one-token step's time: the k whose step gives the most tokens for its time, 1 + a + ... + a^k tokens
        (a the acceptance) for 1 + price * k; 0 where none beats one token a step, as below an acceptance of
        `price`."""
        acceptance, expected, term = self.acceptance, 1.0, 1.0
        best, best_rate = 0, 1.0
        for k in range(1, limit + 1):
            term *= acceptance
            expected += term
            rate = expected / (1.0 + price * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def draft(self, limit: int, price: float = 0.1) -> list[int]:
        """The tokens to feed after the last one, at most limit (empty: decode one token as usual), where each
        adds `price` to a step's time (see worth_drafting); the coming tokens are scored against them, or,
        where it drafts none, against its first guess."""
        self.accepted *= DECAY
        self.rejected *= DECAY
        guess = self.candidate(limit if limit > 0 else 1)
        drafted = guess[: self.worth_drafting(limit, price)]
        self._guess = drafted or guess[:1]
        return drafted


class DraftPrice:
    """What a drafted token adds to a step's time, as a share of a one-token step's, learned from the forwards
    of one sequence with and without drafts.

    Each width's estimate is its fastest forward among the last `window` timed: a busy machine only ever
    slows a forward, so the fastest is nearest the model's own cost, one slow step cannot price drafts out
    (after which no drafted step would run to correct it), and every width's fastest comes from the same
    stretch of time. `prior` stands until one-token forwards and some drafted width each have `least` times
    in the window; the price is never below `floor` (a price of 0 would draft as far as any acceptance
    allows). A `fixed` price is the prior, never learned: the same drafts in every run.
    """

    def __init__(self, prior: float, window: int = 128, least: int = 3, floor: float = 0.03,
                 fixed: bool = False) -> None:
        self.prior, self.floor, self.fixed = prior, floor, fixed
        self._window, self._least = window, least
        self._timed = 0  # forwards recorded so far
        # per width (tokens fed): the indices of its forwards in the window, and its candidates for the fastest,
        # (index, seconds) with both increasing, so that the first one left in the window is the fastest
        self._indices: dict[int, collections.deque[int]] = {}
        self._fastest: dict[int, collections.deque[tuple[int, float]]] = {}

    def record(self, width: int, seconds: float) -> None:
        """A step fed one sequence `width` tokens (its last and width - 1 drafted) in `seconds`."""
        if self.fixed:
            return
        self._indices.setdefault(width, collections.deque()).append(self._timed)
        fastest = self._fastest.setdefault(width, collections.deque())
        while fastest and fastest[-1][1] >= seconds:  # never again the fastest while this one is in the window
            fastest.pop()
        fastest.append((self._timed, seconds))
        self._timed += 1

    @property
    def price(self) -> float:
        """The mean over the drafted widths timed of what each drafted token added to a one-token step."""
        oldest, fastest = self._timed - self._window, {}
        for width, indices in self._indices.items():
            while indices and indices[0] < oldest:
                indices.popleft()
            candidates = self._fastest[width]
            while candidates and candidates[0][0] < oldest:
                candidates.popleft()
            if len(indices) >= self._least:
                fastest[width] = candidates[0][1]
        one = fastest.pop(1, None)
        if one is None or not fastest:
            return self.prior
        shares = [(seconds / one - 1) / (width - 1) for width, seconds in fastest.items()]
        return max(self.floor, sum(shares) / len(shares))
