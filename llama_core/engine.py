"""Continuous batching: many concurrent requests share one model and one slot-based KV cache.

One background loop admits waiting requests into free cache slots (prefill), then runs a single
batched decode step for every active slot at its own position, samples each with its own
parameters, and retires finished or cancelled requests at once, freeing their slots. Prompts admitted
together are prefilled in one padded forward; a prompt longer than `prefill_chunk` is prefilled a chunk
per loop turn, between decode steps, so the other streams keep flowing.
"""

from __future__ import annotations

import atexit
import math
import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from .errors import InvalidRequestError, LlamaError, ServerBusyError
from .decode import right_padded
from .generation import Llama, StreamChunk
from .model import Span
from .sampling import sample, token_logprobs, validate_sampling

_DONE = object()
_PROMPT_LOGPROBS = object()


class RequestFailedError(LlamaError, RuntimeError):
    """A request failed inside the engine (e.g. out of memory); the engine keeps serving the others."""


@dataclass
class _Request:
    prompt_tokens: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    want_prompt_logprobs: bool = False
    want_logprobs: bool = True
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)  # set with the final event
    arrival: int = 0  # order of submission
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache
    generated: int = 0
    last_token: int = 0
    prompt_lps: list[float] = field(default_factory=list)  # chunked prefill with prompt_logprobs
    carried_logits: Optional[torch.Tensor] = None  # the previous chunk's last logits, scoring the next token

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_tokens)

    @property
    def next_pos(self) -> int:
        """Position the last sampled token is written at on the next decode step."""
        return len(self.prompt_tokens) + self.generated - 1


class TokenStream:
    """The tokens of one request, as they are produced. Iterate to receive `StreamChunk`s (text empty);
    iteration raises RequestFailedError if the request failed. Leaving the iteration early cancels it."""

    def __init__(self, request: _Request) -> None:
        self._request = request
        self.prompt_len = len(request.prompt_tokens)
        self.finish_reason: Optional[str] = None  # "eos", "length", "cancelled" or "error"
        self.prompt_logprobs: Optional[list[float]] = None  # with prompt_logprobs=True: tokens 1..n-1
        self.finished_at: Optional[float] = None  # time.perf_counter() when the engine ended the request

    def cancel(self) -> None:
        self._request.cancelled.set()

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunks in self.batches():
            yield from chunks

    def batches(self, seconds: float = 0.0) -> Iterator[list[StreamChunk]]:
        """The chunks in lists: whatever has arrived, waiting for at least one, and at most one list per
        `seconds` (the first at once). A reader that shows text a few times a second then wakes up that
        often, not once per token. When the request's end arrives with its last chunks, `finish_reason`
        is set before that last list is yielded."""
        events, next_at = self._request.events, 0.0
        try:
            while True:
                pause = next_at - time.monotonic()
                if pause > 0:
                    self._request.finished.wait(pause)  # tokens don't wake the reader; the end does
                items = [events.get()]
                while not events.empty():
                    items.append(events.get_nowait())
                next_at = time.monotonic() + seconds
                chunks, done = [], None
                for item in items:
                    if isinstance(item, StreamChunk):
                        chunks.append(item)
                    elif item[0] is _PROMPT_LOGPROBS:
                        self.prompt_logprobs = item[1]
                    else:
                        done = item
                        self.finish_reason, self.finished_at = item[1], item[3]
                if chunks:
                    yield chunks
                if done is not None:
                    if done[1] == "error":
                        raise RequestFailedError(done[2])
                    return
        finally:
            if self.finish_reason is None:
                self.cancel()


