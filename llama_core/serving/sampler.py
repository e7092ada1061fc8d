"""Sampling inside the engine: each row's next token drawn with its request's own parameters (penalties,
logit bias, grammar, temperature, top-p/top-k/min-p, seed), its log-probabilities, and the per-slot token
counts that penalties read."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..devices import to_device
from ..sampling import apply_penalties, greedy_tokens, sample, token_logprobs, top_logprobs
from .grammar_matcher import allowed_tokens
from .sequence import Sequence


class Sampler:
    """Draws the engine's tokens; holds, for the slots of requests with penalties, the tokens seen so far."""

    def __init__(self, words: int, vocab_size: int, slots: int, device: torch.device) -> None:
        """words: the tokenizer's words (a padded vocabulary's rows past them are never drawn); vocab_size:
        the model's logits' width; slots: the KV cache's slots."""
        self.words = words
        self.vocab_size = vocab_size
        self.slots = slots
        self.device = device
        self._seen: Optional[torch.Tensor] = None  # [slots, vocab] prompt and output tokens, for penalties
        self._counts: Optional[torch.Tensor] = None  # [slots, vocab] how often each token was generated

    def sample(self, sequences: list[Sequence], logits: torch.Tensor, ahead: int | list[int] = 0,
               allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple]]:
        """Each row's next token, drawn with its request's parameters; its log-probability under the model
        (NaN where no request of the batch asked for them); and, where some request asked for them, the
        model's most likely alternatives (log-probabilities, token ids). ahead: tokens each row (or every
        row) has sampled or drafted beyond those delivered (a seeded draw depends on the token's index).
        allowed: [rows, vocab] the tokens each row may draw; None: as the requests' grammars allow now."""
        device = self.device
        params = [s.params for s in sequences]
        aheads = ahead if isinstance(ahead, list) else [ahead] * len(sequences)
        raw_logits = logits = self.in_words(logits)
        if any(p.penalized for p in params):
            logits = self._penalized(sequences, logits)
        if any(p.logit_bias for p in params):  # only the biased tokens' logits move: no [rows, vocab] from the host
            pairs = [(row, token, amount) for row, p in enumerate(params) for token, amount in p.logit_bias]
            rows, tokens, amounts = zip(*pairs)
            logits = logits.index_put((to_device(rows, device, torch.long), to_device(tokens, device, torch.long)),
                                      to_device(amounts, device, logits.dtype), accumulate=True)
        if allowed is None and any(s.grammar for s in sequences):
            allowed = allowed_tokens([s.grammar for s in sequences], logits.shape[-1])
        if allowed is not None:  # what would break a request's grammar is never drawn
            logits = torch.where(to_device(allowed, device), logits, -math.inf)
        temperatures = [p.temperature for p in params]
        if not any(temperatures):  # all greedy: no softmax, no draw
            next_tokens = greedy_tokens(logits)
        else:
            def column(values):
                return to_device(values, device) if any(v != values[0] for v in values) else values[0]

            next_tokens = sample(
                logits, column(temperatures), column([p.top_p for p in params]),
                to_device([s.seed for s in sequences], device),
                to_device([s.generated + a for s, a in zip(sequences, aheads)], device),
                top_k=column([p.top_k for p in params]), min_p=column([p.min_p for p in params]),
            )
        if any(p.logprobs for p in params):
            logprobs = token_logprobs(raw_logits, next_tokens)
        else:
            logprobs = torch.full_like(raw_logits[:, 0], math.nan)
        most = max(p.top_logprobs for p in params)
        return next_tokens, logprobs, top_logprobs(raw_logits, most) if most else None

    def in_words(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., vocab] with a padded vocabulary's tokens past the tokenizer's words at -inf: never drawn
        or listed (they have no text), and out of the log-probabilities; others unchanged."""
        if logits.shape[-1] <= self.words:
            return logits
        masked = logits.clone()
        masked[..., self.words :] = -math.inf
        return masked

    def prompt_scores(self, logits: torch.Tensor, tokens: torch.Tensor,
                      top: int) -> tuple[list[float], Optional[list]]:
        """The log-probabilities of tokens [N] under logits [N, V], and with top > 0 each row's top most likely
        tokens as (token id, log-probability) pairs (None with top 0)."""
        logits = self.in_words(logits)
        values = token_logprobs(logits, tokens).tolist()
        if not top:
            return values, None
        lps, ids = top_logprobs(logits, top)
        return values, [list(zip(row_ids, row_lps)) for row_ids, row_lps in zip(ids.tolist(), lps.tolist())]

    def watch(self, sequence: Sequence) -> None:
        """Starts counting a newly admitted request's tokens in its slot, where its penalties need them."""
        if not sequence.params.penalized:
            return
        if self._seen is None:
            shape = (self.slots, self.vocab_size)
            self._seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self._seen[sequence.slot] = False
        self._seen[sequence.slot, to_device(sequence.prompt_tokens, self.device)] = True
        self._counts[sequence.slot] = 0

    def count(self, sequences: list[Sequence], next_tokens: torch.Tensor) -> None:
        """Counts each request's new token where its penalties need it: it counts from the next step on."""
        penalized = [i for i, s in enumerate(sequences) if s.params.penalized]
        if penalized:
            rows = to_device([sequences[i].slot for i in penalized], self.device)
            picked = next_tokens[penalized]
            self._counts[rows, picked] += 1
            self._seen[rows, picked] = True

    def _penalized(self, sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        device = self.device
        rows = to_device([s.slot for s in sequences], device)

        def column(name: str) -> torch.Tensor:
            return to_device([[getattr(s.params, name)] for s in sequences], device)

        return apply_penalties(logits, self._seen[rows], self._counts[rows], column("repetition_penalty"),
                               column("presence_penalty"), column("frequency_penalty"))
