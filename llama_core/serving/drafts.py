"""Prompt-lookup drafting inside the engine: which tokens a decode step drafts for each request (see lookup),
and the step that feeds them with its last token and keeps those the model's own draws confirm."""

from __future__ import annotations

import time

import torch

from ..runner import ModelRunner, cache_rows, right_padded
from .delivery import Delivery
from .grammar_matcher import allowed_along_drafts
from .lookup import DraftPrice, PromptLookup
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import EngineCounts, Sequence, failure_message

# A step drafts only while it feeds at most this many rows in all: the CPU kernels read the weights for up to
# 8 rows at about one's cost with AVX-512, and a batch of more sequences than half of this already uses what
# drafts would.
DRAFT_ROWS = 6
# What a drafted token adds to a step's time, as a share of a one-token step, until the engine has timed its
# own forwards (docs/benchmarks.md, "Prompt-lookup decoding"): where DRAFT_ROWS rows are read as one, 0.05-0.15
# (the 7B's width in bf16, int8 and int4; the 110m shape); else (AVX2's tiles of 3 or 2 rows) more.
DRAFT_PRICE_ROWS_AS_ONE, DRAFT_PRICE_ROWS_APART = 0.1, 0.3


class Drafter:
    """Drafts tokens for decoding requests and verifies them in one forward."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, delivery: Delivery,
                 counts: EngineCounts, prompt_lookup: int, draft_price: DraftPrice) -> None:
        """prompt_lookup: the most tokens drafted for a request in one step; draft_price: what each costs."""
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.delivery = delivery
        self.counts = counts
        self.prompt_lookup = prompt_lookup
        self.draft_price = draft_price

    def drafts(self, active: list[Sequence]) -> list[list[int]]:
        """Each request's draft for this step (see lookup): none where the step would feed more than
        DRAFT_ROWS rows, or some request has penalties (each drafted token would change them). A request with a
        grammar drafts the tokens its grammar forces next, where it forces some (a JSON object's next key), else
        only the lookup's tokens its grammar would accept."""
        longest = min(self.prompt_lookup, DRAFT_ROWS // len(active) - 1)
        if longest < 1 or any(s.params.penalized for s in active):
            return [[] for _ in active]
        drafts, price = [], self.draft_price.price
        for sequence in active:
            if sequence.lookup is None:
                prediction = sequence.request.prediction_tokens  # the caller's word: trusted more at first
                sequence.lookup = PromptLookup(sequence.prompt_tokens + tuple(sequence.output),
                                               accepted=4.0 if prediction else 1.0, prediction=prediction,
                                               reply_start=len(sequence.prompt_tokens))
            max_seq_len = self.runner.max_seq_len
            room = min(sequence.token_limit(max_seq_len) - sequence.generated - 1,  # tokens it may still have
                       max_seq_len - 1 - sequence.next_pos)  # positions its slot has
            if sequence.grammar is not None:
                forced = sequence.grammar.forced()[: min(longest, room)]
                if forced:  # the only way on: worth drafting whatever the lookup's estimate
                    drafts.append(forced)
                    continue
            draft = sequence.lookup.draft(min(longest, room), price)
            if sequence.grammar is not None:
                draft = draft[: sequence.grammar.valid_prefix(draft)]
            drafts.append(draft)
        return drafts

    @torch.inference_mode()
    def decode(self, active: list[Sequence], drafts: list[list[int]]) -> None:
        """One forward over each request's last token and its draft: a request keeps the drafted tokens
        that equal the model's own draws at their positions, and the draw after the last one kept."""
        device = self.runner.device
        width = 1 + max(len(draft) for draft in drafts)
        starts = [s.next_pos for s in active]
        try:
            tokens, positions, _ = right_padded([[s.last_token, *draft] for s, draft in zip(active, drafts)], 0,
                                                device, starts, self.runner.max_seq_len)
            kv_len = min(max(starts) + width, self.runner.max_seq_len)
            started = time.perf_counter()
            logits = self.runner.prefill(tokens, positions, cache_rows([s.slot for s in active], device), kv_len)
            if len(active) == 1 and device.type == "cpu":
                self.draft_price.record(width, time.perf_counter() - started)
            rows = [s for s in active for _ in range(width)]
            allowed = None
            if any(s.grammar for s in active):  # each position as its grammar stands after the draft before it
                allowed = allowed_along_drafts([s.grammar for s in active], drafts, width, logits.shape[-1])
            drawn, logprobs, alternatives = self.sampler.sample(rows, logits.flatten(0, 1),
                                                                list(range(width)) * len(active), allowed)
        except Exception as exc:
            for s in active:
                self.scheduler.free(s.slot, "error", failure_message(exc))
            return
        self.counts.steps += 1
        drawn, logprobs = drawn.tolist(), logprobs.tolist()
        if alternatives is not None:
            alternatives = tuple(t.tolist() for t in alternatives)
        for i, (sequence, draft) in enumerate(zip(active, drafts)):
            row = drawn[i * width : (i + 1) * width]
            kept = 0
            while kept < len(draft) and draft[kept] == row[kept]:
                kept += 1
            self.counts.drafted_tokens += len(draft)
            self.counts.accepted_tokens += kept
            sequence.drafted += len(draft)
            sequence.accepted += kept
            for j in range(kept + 1):
                sequence.written = starts[i] + j + 1
                at = i * width + j
                if not self.delivery.deliver_token(sequence, row[j], logprobs[at], None if alternatives is None else
                                                   (alternatives[0][at], alternatives[1][at])):
                    break
