"""A request inside the engine (a Sequence): its slot, how much of its prompt and reply the KV cache holds,
what its sampling follows, and how it ends; and the engine's counts of that work (EngineCounts)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..tokenizer import StreamDecoder
from .events import Channel, Finished
from .grammar_matcher import GrammarMatcher
from .lookup import PromptLookup
from .requests import GenerationRequest, SamplingParams
from .stops import StopMatcher


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: where it is in its slot."""

    request: GenerationRequest
    channel: Channel
    seed: int = 0  # the request's own, or one the engine drew for it
    arrival: int = 0  # order of submission
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache
    written: int = 0  # positions of its slot's KV cache holding its tokens (prompt, then output)
    cached_tokens: int = 0  # prompt tokens found in the KV cache, not computed
    output: list[int] = field(default_factory=list)  # generated tokens, EOS left out
    last_token: int = 0
    prompt_lps: list[float] = field(default_factory=list)  # chunked prefill with prompt_logprobs
    prompt_alternatives: list[list[tuple[int, float]]] = field(default_factory=list)  # and with top_logprobs
    carried_logits: Optional[torch.Tensor] = None  # the previous chunk's last logits, scoring the next token
    stop_text: Optional[tuple[StreamDecoder, StopMatcher]] = None  # the reply's text, watched for stop strings
    grammar: Optional[GrammarMatcher] = None  # where the reply is in the grammar it must match
    lookup: Optional[PromptLookup] = None  # its tokens, for drafts (prompt lookup), from its first decode step
    drafted: int = 0  # tokens drafted for it and checked
    accepted: int = 0  # of those, the ones kept

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return self.request.prompt_tokens

    @property
    def client(self) -> Optional[str]:
        return self.request.client

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_tokens)

    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def uncomputed(self) -> tuple[int, ...]:
        """Its prompt tokens not yet in the KV cache."""
        return self.prompt_tokens[self.prefilled :]

    @property
    def written_tokens(self) -> tuple[int, ...]:
        """The token ids whose keys and values its slot holds, at positions 0, 1, ..."""
        if self.written <= len(self.prompt_tokens):
            return self.prompt_tokens[: self.written]
        return (self.prompt_tokens + tuple(self.output))[: self.written]

    @property
    def next_pos(self) -> int:
        """Position the last sampled token is written at on the next decode step."""
        return len(self.request.prompt_tokens) + self.generated - 1

    def token_limit(self, max_seq_len: int) -> int:
        """The most tokens the request may generate: its max_new_tokens, or what its slot has room for."""
        return min(self.request.max_new_tokens, max_seq_len - len(self.prompt_tokens))

    def reaches_stop(self, token: int) -> bool:
        """Feeds its next token's text to its stop strings' matcher; whether one is now complete."""
        decoder, matcher = self.stop_text
        matcher.feed(decoder.push(token))
        return matcher.stopped

    def finish(self, reason: str, message: str = "", failure: str = "") -> None:
        """Ends the request: its reader gets Finished(reason, ...)."""
        self.channel.events.put(Finished(reason, message, time.perf_counter(), self.drafted, self.accepted, failure))
        self.channel.finished.set()


@dataclass
class EngineCounts:
    """What an engine has done so far, for tests and stats."""

    steps: int = 0  # decode steps run
    prefilled_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens found in the KV cache instead
    generated_tokens: int = 0  # tokens handed to requests as their replies (EOS left out)
    drafted_tokens: int = 0  # tokens drafted by prompt lookup and verified
    accepted_tokens: int = 0  # of those, the ones kept

STOPPING = "the server is stopping"  # why a draining engine refuses requests, and ends those left at its end


def failure_message(exc: BaseException) -> str:
    """What a request that failed with exc is told."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "the request ran out of device memory; try a shorter prompt or fewer new tokens"
    if _tensor_parallel_failure(exc):  # not the request's fault, nor one that sending it again would mend
        return f"a tensor-parallel process failed; {STOPPING}"
    return f"generation failed: {type(exc).__name__}: {exc}"


def _tensor_parallel_failure(exc: BaseException) -> bool:
    """Whether exc is a collective of the tensor-parallel group failing (a process of it ended): raised as
    llama_core.distributed.parallel.TensorParallelError, only where that module runs the group."""
    parallel = sys.modules.get(__package__.rpartition(".")[0] + ".distributed.parallel")
    return parallel is not None and isinstance(exc, parallel.TensorParallelError)
