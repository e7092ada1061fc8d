"""Decoding: one batched step for every decoding request at its own position (with just-admitted prompts
riding along where the model allows, or prompt-lookup drafts), and, with overlap, the pipeline that
delivers a step a turn late (see engine's docstring)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..devices import to_device
from ..model import Span
from ..runner import ModelRunner, cache_rows
from .delivery import Delivery
from .drafts import Drafter
from .prefill import Prefiller
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import EngineCounts, Sequence, failure_message


@dataclass(eq=False)
class InFlightStep:
    """A decode step launched whose tokens are not delivered yet (see the engine's docstring)."""

    sequences: list[Sequence]
    positions: list[int]  # where each row's input token was written
    next_tokens: torch.Tensor  # on the device: the next step's input
    host: tuple  # (tokens, logprobs, alternatives or None) on their way to the host
    ready: Optional[torch.cuda.Event]  # recorded after those copies; None where they are the device's own


class Decoder:
    """Runs decode steps and holds the one in flight, if any."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, delivery: Delivery,
                 prefiller: Prefiller, drafter: Drafter, counts: EngineCounts, overlap: bool) -> None:
        """overlap: leave a step in flight where it may be, delivering it after launching the next."""
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.delivery = delivery
        self.prefiller = prefiller
        self.drafter = drafter
        self.counts = counts
        self.overlap = overlap
        self.in_flight: Optional[InFlightStep] = None

    def continue_decoding(self) -> bool:
        """With a decode step in flight and nothing else to do (no request to admit, no prompt to prefill,
        none cancelled): launches the next step from the in-flight one's tokens on the device, for the rows
        with room for another token, then delivers the in-flight step. Otherwise delivers the in-flight step
        and returns False: the turn goes on as without one."""
        step, self.in_flight = self.in_flight, None
        sequences = step.sequences
        slots = self.scheduler.slots
        busy = sum(s is not None for s in slots)
        if ((self.scheduler.waiting and busy < len(slots)) or busy != len(sequences)
                or any(s.channel.cancelled.is_set() for s in sequences)):
            self._land(step)
            return False
        going_on = [i for i, s in enumerate(sequences) if s.generated + 1 < s.token_limit(self.runner.max_seq_len)]
        if going_on:
            tokens = step.next_tokens
            if len(going_on) < len(sequences):
                tokens = tokens[to_device(going_on, tokens.device)]
            self.step([sequences[i] for i in going_on], [], tokens, ahead=1)
        self._land(step)
        return True

    def _land(self, step: InFlightStep) -> None:
        """Delivers an in-flight step's tokens to those of its requests still in their slots."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens, logprobs, alternatives = step.host
        live = [i for i, s in enumerate(step.sequences) if self.scheduler.is_running(s)]
        if len(live) < len(step.sequences):
            tokens, logprobs = tokens[live], logprobs[live]
            alternatives = None if alternatives is None else tuple(t[live] for t in alternatives)
        for i in live:
            step.sequences[i].written = step.positions[i] + 1
        self.delivery.deliver([step.sequences[i] for i in live], tokens, logprobs, alternatives)

    @torch.inference_mode()
    def step(self, active: list[Sequence], riders: list[Sequence], tokens: Optional[torch.Tensor] = None,
             ahead: int = 0) -> None:
        """One new token for each active request; riders (just admitted) are prefilled in the same forward
        and get their first token. If that forward fails, the riders are prefilled on their own and the
        step is retried without them. With overlap and no riders or penalties, the step stays in flight
        (delivered by the next turn). tokens: the rows' input tokens on the device, where the in-flight
        step has them; ahead: tokens sampled for each row but not delivered yet (0 or 1)."""
        prompt_lookup = self.drafter.prompt_lookup
        if tokens is None and not riders and prompt_lookup:
            drafts = self.drafter.drafts(active)
            if any(drafts):
                self.drafter.decode(active, drafts)
                return
        device = self.runner.device
        timed = prompt_lookup and tokens is None and not riders and len(active) == 1 and device.type == "cpu"
        try:
            if tokens is None:
                tokens = to_device([s.last_token for s in active], device, torch.long)
            next_positions = [s.next_pos + ahead for s in active]
            positions = to_device(next_positions, device)
            slots = [s.slot for s in active]
            rows = cache_rows(slots, device)
            kv_len = max(next_positions) + 1
            if riders:
                prompt_tokens, prompt_positions, lengths, prompt_kv_len = self.prefiller.padded_prompts(riders)
                logits = torch.cat(self.runner.forward_spans([
                    Span(tokens[:, None], positions[:, None], rows, kv_len, torch.zeros_like(positions)),
                    Span(prompt_tokens, prompt_positions, cache_rows([s.slot for s in riders], device),
                         prompt_kv_len, lengths - 1),
                ]))
            else:
                started = time.perf_counter()
                logits = self.runner.decode(tokens, positions, rows, kv_len=kv_len, rows_end=max(slots) + 1)
                if timed:  # the forward alone, as Drafter.decode times it (on the CPU it has run by now)
                    self.drafter.draft_price.record(1, time.perf_counter() - started)
            sequences = active + riders
            sampled = self.sampler.sample(sequences, logits, ahead)
        except Exception as exc:
            if riders:
                self.prefiller.prefill_groups([riders])
                self.step(active, [])
                return
            for s in active:
                self.scheduler.free(s.slot, "error", failure_message(exc))
            return
        self.counts.steps += 1
        if self.overlap and not riders and not any(s.params.penalized or s.grammar for s in active):
            self.in_flight = InFlightStep(active, next_positions, sampled[0], *copied_to_host(sampled))
            return
        for sequence, position in zip(active, next_positions):
            sequence.written = position + 1
        for sequence in riders:
            self.prefiller.prompt_written(sequence, len(sequence.prompt_tokens))
        self.delivery.deliver(sequences, *sampled)


def copied_to_host(sampled: tuple) -> tuple[tuple, Optional[torch.cuda.Event]]:
    """A step's (tokens, logprobs, alternatives) on their way to pinned host memory, and the event that
    marks their arrival; on the CPU, themselves and None."""
    tokens, logprobs, alternatives = sampled
    if tokens.device.type != "cuda":
        return sampled, None

    def copied(tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    host = (copied(tokens), copied(logprobs), None if alternatives is None else tuple(map(copied, alternatives)))
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tokens.device))  # the copies' stream: the device's, not the current device's
    return host, ready
