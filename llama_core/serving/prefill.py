"""Prefill: computing admitted prompts into their slots' KV cache, those admitted together in one padded
forward and a long prompt a chunk per turn, and sampling each prompt's first token."""

from __future__ import annotations

import torch

from ..devices import to_device
from ..runner import ModelRunner, cache_rows, right_padded
from .delivery import Delivery
from .events import PromptLogprobs
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import EngineCounts, Sequence, failure_message


class Prefiller:
    """Prefills prompts into their slots; a request whose prefill fails ends alone, with the error."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, delivery: Delivery,
                 counts: EngineCounts, prefill_chunk: int, pad_id: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.delivery = delivery
        self.counts = counts
        self.prefill_chunk = prefill_chunk
        self.pad_id = pad_id

    def prompt_written(self, sequence: Sequence, end: int) -> None:
        """Its prompt's tokens up to `end` are now in its slot's KV cache."""
        self.counts.prefilled_tokens += end - sequence.prefilled
        sequence.prefilled = sequence.written = end

    def prefill_groups(self, groups: list[list[Sequence]]) -> None:
        """Prefills each group in one forward; a failing group is retried a request at a time, so that only
        the failing request fails."""
        for group in groups:
            try:
                self._prefill(group)
            except Exception as exc:  # one request's failure (e.g. out of memory) must not stop the engine
                if len(group) == 1:
                    self.scheduler.free(group[0].slot, "error", failure_message(exc))
                    continue
                for sequence in group:  # find the request that fails; the others go on
                    try:
                        self._prefill([sequence])
                    except Exception as exc:
                        self.scheduler.free(sequence.slot, "error", failure_message(exc))

    @torch.inference_mode()
    def _prefill(self, group: list[Sequence]) -> None:
        """Prefills what is not cached of each request's prompt into its slot, right-padded, and samples its
        first token."""
        device = self.runner.device
        tokens, positions, lengths, kv_len = self.padded_prompts(group)
        rows = cache_rows([s.slot for s in group], device)
        if group[0].request.prompt_logprobs:  # such a request is prefilled alone, all of its prompt
            all_logits = self.runner.prefill(tokens, positions, rows, kv_len)
            values, alternatives = self.sampler.prompt_scores(all_logits[0, :-1], tokens[0, 1:],
                                                              group[0].params.top_logprobs)
            group[0].channel.events.put(PromptLogprobs(values, alternatives))
            logits = all_logits[:, -1]
        else:
            logits = self.runner.prefill(tokens, positions, rows, kv_len, logit_index=lengths - 1)[:, 0]
        for sequence in group:
            self.prompt_written(sequence, len(sequence.prompt_tokens))
        self._sample_and_deliver(group, logits)

    def padded_prompts(self, group: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The uncomputed part of each prompt as one batch: tokens, positions and lengths as right_padded
        gives them, and the kv_len that covers every position."""
        starts = [s.prefilled for s in group]
        tokens, positions, lengths = right_padded([s.uncomputed for s in group], self.pad_id, self.runner.device,
                                                  starts, self.runner.max_seq_len)
        return tokens, positions, lengths, min(max(starts) + tokens.shape[1], self.runner.max_seq_len)

    @torch.inference_mode()
    def prefill_next_chunk(self, riders: list[Sequence]) -> None:
        """Prefills the next prefill_chunk tokens of the longest-waiting long prompt; after its last chunk,
        samples its first token."""
        pending = [s for s in self.scheduler.active if s.prefilling and s not in riders]
        if not pending:
            return
        sequence = min(pending, key=lambda s: s.arrival)
        start = sequence.prefilled
        chunk = sequence.prompt_tokens[start : start + self.prefill_chunk]
        end, last = start + len(chunk), start + len(chunk) == len(sequence.prompt_tokens)
        device = self.runner.device
        try:
            tokens = to_device([chunk], device)
            positions = torch.arange(start, end, device=device)[None]
            rows = slice(sequence.slot, sequence.slot + 1)
            if sequence.request.prompt_logprobs:
                logits = self.runner.prefill(tokens, positions, rows, end)[0]
                if sequence.carried_logits is not None:  # the previous chunk's last logits score this one's first
                    logits = torch.cat([sequence.carried_logits[None], logits])
                    targets = tokens[0]
                else:
                    targets = tokens[0, 1:]
                values, alternatives = self.sampler.prompt_scores(logits[:-1], targets, sequence.params.top_logprobs)
                sequence.prompt_lps += values
                sequence.prompt_alternatives += alternatives or []
                sequence.carried_logits = logits[-1]
                logits = logits[-1:]
            elif last:
                last_index = to_device([len(chunk) - 1], device)
                logits = self.runner.prefill(tokens, positions, rows, end, logit_index=last_index)[:, 0]
            else:  # only the cache matters; one row of logits is the least output to ask for
                self.runner.prefill(tokens, positions, rows, end, logit_index=to_device([0], device))
            self.prompt_written(sequence, end)
            if last:
                if sequence.request.prompt_logprobs:
                    sequence.channel.events.put(PromptLogprobs(
                        sequence.prompt_lps, sequence.prompt_alternatives if sequence.params.top_logprobs else None))
                    sequence.carried_logits = None
                self._sample_and_deliver([sequence], logits)
        except Exception as exc:  # e.g. out of memory: this request fails, the others go on
            self.scheduler.free(sequence.slot, "error", failure_message(exc))

    def _sample_and_deliver(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        self.delivery.deliver(sequences, *self.sampler.sample(sequences, logits))
