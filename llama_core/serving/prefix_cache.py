"""Prefix caching: which token ids each KV-cache slot holds, and where a new prompt finds the longest prefix
of itself already computed.

A slot keeps what its last request wrote after that request ends, as llama.cpp's server does: a chat's
next turn, which sends the whole conversation again, finds it in the slot its last turn used and computes
only what is new. A prefix held by a slot the request cannot take (one busy with another request, or an
idle one whose longer history is worth keeping) is copied into a free slot, row by row on the device,
instead of computed again: a system prompt shared by many users is computed once. A request whose prefix
another request is still computing waits for it rather than computing it too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Optional, Sequence

# A shared prefix shorter than this (and shorter than the prompt) is computed again: reusing it would evict
# or copy a slot's history, or wait a turn, to save less than a chunk of work.
MIN_SHARED_PREFIX = 16

# Compared a block at a time (C speed), then token by token within the first block that differs.
_BLOCK = 64


@dataclass(frozen=True)
class Placement:
    """Where a request goes: a free `slot`, how many of its prompt's first tokens are already computed
    (`cached_tokens`), the slot to copy those KV-cache rows from (`copy_from`; None: `slot` holds them), and
    a free slot to move the history `slot` holds into first, where it stays cached (`keep_held_in`)."""

    slot: int
    cached_tokens: int = 0
    copy_from: Optional[int] = None
    keep_held_in: Optional[int] = None


class PrefixCache:
    """The token ids whose keys and values each idle slot holds, and the choice of a slot for a new prompt.

    Busy slots are described by their requests at each choice (what each has written so far); this keeps
    what idle slots hold, from `release` (the request ended) until `take` (a new one moves in).
    """

    def __init__(self, slots: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: list[tuple[int, ...]] = [()] * slots
        self._released_at = [-1] * slots  # least recently used first; -1: never used, or forgotten
        self._clock = itertools.count()

    def held(self, slot: int) -> tuple[int, ...]:
        """The token ids whose keys and values idle slot `slot` holds at positions 0, 1, ..."""
        return self._held[slot]

    def take(self, slot: int) -> None:
        """A request moves into slot: what it held is no longer known to be there."""
        self._held[slot] = ()

    def release(self, slot: int, tokens: Sequence[int]) -> None:
        """slot's request ended having written the keys and values of tokens (positions 0, 1, ...)."""
        self._held[slot] = tuple(tokens) if self.enabled else ()
        self._released_at[slot] = next(self._clock)

    def moved(self, source: int, target: int) -> None:
        """What idle slot source held was copied into idle slot target (Placement.keep_held_in)."""
        self._held[target] = self._held[source]
        self._released_at[target] = self._released_at[source]

    def forget(self, slot: int) -> None:
        """slot's rows can't be trusted (its request failed): it holds nothing, and is the first to reuse."""
        self._held[slot] = ()
        self._released_at[slot] = -1

    def forget_all(self) -> None:
        """No slot's rows can be trusted (something else wrote the KV cache)."""
        for slot in range(len(self._held)):
            self.forget(slot)

    def place(self, prompt: Sequence[int], free_slots: Sequence[int],
              busy: Optional[Mapping[int, Sequence[int]]] = None, computing: Iterable[Sequence[int]] = (),
              reuse: bool = True, targets: Optional[Sequence[int]] = None) -> Optional[Placement]:
        """Chooses a free slot for prompt, reusing the longest computed prefix of it that any slot holds;
        None when the request should wait instead, because a request admitted before it is computing a
        prefix it shares, MIN_SHARED_PREFIX tokens longer than any held now.

        Args:
            prompt: the new request's prompt token ids.
            free_slots: the slots it may take (at least one).
            busy: for each busy slot, the token ids its request has written so far.
            computing: the prompts of requests whose prompts are not written yet.
            reuse: False for a request that must compute its whole prompt (one asking for its prompt's
                log-probabilities): it takes the least recently used slot.
            targets: the free slots it may move into (default: all of them); a prefix that another free
                slot holds is copied into one of these, and the history a target holds is moved out into
                the least recently used other free slot (where that one's is older), rather than lost.

        The prompt's last token is always computed, so that its logits exist. A free slot holding a prefix
        is taken unless it holds more than twice that prefix, which stays for its own user while the prefix
        is copied into the least recently used slot.
        """
        targets = list(free_slots if targets is None else targets)
        lru = min(targets, key=self._released_at.__getitem__)
        if not self.enabled:
            return Placement(targets[0])
        placement = self._choose(prompt, free_slots, targets, lru, busy or {}, computing, reuse)
        if placement is None:
            return None
        others = [slot for slot in free_slots if slot not in targets and slot != placement.copy_from]
        held = len(self._held[placement.slot])
        kept = placement.cached_tokens if placement.copy_from is None else 0  # of what placement.slot holds
        if others and held >= MIN_SHARED_PREFIX and 2 * kept < held:
            keep = min(others, key=self._released_at.__getitem__)
            if self._released_at[keep] < self._released_at[placement.slot]:
                return replace(placement, keep_held_in=keep)
        return placement

    def _choose(self, prompt, free_slots, targets, lru, busy, computing, reuse) -> Optional[Placement]:
        if not reuse:
            return Placement(lru)
        holders = {slot: self._held[slot] for slot in free_slots} | dict(busy)
        shared, source = max(
            ((shared_prefix_length(prompt, tokens), slot) for slot, tokens in holders.items()),
            key=lambda item: (item[0], item[1] in free_slots, -self._released_at[item[1]]),
        )
        waiting_gain = max((shared_prefix_length(prompt, p) for p in computing), default=0) - shared
        if waiting_gain >= MIN_SHARED_PREFIX:
            return None
        cached = min(shared, len(prompt) - 1)
        if cached < min(MIN_SHARED_PREFIX, len(prompt) - 1) or cached == 0:
            return Placement(lru)
        if source in targets and (2 * shared >= len(holders[source]) or source == lru):
            return Placement(source, cached)
        return Placement(lru, cached, copy_from=source)


def shared_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids a and b have in common."""
    if type(a) is not type(b):  # a tuple's slice never equals a list's
        a, b = tuple(a), tuple(b)
    end = min(len(a), len(b))
    start = 0
    while start < end and a[start : start + _BLOCK] == b[start : start + _BLOCK]:
        start += _BLOCK
    start = min(start, end)
    while start < end and a[start] == b[start]:
        start += 1
    return start
