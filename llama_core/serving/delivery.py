"""Delivery: sampled tokens handed to their requests' channels, and a request ended where its reply does
(a cancel, end of sequence, a stop string, its grammar's end or its token limit)."""

from __future__ import annotations

from typing import Optional

import torch

from .events import StreamChunk
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import EngineCounts, Sequence


class Delivery:
    """Hands each request its tokens, ending it (and freeing its slot) where its reply ends."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, end_ids: frozenset[int], max_seq_len: int,
                 counts: EngineCounts) -> None:
        """end_ids: the tokens that end a reply as EOS does (the tokenizer's EOS and generation_config.json's);
        counts: the engine's, whose generated_tokens each token handed over adds to."""
        self.scheduler = scheduler
        self.sampler = sampler
        self.end_ids = end_ids
        self.max_seq_len = max_seq_len
        self.counts = counts

    def deliver(self, sequences: list[Sequence], next_tokens: torch.Tensor, logprobs: torch.Tensor,
                alternatives: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Hands each request its row of a step's sampled tokens (see Sampler.sample)."""
        self.sampler.count(sequences, next_tokens)
        if alternatives is not None:
            alternatives = tuple(t.tolist() for t in alternatives)
        for i, (sequence, token, logprob) in enumerate(zip(sequences, next_tokens.tolist(), logprobs.tolist())):
            self.deliver_token(sequence, token, logprob, None if alternatives is None else
                               (alternatives[0][i], alternatives[1][i]))

    def deliver_token(self, sequence: Sequence, token: int, logprob: float,
                      alternatives: Optional[tuple[list[float], list[int]]]) -> bool:
        """Hands a request its next token (alternatives: the most likely ones' log-probabilities and ids),
        or ends it at a cancel, an end id (EOS), a stop string or its token limit; whether it goes on."""
        free = self.scheduler.free
        if sequence.channel.cancelled.is_set():
            free(sequence.slot, "cancelled")
            return False
        if token in self.end_ids:
            if sequence.grammar is not None and not sequence.grammar.accepting:  # drawn as nothing else could be
                free(sequence.slot, "error", sequence.grammar.dead_end, failure="grammar")
            else:
                free(sequence.slot, "eos")
            return False
        if sequence.grammar is not None and not sequence.grammar.accept(token):
            free(sequence.slot, "error", f"the reply left its grammar: {sequence.grammar.error}", failure="grammar")
            return False
        sequence.output.append(token)
        sequence.last_token = token
        self.counts.generated_tokens += 1
        if sequence.lookup is not None:
            sequence.lookup.extend((token,))
        top = None
        if sequence.params.top_logprobs:
            n = sequence.params.top_logprobs
            top = list(zip(alternatives[1][:n], alternatives[0][:n]))
        sequence.channel.events.put(StreamChunk(token, logprob, top_logprobs=top))
        if sequence.stop_text is not None and sequence.reaches_stop(token):
            free(sequence.slot, "stop")
        elif sequence.grammar is not None and sequence.grammar.complete:  # only the end of sequence may follow
            free(sequence.slot, "eos")
        elif sequence.generated >= sequence.token_limit(self.max_seq_len):
            free(sequence.slot, "length")
        else:
            return True
        return False
