"""Scheduling: the queue of waiting requests and the KV cache's slots, which request runs in which slot
(placed by the prefix cache, see prefix_cache), and which admitted prompts are prefilled together.

Admission is fair across clients (a request's `client`; every anonymous request counts as one client) by the
service each has had, as the Virtual Token Counter does (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): a client's counter adds PROMPT_TOKEN_WEIGHT for each prompt token computed (charged as the
request is admitted; those found in the prefix cache are free) and OUTPUT_TOKEN_WEIGHT for each token generated
(read from its requests as the scheduler chooses, nothing counted per step). A free slot goes to the waiting
request of the client with the least counter, then the fewest requests running, the one queued first among
those, so each client's requests keep their order, and with one client it is first come, first served. A client
that arrives (nothing running or waiting, then a request) has its counter lifted to the least counter of the
clients holding requests, so that time away is not banked as credit. That least never falls while requests are
held, so a gone client's counter is forgotten once it is no more than the least (it would be lifted to that on
return), and every counter once nothing is held: those kept are the present clients' and those served more.
Nothing running is preempted. A named client holds at most `client_capacity` requests, running and waiting, so
that part of the queue is always left to the others.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

from ..errors import ServerBusyError
from ..runner import ModelRunner
from .events import Admitted
from .prefix_cache import Placement, PrefixCache
from .sequence import EngineCounts, Sequence

PROMPT_TOKEN_WEIGHT = 1  # added to a client's counter per prompt token computed for it
OUTPUT_TOKEN_WEIGHT = 2  # and per token generated (VTC's weights: a token decoded costs more than one prefilled)


def client_capacity(slots: int, max_waiting: int) -> int:
    """The most requests one named client may hold at once, running and waiting: every slot and half the
    waiting queue, rounded up (max_waiting // 2 places are always left to other clients). Anonymous requests are
    not bounded so: they come from callers in the serving process itself (every route of a server names its
    client), and the engine's own bound holds them."""
    return slots + (max_waiting + 1) // 2


def service(sequence: Sequence) -> int:
    """What an admitted request adds to its client's counter so far: its prompt tokens computed, its tokens
    generated, weighted."""
    computed = len(sequence.prompt_tokens) - sequence.cached_tokens
    return PROMPT_TOKEN_WEIGHT * computed + OUTPUT_TOKEN_WEIGHT * sequence.generated


class Scheduler:
    """The waiting queue and what each slot holds. The queue is shared with submitting threads under
    `wakeup`; the slots belong to whichever thread runs the engine's turn."""

    def __init__(self, runner: ModelRunner, wakeup: threading.Condition, counts: EngineCounts, prefill_chunk: int,
                 prefix_caching: bool, admitted: Callable[[Sequence], None]) -> None:
        """admitted: called for each request as it takes its slot (to set up what its sampling follows)."""
        self.runner = runner
        self.wakeup = wakeup
        self.counts = counts
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(runner.max_batch_size, enabled=prefix_caching)
        self.slots: list[Optional[Sequence]] = [None] * runner.max_batch_size
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.served: dict[Optional[str], int] = {}  # per client: its counter less its running requests' service
        self._admitted = admitted

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        return not self.waiting and not any(self.slots)

    @property
    def active(self) -> list[Sequence]:
        """The requests in their slots, in slot order."""
        return [s for s in self.slots if s is not None]

    @property
    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    def held(self) -> list[Sequence]:
        """Every request it holds, running or waiting."""
        with self.wakeup:
            return self.active + list(self.waiting)

    def enqueue(self, sequence: Sequence, max_waiting: int) -> None:
        """Queues a request, waking the engine's thread (the caller holds `wakeup`).

        Raises:
            ServerBusyError: every slot is busy and max_waiting requests already wait, or the request's client
                holds client_capacity requests already.
        """
        if len(self.waiting) >= max_waiting + self.free_slots:
            raise ServerBusyError.full(len(self.slots), len(self.waiting))
        held = sum(s.client == sequence.client for s in self.active + list(self.waiting))
        if sequence.client is not None and held >= client_capacity(len(self.slots), max_waiting):
            raise ServerBusyError.client_full(held)
        if not held:
            self._arrive(sequence.client)
        self.waiting.append(sequence)
        self.wakeup.notify()

    def _arrive(self, client: Optional[str]) -> None:
        """Lifts an arriving client's counter to the least of the clients holding requests, and forgets the
        counters of the clients gone that are no more than that (see the module's docstring)."""
        counters = self._counters(list(self.waiting))
        least = min(counters.values(), default=None)
        if least is None:
            self.served.clear()
            return
        self.served = {c: n for c, n in self.served.items() if c in counters or n > least}
        self.served[client] = max(self.served.get(client, 0), least)

    def _counters(self, waiting: list[Sequence]) -> collections.Counter:
        """The counters of the clients with requests running or in waiting (the caller holds `wakeup`)."""
        active = self.active
        counters = collections.Counter({s.client: self.served.get(s.client, 0) for s in active + waiting})
        for sequence in active:
            counters[sequence.client] += service(sequence)
        return counters

    def take_waiting(self) -> list[Sequence]:
        """Empties the waiting queue; what it held."""
        with self.wakeup:
            pending, self.waiting = list(self.waiting), collections.deque()
        return pending

    def retire_cancelled(self) -> None:
        """Ends the cancelled running requests (between decode steps; the waiting ones: retire_abandoned)."""
        for slot, sequence in enumerate(self.slots):
            if sequence is not None and sequence.channel.cancelled.is_set():
                self.free(slot, "cancelled")

    def retire_abandoned(self) -> None:
        """Ends the waiting requests that were cancelled: each gives its place in the queue back at once, also
        while decoding runs a step ahead (every turn, where running requests are retired only between steps)."""
        with self.wakeup:
            gone = [s for s in self.waiting if s.channel.cancelled.is_set()]
            if gone:
                self.waiting = collections.deque(s for s in self.waiting if not s.channel.cancelled.is_set())
        for sequence in gone:
            sequence.finish("cancelled")

    def admit(self) -> tuple[list[list[Sequence]], list[Sequence]]:
        """Moves waiting requests into free slots, fairly across clients (see the module's docstring). Returns
        the groups of them to prefill, each in one padded forward, and those that may instead ride along in this
        turn's decode step (one forward for both), where the model allows and other requests are decoding. A
        prompt longer than prefill_chunk is in neither: it is prefilled chunk by chunk. A request whose prompt
        shares a long prefix with one being computed waits for it (see PrefixCache.place); the next in turn
        goes ahead."""
        free_slots = [slot for slot, s in enumerate(self.slots) if s is None]
        with self.wakeup:
            waiting = list(self.waiting) if free_slots else []
            counters = self._counters(waiting) if waiting else collections.Counter()
        busy, computing = {}, []  # what the busy slots hold and will hold, for the prefix cache to choose
        if waiting and self.prefix_cache.enabled:
            busy = {slot: s.written_tokens for slot, s in enumerate(self.slots) if s is not None}
            computing = [s.prompt_tokens for s in self.slots if s is not None and s.prefilling]
        running = collections.Counter(s.client for s in self.slots if s is not None)
        admitted = []
        while free_slots and waiting:
            # min keeps the first of a tie: queue order
            sequence = min(waiting, key=lambda s: (counters[s.client], running[s.client]))
            waiting.remove(sequence)
            if sequence.channel.cancelled.is_set():
                self._dequeue(sequence)
                sequence.finish("cancelled")
                continue
            taken = [slot for slot, s in enumerate(self.slots) if s is not None]
            placement = self.prefix_cache.place(sequence.prompt_tokens, free_slots, busy, computing,
                                                reuse=not sequence.request.prompt_logprobs,
                                                targets=self.runner.slots_to_fill(free_slots, taken))
            if placement is None:
                continue
            free_slots.remove(placement.slot)
            self._occupy(sequence, placement)
            admitted.append(sequence)
            running[sequence.client] += 1
            counters[sequence.client] += service(sequence)  # its prompt, charged as it is admitted
            busy[sequence.slot] = sequence.written_tokens
            computing.append(sequence.prompt_tokens)
        short = [s for s in admitted if len(s.uncomputed) <= self.prefill_chunk]  # longer: chunk by chunk
        # Alone: a prompt scored whole, and one that fills the context (its last position is the cache's, where
        # a padded batch would write the padding after it).
        alone = [s for s in short if s.request.prompt_logprobs or len(s.prompt_tokens) >= self.runner.max_seq_len]
        together = [s for s in short if s not in alone]
        riders = []
        decoding = any(s is not None and s not in admitted and not s.prefilling for s in self.slots)
        if together and decoding and self.runner.mixes_prompts:
            riders, together = together, []
        return [[s] for s in alone] + ([together] if together else []), riders

    def _dequeue(self, sequence: Sequence) -> None:
        with self.wakeup:
            self.waiting.remove(sequence)

    def _occupy(self, sequence: Sequence, placement: Placement) -> None:
        """Puts an admitted request into its slot, starting after the cached prefix its placement found
        (copied there first where the placement says so)."""
        cached = placement.cached_tokens
        if placement.keep_held_in is not None:
            try:
                self.runner.copy_prefix(placement.slot, placement.keep_held_in, len(self.prefix_cache.held(placement.slot)))
                self.prefix_cache.moved(placement.slot, placement.keep_held_in)
            except Exception:  # the history is lost, as without the move
                self.prefix_cache.forget(placement.keep_held_in)
        self.prefix_cache.take(placement.slot)
        if placement.copy_from is not None:
            try:
                self.runner.copy_prefix(placement.copy_from, placement.slot, cached)
            except Exception:  # computing the prefix instead is slower, and as good
                cached = 0
        sequence.slot = placement.slot
        sequence.prefilled = sequence.written = sequence.cached_tokens = cached
        self.counts.cached_tokens += cached
        with self.wakeup:  # from the queue to its slot at once: a request arriving never sees its client gone
            self.waiting.remove(sequence)
            self.slots[sequence.slot] = sequence
        sequence.channel.events.put(Admitted(cached))
        self._admitted(sequence)

    def is_running(self, sequence: Sequence) -> bool:
        """Whether the request still holds its slot."""
        return self.slots[sequence.slot] is sequence

    def free(self, slot: int, reason: str, message: str = "", failure: str = "") -> None:
        """Ends slot's request; the slot keeps what it wrote for later prompts, unless the request failed."""
        sequence = self.slots[slot]
        with self.wakeup:  # its service goes to its client's counter as it leaves its slot, both at once
            self.slots[slot] = None
            if sequence is not None:
                self.served[sequence.client] = self.served.get(sequence.client, 0) + service(sequence)
        if sequence is not None:
            if reason == "error":
                self.prefix_cache.forget(slot)
            else:
                self.prefix_cache.release(slot, sequence.written_tokens)
            sequence.finish(reason, message, failure)

    def free_all(self, reason: str, message: str = "", failure: str = "") -> None:
        """Ends every running request."""
        for slot in range(len(self.slots)):
            self.free(slot, reason, message, failure)