class Engine:
    """Serves requests from any thread on one `Llama`, batching them over its KV-cache slots.

    The engine takes the Llama's KV cache for itself while it runs: `Llama.generate` on the same object
    raises until `shutdown()`.
    """

    def __init__(self, llama: Llama, max_waiting: int = 64, prefill_chunk: int = 512,
                 after_turn: Optional[Callable[[], None]] = None) -> None:
        """max_waiting: requests queued beyond the busy slots before submit answers busy.
        prefill_chunk: a prompt longer than this is prefilled this many tokens at a time, a decode step of
        the other requests after each chunk, so one long prompt does not stall everyone's stream.
        after_turn: called by the loop after each turn (admissions, prefill, one decode step), once that
        turn's events are in their requests' queues, and once more at shutdown: a caller whose queues
        forward events elsewhere can send each turn's events together."""
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self._arrivals = itertools.count()
        self.llama = llama
        self.model = llama.model
        self.max_waiting = max_waiting
        self.eos_id = llama.tokenizer.eos_id
        self._slots: list[Optional[_Request]] = [None] * llama.max_batch_size
        self._waiting: collections.deque[_Request] = collections.deque()
        self._wakeup = threading.Condition()
        self._running = False
        self._thread: Optional[threading.Thread] = None
        self._after_turn = after_turn or (lambda: None)
        # Prompts admitted while others decode are prefilled in the decode step's forward, where the model
        # runs eagerly on one device of its own (not a compiled static step, offloaded or tensor-parallel).
        self._mixes = not llama.decode_step.static and not llama.model._forward_pre_hooks and _on_one_device(llama.model)
        self.steps = 0  # decode steps run, for tests and stats

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._running:
            return self
        if not self.llama.claim_cache(self):
            raise LlamaError("this Llama's KV cache is already in use by another engine or generation")
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)  # stop the loop before the interpreter tears torch down
        return self

    def shutdown(self) -> None:
        with self._wakeup:
            self._running = False
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for request in list(self._waiting) + [r for r in self._slots if r is not None]:
            self._finish(request, "cancelled")
        self._waiting.clear()
        self._slots = [None] * len(self._slots)
        self._after_turn()
        self.llama.release_cache(self)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- submitting ---------------------------------------------------------------------------
    def submit(
        self,
        prompt_tokens: list[int],
        max_new_tokens: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        prompt_logprobs: bool = False,
        logprobs: bool = True,
    ) -> TokenStream:
        """Queues a request; returns its token stream (with prompt_logprobs, also the log-probabilities of
        prompt tokens 1..n-1, set on the stream before its first token). Without logprobs, chunks carry NaN log-probabilities.

        Raises:
            InvalidRequestError / ContextLengthError: bad prompt or parameters.
            ServerBusyError: every slot is busy and the waiting queue is full.
        """
        request = self._checked_request(prompt_tokens, max_new_tokens, temperature, top_p, prompt_logprobs, logprobs)
        self._enqueue(request)
        return TokenStream(request)

    def _checked_request(self, prompt_tokens, max_new_tokens, temperature, top_p, prompt_logprobs, logprobs) -> _Request:
        """The request submit() queues, or InvalidRequestError / ContextLengthError for a bad one."""
        self.check_parameters(max_new_tokens, temperature, top_p)
        self.llama.check_request([prompt_tokens], max_new_tokens, temperature, top_p)
        return _Request(list(prompt_tokens), max_new_tokens, float(temperature), float(top_p),
                        bool(prompt_logprobs), bool(logprobs))

    def _enqueue(self, request: _Request) -> None:
        """Queues a checked request, or raises LlamaError (not running) or ServerBusyError."""
        request.arrival = next(self._arrivals)
        with self._wakeup:
            if not self._running:
                raise LlamaError("the engine is not running; call start() first")
            if len(self._waiting) >= self.max_waiting:
                raise ServerBusyError(
                    f"server busy: {len(self._slots)} requests running and {len(self._waiting)} waiting; try again shortly"
                )
            self._waiting.append(request)
            self._wakeup.notify()

    def check_parameters(self, max_new_tokens: int, temperature: float, top_p: float) -> None:
        """Raises InvalidRequestError for sampling parameters or a max_new_tokens this engine can't serve."""
        check_parameters(self.llama.max_seq_len, max_new_tokens, temperature, top_p)

    @property
    def active_count(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while self._running and not self._waiting and not any(self._slots):
                    self._wakeup.wait()
                if not self._running:
                    return
            try:
                self._retire_cancelled()
                riders = self._admit()
                self._prefill_next_chunk(riders)
                decoding = [r for r in self._slots if r is not None and not r.prefilling and r not in riders]
                if decoding:
                    self._decode_step(decoding, riders)
                elif riders:
                    self._prefill_groups([riders])
            except Exception as exc:  # a bug must fail the requests in flight, not hang them
                for slot, request in enumerate(self._slots):
                    if request is not None:
                        self._free(slot, "error", _failure_message(exc))
            self._after_turn()

    def _retire_cancelled(self) -> None:
        for slot, request in enumerate(self._slots):
            if request is not None and request.cancelled.is_set():
                self._free(slot, "cancelled")

    def _admit(self) -> list[_Request]:
        """Moves waiting requests into free slots and prefills them together (one padded forward), or, where
        the model allows and other requests are decoding, leaves them to ride along in this turn's decode
        step (one forward for both): returns those riders."""
        free_slots = [slot for slot, r in enumerate(self._slots) if r is None]
        admitted = []
        while free_slots:
            with self._wakeup:
                request = self._waiting.popleft() if self._waiting else None
            if request is None:
                break
            if request.cancelled.is_set():
                self._finish(request, "cancelled")
                continue
            request.slot = free_slots.pop(0)
            self._slots[request.slot] = request
            admitted.append(request)
        short = [r for r in admitted if len(r.prompt_tokens) <= self.prefill_chunk]  # longer: chunk by chunk
        together = [r for r in short if not r.want_prompt_logprobs]
        riders = []
        if together and self._mixes and any(r is not None and r not in admitted and not r.prefilling for r in self._slots):
            riders, together = together, []
        self._prefill_groups([[r] for r in short if r.want_prompt_logprobs] + ([together] if together else []))
        return riders

    def _prefill_groups(self, groups: list[list[_Request]]) -> None:
        """Prefills each group in one forward; a failing group is retried a request at a time, so that only
        the failing request fails."""
        for group in groups:
            try:
                self._prefill(group)
            except Exception as exc:  # one request's failure (e.g. out of memory) must not stop the engine
                if len(group) == 1:
                    self._free(group[0].slot, "error", _failure_message(exc))
                    continue
                for request in group:  # find the request that fails; the others go on
                    try:
                        self._prefill([request])
                    except Exception as exc:
                        self._free(request.slot, "error", _failure_message(exc))

    @torch.inference_mode()
    def _prefill(self, group: list[_Request]) -> None:
        """Prefills each request's prompt into its slot, right-padded, and samples its first token."""
        device = self.llama.device
        tokens, positions, lengths = right_padded([r.prompt_tokens for r in group], self.eos_id, device)
        longest = tokens.shape[1]
        rows = _cache_rows([r.slot for r in group], device)
        if group[0].want_prompt_logprobs:  # such a request is prefilled alone
            all_logits = self.model(tokens, positions, cache_rows=rows, kv_len=longest)
            group[0].events.put((_PROMPT_LOGPROBS, token_logprobs(all_logits[0, :-1], tokens[0, 1:]).tolist()))
            logits = all_logits[:, -1]
        else:
            logits = self.model(tokens, positions, cache_rows=rows, kv_len=longest, logit_index=lengths - 1)[:, 0]
        for request in group:
            request.prefilled = len(request.prompt_tokens)
        self._sample_first_tokens(group, logits)

    def _sample_first_tokens(self, group: list[_Request], logits: torch.Tensor) -> None:
        device = self.llama.device
        temperature = torch.tensor([r.temperature for r in group], device=device)
        top_p = torch.tensor([r.top_p for r in group], device=device)
        next_tokens = sample(logits, temperature, top_p, self.llama.generator)
        self._deliver(group, next_tokens, token_logprobs(logits, next_tokens))

    @torch.inference_mode()
    def _prefill_next_chunk(self, riders: list[_Request]) -> None:
        """Prefills the next prefill_chunk tokens of the longest-waiting long prompt; after its last chunk,
        samples its first token."""
        pending = [r for r in self._slots if r is not None and r.prefilling and r not in riders]
        if not pending:
            return
        request = min(pending, key=lambda r: r.arrival)
        start = request.prefilled
        chunk = request.prompt_tokens[start : start + self.prefill_chunk]
        end, last = start + len(chunk), start + len(chunk) == len(request.prompt_tokens)
        device = self.llama.device
        try:
            tokens = torch.tensor([chunk], device=device)
            positions = torch.arange(start, end, device=device)[None]
            rows = slice(request.slot, request.slot + 1)
            if request.want_prompt_logprobs:
                logits = self.model(tokens, positions, cache_rows=rows, kv_len=end)[0]
                if request.carried_logits is not None:
                    request.prompt_lps.append(float(token_logprobs(request.carried_logits, tokens[0, 0])))
                request.prompt_lps += token_logprobs(logits[:-1], tokens[0, 1:]).tolist()
                request.carried_logits = logits[-1]
                logits = logits[-1:]
            elif last:
                last_index = torch.tensor([len(chunk) - 1], device=device)
                logits = self.model(tokens, positions, cache_rows=rows, kv_len=end, logit_index=last_index)[:, 0]
            else:  # only the cache matters; one row of logits is the least output to ask for
                self.model(tokens, positions, cache_rows=rows, kv_len=end, logit_index=torch.tensor([0], device=device))
            request.prefilled = end
            if last:
                if request.want_prompt_logprobs:
                    request.events.put((_PROMPT_LOGPROBS, request.prompt_lps))
                    request.carried_logits = None
                self._sample_first_tokens([request], logits)
        except Exception as exc:  # e.g. out of memory: this request fails, the others go on
            self._free(request.slot, "error", _failure_message(exc))

    @torch.inference_mode()
    def _decode_step(self, active: list[_Request], riders: list[_Request]) -> None:
        """One new token for each active request; riders (just admitted) are prefilled in the same forward
        and get their first token. If that forward fails, the riders are prefilled on their own and the
        step is retried without them."""
        device = self.llama.device
        try:
            tokens = torch.tensor([r.last_token for r in active], dtype=torch.long, device=device)
            next_positions = [r.next_pos for r in active]
            positions = torch.tensor(next_positions, device=device)
            rows = _cache_rows([r.slot for r in active], device)
            kv_len = max(next_positions) + 1
            if riders:
                prompt_tokens, prompt_positions, lengths = right_padded([r.prompt_tokens for r in riders], self.eos_id, device)
                logits = torch.cat(self.model.forward_spans([
                    Span(tokens[:, None], positions[:, None], rows, kv_len, torch.zeros_like(positions)),
                    Span(prompt_tokens, prompt_positions, _cache_rows([r.slot for r in riders], device),
                         prompt_tokens.shape[1], lengths - 1),
                ]))
            else:
                logits = self.llama.decode_step(tokens, positions, rows, kv_len=kv_len)
            requests = active + riders
            temperature = torch.tensor([r.temperature for r in requests], device=device)
            top_p = torch.tensor([r.top_p for r in requests], device=device)
            next_tokens = sample(logits, temperature, top_p, self.llama.generator)
            if any(r.want_logprobs for r in requests):
                logprobs = token_logprobs(logits, next_tokens)
            else:
                logprobs = torch.full_like(logits[:, 0], math.nan)
        except Exception as exc:
            if riders:
                self._prefill_groups([riders])
                self._decode_step(active, [])
                return
            for r in active:
                self._free(r.slot, "error", _failure_message(exc))
            return
        self.steps += 1
        for request in riders:
            request.prefilled = len(request.prompt_tokens)
        self._deliver(requests, next_tokens, logprobs)

    def _deliver(self, requests: list[_Request], next_tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        for request, token, logprob in zip(requests, next_tokens.tolist(), logprobs.tolist()):
            if request.cancelled.is_set():
                self._free(request.slot, "cancelled")
            elif token == self.eos_id:
                self._free(request.slot, "eos")
            else:
                request.generated += 1
                request.last_token = token
                request.events.put(StreamChunk(token, logprob, ""))
                room = self.llama.max_seq_len - len(request.prompt_tokens)
                if request.generated >= min(request.max_new_tokens, room):
                    self._free(request.slot, "length")

    def _free(self, slot: int, reason: str, message: str = "") -> None:
        request = self._slots[slot]
        self._slots[slot] = None
        if request is not None:
            self._finish(request, reason, message)

    @staticmethod
    def _finish(request: _Request, reason: str, message: str = "") -> None:
        request.events.put((_DONE, reason, message, time.perf_counter()))
        request.finished.set()


def check_parameters(max_seq_len: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Raises InvalidRequestError for sampling parameters or a max_new_tokens a max_seq_len context can't serve."""
    validate_sampling(temperature, top_p)
    limit = max_seq_len - 1
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= limit:
        raise InvalidRequestError(
            f"max_new_tokens must be an integer from 1 to {limit} (the context is {max_seq_len} tokens), "
            f"got {max_new_tokens!r}"
        )


def _cache_rows(slots: list[int], device: torch.device) -> torch.Tensor | slice:
    """The KV-cache rows of these slots: a slice when they are consecutive (the cache is then read through
    views, not gathered), else an index tensor."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)


def _on_one_device(model: torch.nn.Module) -> bool:
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    return len(devices) == 1 and next(iter(devices)).type != "meta"


def _failure_message(exc: Exception) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "the request ran out of device memory; try a shorter prompt or fewer new tokens"
    return f"generation failed: {type(exc).__name__}: {exc}"
