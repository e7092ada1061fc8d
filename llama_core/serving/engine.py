"""Continuous batching: many concurrent requests share one model and one slot-based KV cache.

Each turn admits waiting requests into free cache slots (prefill), runs a single batched decode step for
every active slot at its own position, samples each with its own parameters, and retires finished or
cancelled requests at once, freeing their slots. Prompts admitted together are prefilled in one padded
forward; a prompt longer than `prefill_chunk` is prefilled a chunk per turn, between decode steps, so
the other streams keep flowing. With prefix caching (the default) a slot keeps what its request computed,
and a new prompt computes only what follows the longest prefix of it that a slot holds (see prefix_cache).

With prompt lookup (the default on llama_core's CPU kernels), a decode step may feed a sequence its last
token and a draft of the tokens likely to follow it, copied from its own earlier text (see lookup); it keeps
the drafted tokens that the model's own draws confirm, so a reply is the same, in fewer steps.

Turns run in the engine's own thread once `start()`ed (a server), or else in the thread of whoever reads
a stream (the `Llama` facade's generate): one loop either way.

On CUDA a decode step's tokens are delivered a turn late: a turn with nothing else to do launches the next
step from the in-flight step's tokens, still on the device, and only then waits for the in-flight step's
copy to the host, so the host's bookkeeping runs while the device computes and the loop never waits for
the device with nothing queued. A request that ends at a token it could not foresee (end of sequence, a stop
string, a cancel) has had one more token computed, which is dropped.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..cpu_kernels import threads as cpu_threads
from ..devices import to_device
from ..errors import EngineUnavailableError, LlamaError, InvalidRequestError, ServerBusyError
from .grammar_matcher import GrammarMatcher, allowed_along_drafts, allowed_tokens
from ..loader import LoadedModel, ModelInfo
from ..model import Span
from ..runner import cache_rows, right_padded
from ..sampling import apply_penalties, greedy_tokens, sample, token_logprobs, top_logprobs
from ..tokenizer import StreamDecoder, Tokenizer
from .events import Admitted, Channel, Finished, PromptLogprobs, StreamChunk
from .lookup import DraftPrice, PromptLookup
from .prefix_cache import Placement, PrefixCache
from .requests import MAX_SEED, GenerationRequest, SamplingParams, sampling_params
from .stops import StopMatcher
from .streams import TokenStream

STOPPING = "the server is stopping"  # why a draining engine refuses requests, and ends those left at its end


CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK = 512, 2048  # Engine's default prefill_chunk
CPU_PROMPT_LOOKUP = 5  # Engine's default prompt_lookup on the CPU kernels (off elsewhere)
# A step drafts only while it feeds at most this many rows in all: the CPU kernels read the weights for up to
# 8 rows at about one's cost with AVX-512, and a batch of more sequences than half of this already uses what
# drafts would.
DRAFT_ROWS = 6
# What a drafted token adds to a step's time, as a share of a one-token step, until the engine has timed its
# own forwards (docs/benchmarks.md, "Prompt-lookup decoding"): where DRAFT_ROWS rows are read as one, 0.05-0.15
# (the 7B's width in bf16, int8 and int4; the 110m shape); else (AVX2's tiles of 3 or 2 rows) more.
DRAFT_PRICE_ROWS_AS_ONE, DRAFT_PRICE_ROWS_APART = 0.1, 0.3


@dataclass(eq=False)
class _InFlight:
    """A decode step launched whose tokens are not delivered yet (see the module's docstring)."""

    sequences: list["_Sequence"]
    positions: list[int]  # where each row's input token was written
    next_tokens: torch.Tensor  # on the device: the next step's input
    host: tuple  # (tokens, logprobs, alternatives or None) on their way to the host
    ready: Optional[torch.cuda.Event]  # recorded after those copies; None where they are the device's own


@dataclass(eq=False)
class _Sequence:
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


class Engine:
    """Serves requests from any thread on one loaded model, batching them over its KV-cache slots.

    The engine owns the model's KV cache from construction until `close()`. Running the model directly
    meanwhile (`model(tokens)` writes cache rows 0..B-1) makes it forget what its slots hold.
    """

    def __init__(self, model: LoadedModel, seed: Optional[int] = None, max_waiting: int = 64,
                 prefill_chunk: Optional[int] = None, after_turn: Optional[Callable[[], None]] = None,
                 prefix_caching: bool = True, overlap: Optional[bool] = None,
                 prompt_lookup: Optional[int] = None, draft_price: Optional[float] = None) -> None:
        """seed: seeds sampling; None draws a random seed.
        max_waiting: requests queued beyond the busy slots before submit answers busy.
        prefill_chunk: a prompt longer than this is prefilled this many tokens at a time, a decode step of
        the other requests after each chunk, so one long prompt does not stall everyone's stream; None:
        512 on the CPU, 2048 on CUDA (where a chunk of 512 already keeps the GPU's arithmetic busy, and each
        chunk reads every weight again).
        after_turn: called after each turn (admissions, prefill, one decode step), once that turn's events
        are in their channels, and once more at shutdown: a caller whose channels forward events elsewhere
        can send each turn's events together.
        prefix_caching: each slot keeps the keys and values its request computed, and a new prompt computes
        only what follows the longest prefix of it already computed (a chat's earlier turns, a shared system
        prompt); each stream's `cached_tokens` says how many tokens that saved. Requests asking for prompt
        log-probabilities compute their whole prompt.
        overlap: deliver decode steps a turn late, launching the next one first (see the module's docstring);
        None: on CUDA, where the device runs ahead of the host. On the CPU the model runs in the host's own
        thread, so there is nothing to overlap and each token would only come a step later.
        prompt_lookup: the most tokens a decode step drafts for a request from its own earlier text (or its
        prediction) and verifies in the same forward (see lookup); 0: none. None: CPU_PROMPT_LOOKUP where a
        row's logits do not depend on the forward it is in (llama_core's CPU kernels), else 0.
        draft_price: what each drafted token adds to a step's time, as a share of a one-token step's (0.1:
        a step feeding 5 drafted tokens takes 1.5 steps' time); it decides how far a request drafts at its
        recent acceptance. None: learned from this engine's own forwards. A fixed price drafts the same in
        every run.

        Raises:
            InvalidRequestError: a bad prefill_chunk, max_waiting, prefix_caching, overlap, prompt_lookup or
                draft_price.
            LlamaError: another engine owns this model's KV cache.
        """
        if prefill_chunk is None:
            prefill_chunk = GPU_PREFILL_CHUNK if model.runner.device.type == "cuda" else CPU_PREFILL_CHUNK
        if prompt_lookup is None:
            prompt_lookup = CPU_PROMPT_LOOKUP if model.runner.decodes_rows_alike else 0
        check_count("prefill_chunk", prefill_chunk, least=1)
        check_count("max_waiting", max_waiting)
        check_count("prompt_lookup", prompt_lookup)
        if draft_price is not None and (isinstance(draft_price, bool) or not isinstance(draft_price, (int, float))
                                        or not 0 <= draft_price < math.inf):
            raise InvalidRequestError(f"draft_price must be a number of 0 or more, got {draft_price!r}")
        for name, value in (("prefix_caching", prefix_caching), ("overlap", overlap)):
            if not isinstance(value, bool) and not (name == "overlap" and value is None):
                raise InvalidRequestError(f"{name} must be true or false, got {value!r}")
        self.loaded = model
        self.runner = model.runner
        if not self.runner.claim(self):
            raise LlamaError("this model's KV cache is in use by another engine: close() that one first")
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.eos_id = model.tokenizer.eos_id
        self.words = model.tokenizer.n_words  # a model's padded vocabulary may have more rows: never drawn
        self.generator = torch.Generator()  # draws a seed for each request that brings none
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._seen: Optional[torch.Tensor] = None  # [slots, vocab] prompt and output tokens, for penalties
        self._counts: Optional[torch.Tensor] = None  # [slots, vocab] how often each token was generated
        self._arrivals = itertools.count()
        self._slots: list[Optional[_Sequence]] = [None] * self.runner.max_batch_size
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._wakeup = threading.Condition()
        self._turn_lock = threading.Lock()  # one turn at a time, whichever thread runs it
        self._running = False
        self._closed = False
        self._draining = False
        self._lost = ""  # why the engine's thread stopped, where it failed
        self._thread: Optional[threading.Thread] = None
        self._after_turn = after_turn or (lambda: None)
        self.prefix_cache = PrefixCache(self.runner.max_batch_size, enabled=prefix_caching)
        self.prompt_lookup = prompt_lookup
        if draft_price is None:
            self.draft_price = DraftPrice(DRAFT_PRICE_ROWS_AS_ONE if self.runner.rows_read_as_one >= DRAFT_ROWS
                                          else DRAFT_PRICE_ROWS_APART)
        else:
            self.draft_price = DraftPrice(float(draft_price), fixed=True)
        self.overlap = self.runner.device.type == "cuda" and not prompt_lookup if overlap is None else overlap
        self._in_flight: Optional[_InFlight] = None
        self._cache_version: Optional[int] = None  # the KV cache's version after this engine's last turn
        self.steps = 0  # decode steps run, for tests and stats
        self.prefilled_tokens = 0  # prompt tokens computed
        self.cached_tokens = 0  # prompt tokens found in the KV cache instead
        self.drafted_tokens = 0  # tokens drafted by prompt lookup and verified
        self.accepted_tokens = 0  # of those, the ones kept

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def info(self) -> ModelInfo:
        return self.loaded.info

    @property
    def running(self) -> bool:
        """Whether the engine's own thread runs its turns (else readers of its streams do)."""
        return self._running

    @property
    def alive(self) -> bool:
        """Whether the engine takes requests: not closed, and its thread, once started, still runs."""
        return (not self._closed and not self._draining and not self._lost
                and (self._thread is None or self._thread.is_alive()))

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Runs turns in a thread of the engine's own until shutdown(). That thread first warms up the model's
        compiled step, if it has one (ModelRunner.warm_up: its CUDA graphs are the thread's own), and start()
        waits for it.

        Raises:
            LlamaError: the engine is closed.
            Exception: what warming the step up raised; the engine's thread has then stopped, and requests
                submitted meanwhile have ended with the error.
        """
        if self._closed:
            raise LlamaError("the engine is closed")
        self._draining = False
        if self._running:
            return self
        self._lost = ""
        self._running = True
        if self.runner.device.type == "cpu":  # the model's work moves to the engine's thread from here
            cpu_threads.release_workers()  # (a second pool of OpenMP workers would slow every step)
        warmed_up: Future = Future()
        self._thread = threading.Thread(target=self._loop, args=(warmed_up,), name="llama-engine", daemon=True)
        self._thread.start()
        try:
            warmed_up.result()
        except BaseException:  # its failure, or Ctrl-C while it compiles: the thread stops once warmed up
            with self._wakeup:
                self._running = False
                self._wakeup.notify_all()
            self._thread.join()
            self._thread = None
            raise
        atexit.register(self.shutdown)  # stop the loop before the interpreter tears torch down
        return self

    def shutdown(self) -> None:
        """Stops the engine's thread and cancels every request in flight. The engine stays usable: its
        streams' readers run its turns again, or start() it again."""
        self._stop("cancelled")

    def drain(self, seconds: float) -> None:
        """Before a shutdown: refuses new requests (EngineUnavailableError, the server is stopping), gives those
        in flight up to `seconds` to end, then stops, ending the rest with that error (EngineLostError for their
        readers: a client sees an error, not a dropped connection)."""
        self._draining = True
        deadline = time.monotonic() + seconds
        while self.busy and self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop("error", STOPPING, "engine")

    def _stop(self, reason: str, message: str = "", failure: str = "") -> None:
        with self._wakeup:
            self._running = False
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._turn_lock:
            self._in_flight = None
            with self._wakeup:
                pending, self._waiting = list(self._waiting), collections.deque()
            for sequence in pending:
                self._finish(sequence, reason, message, failure)
            for slot in range(len(self._slots)):
                self._free(slot, reason, message, failure)
            self._after_turn()
        atexit.unregister(self.shutdown)

    def close(self) -> None:
        """shutdown(), then gives the KV cache back: another engine may serve the model."""
        self.shutdown()
        self._closed = True
        self.runner.release(self)

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
        *,
        params: Optional[SamplingParams] = None,
        prediction_tokens: tuple[int, ...] | list[int] = (),
        standalone_text: bool = False,
        **controls,
    ) -> TokenStream:
        """Queues a request; returns its token stream (with prompt_logprobs, also the log-probabilities of
        prompt tokens 1..n-1, set on the stream before its first token). Without logprobs, chunks carry NaN
        log-probabilities. The other sampling controls (top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, stop, seed, top_logprobs) are keywords named as in SamplingParams, or all of them
        in params. prediction_tokens: the reply as the caller expects it; with prompt lookup, drafts come from
        it first (the reply itself is the same, sooner where the prediction is right). standalone_text: stop
        strings are found in the reply's text read alone (a chat reply's content), not after the prompt.

        Raises:
            InvalidRequestError / ContextLengthError: bad prompt or parameters.
            ServerBusyError: every slot is busy and the waiting queue is full.
        """
        return self.submit_request(self.check(prompt_tokens, max_new_tokens, temperature, top_p, prompt_logprobs,
                                              logprobs, params=params, prediction_tokens=prediction_tokens,
                                              standalone_text=standalone_text,
                                              **controls))

    def submit_request(self, request: GenerationRequest) -> TokenStream:
        """Queues a checked request (see check); returns its token stream.

        Raises:
            ServerBusyError: every slot is busy and the waiting queue is full.
        """
        channel = Channel()
        self.add(request, channel)
        return TokenStream(channel, len(request.prompt_tokens), self)

    def check(self, prompt_tokens, max_new_tokens, temperature=0.6, top_p=0.9, prompt_logprobs=False,
              logprobs=True, *, params: Optional[SamplingParams] = None, name: str = "prompt",
              prediction_tokens=(), standalone_text=False, **controls) -> GenerationRequest:
        """The checked request for this model, or InvalidRequestError / ContextLengthError (naming the prompt
        as `name`)."""
        params = sampling_params(temperature, top_p, logprobs, params, **controls)
        return GenerationRequest.checked(prompt_tokens, max_new_tokens, params, prompt_logprobs,
                                         vocab_size=self.words, max_seq_len=self.runner.max_seq_len,
                                         name=name, prediction_tokens=prediction_tokens,
                                         standalone_text=standalone_text)

    def add(self, request: GenerationRequest, channel: Channel) -> None:
        """Queues a checked request whose events go to channel.

        Raises:
            InvalidRequestError: its grammar cannot be followed with this model's tokenizer.
            LlamaError: the engine is closed.
            ServerBusyError: every slot is busy and the waiting queue is full.
        """
        sequence = _Sequence(request, channel, arrival=next(self._arrivals))
        if request.params.grammar is not None:
            sequence.grammar = GrammarMatcher(request.params.grammar, self.tokenizer)
            sequence.grammar.check_start(self.runner.args.vocab_size)
        with self._wakeup:
            sequence.seed = request.params.seed
            if sequence.seed is None:
                sequence.seed = int(torch.randint(0, MAX_SEED, (1,), generator=self.generator))
            if self._closed:
                raise LlamaError("the engine is closed")
            if self._draining:
                raise EngineUnavailableError(STOPPING)
            if self._lost:
                raise EngineUnavailableError(self._lost)
            if len(self._waiting) >= self.max_waiting + self.free_slots:
                raise ServerBusyError.full(len(self._slots), len(self._waiting))
            self._waiting.append(sequence)
            self._wakeup.notify()

    @property
    def active_count(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def capacity(self) -> int:
        """The most requests it holds at once, running and waiting: more are answered busy."""
        return len(self._slots) + self.max_waiting

    @property
    def busy(self) -> bool:
        """Whether it holds a request its reader still wants (a cancelled one ends at the next turn)."""
        with self._wakeup:
            held = [s for s in self._slots if s is not None] + list(self._waiting)
        return any(not s.channel.cancelled.is_set() for s in held)

    @property
    def free_slots(self) -> int:
        return len(self._slots) - self.active_count

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, int]:
        """Its counters: requests running ("active") and waiting, decode steps run, and prompt tokens computed
        ("prefilled_tokens") and found in the KV cache instead ("cached_tokens": the prefix cache's work)."""
        return dict(active=self.active_count, waiting=self.waiting_count, steps=self.steps,
                    prefilled_tokens=self.prefilled_tokens, cached_tokens=self.cached_tokens)

    # -- the loop -----------------------------------------------------------------------------
    def pump(self) -> bool:
        """Runs one turn in the calling thread unless the engine's own thread runs them; whether it did
        any work (a stream's reader calls this while it waits)."""
        if self._running:
            return False
        with self._turn_lock:
            if self._running:
                return False
            return self._turn()

    def _loop(self, warmed_up: Future) -> None:
        try:
            self._warm_up()
        except BaseException as exc:  # start() raises it
            self._abandon(exc)
            warmed_up.set_exception(exc)
            return
        warmed_up.set_result(None)
        try:
            while True:
                with self._wakeup:
                    while self._running and not self._waiting and not any(self._slots):
                        self._wakeup.wait()
                    if not self._running:
                        return
                with self._turn_lock:
                    self._turn()
        except BaseException as exc:  # the loop itself failed (after_turn raised, say): no reader may wait
            self._abandon(exc)  # on a thread that is gone
            raise

    def _warm_up(self) -> None:
        """Warms the runner up in the engine's thread, the one that will run its steps (see ModelRunner.warm_up)."""
        with self._turn_lock:
            self._forget_foreign_writes()
            self.runner.warm_up()
            self._cache_version = self.runner.kv_cache_version  # it wrote only the spare position, no slot's

    def _abandon(self, exc: BaseException) -> None:
        """Ends every request, waiting or running, with the error that stopped the engine's thread; later
        submissions are refused until start() runs it again."""
        self._lost = f"the engine stopped: {_failure_message(exc)}"
        with self._wakeup:
            self._running = False
            pending, self._waiting = list(self._waiting), collections.deque()
        with self._turn_lock:
            self._in_flight = None
            for sequence in pending:
                self._finish(sequence, "error", self._lost, "engine")
            for slot in range(len(self._slots)):
                self._free(slot, "error", self._lost, "engine")

    def _turn(self) -> bool:
        """Retires cancelled requests, admits waiting ones, prefills, and runs one decode step; whether
        there was anything to do."""
        if not self._waiting and not any(self._slots):
            return False
        try:
            self._forget_foreign_writes()
            if self._in_flight is None or not self._continue_decoding():
                self._retire_cancelled()
                riders = self._admit()
                self._prefill_next_chunk(riders)
                decoding = [s for s in self._slots if s is not None and not s.prefilling and s not in riders]
                if decoding:
                    self._decode_step(decoding, riders)
                elif riders:
                    self._prefill_groups([riders])
        except Exception as exc:  # a bug must fail the requests in flight, not hang them
            self._in_flight = None
            for slot, sequence in enumerate(self._slots):
                if sequence is not None:
                    self._free(slot, "error", _failure_message(exc))
        self._cache_version = self.runner.kv_cache_version
        self._after_turn()
        return True

    def _forget_foreign_writes(self) -> None:
        """Forgets what the slots hold if anything but this engine wrote the KV cache since its last turn
        (the model run directly, another engine before this one was made)."""
        if self.runner.kv_cache_version != self._cache_version:
            self.prefix_cache.forget_all()

    def _retire_cancelled(self) -> None:
        for slot, sequence in enumerate(self._slots):
            if sequence is not None and sequence.channel.cancelled.is_set():
                self._free(slot, "cancelled")
        with self._wakeup:  # a request abandoned while it waits gives its place in the queue back at once
            gone = [s for s in self._waiting if s.channel.cancelled.is_set()]
            if gone:
                self._waiting = collections.deque(s for s in self._waiting if not s.channel.cancelled.is_set())
        for sequence in gone:
            self._finish(sequence, "cancelled")

    def _admit(self) -> list[_Sequence]:
        """Moves waiting requests into free slots and prefills them together (one padded forward), or, where
        the model allows and other requests are decoding, leaves them to ride along in this turn's decode
        step (one forward for both): returns those riders. A request whose prompt shares a long prefix
        with one being computed waits for it (see PrefixCache.place); those behind it go ahead."""
        free_slots = [slot for slot, s in enumerate(self._slots) if s is None]
        with self._wakeup:
            waiting = list(self._waiting) if free_slots else []
        busy, computing = {}, []  # what the busy slots hold and will hold, for the prefix cache to choose
        if waiting and self.prefix_cache.enabled:
            busy = {slot: s.written_tokens for slot, s in enumerate(self._slots) if s is not None}
            computing = [s.prompt_tokens for s in self._slots if s is not None and s.prefilling]
        admitted = []
        for sequence in waiting:
            if not free_slots:
                break
            if sequence.channel.cancelled.is_set():
                self._dequeue(sequence)
                self._finish(sequence, "cancelled")
                continue
            taken = [slot for slot, s in enumerate(self._slots) if s is not None]
            placement = self.prefix_cache.place(sequence.prompt_tokens, free_slots, busy, computing,
                                                reuse=not sequence.request.prompt_logprobs,
                                                targets=self.runner.slots_to_fill(free_slots, taken))
            if placement is None:
                continue
            self._dequeue(sequence)
            free_slots.remove(placement.slot)
            self._occupy(sequence, placement)
            admitted.append(sequence)
            busy[sequence.slot] = sequence.written_tokens
            computing.append(sequence.prompt_tokens)
        short = [s for s in admitted if len(s.uncomputed) <= self.prefill_chunk]  # longer: chunk by chunk
        together = [s for s in short if not s.request.prompt_logprobs]
        riders = []
        decoding = any(s is not None and s not in admitted and not s.prefilling for s in self._slots)
        if together and decoding and self.runner.mixes_prompts:
            riders, together = together, []
        self._prefill_groups([[s] for s in short if s.request.prompt_logprobs] + ([together] if together else []))
        return riders

    def _dequeue(self, sequence: _Sequence) -> None:
        with self._wakeup:
            self._waiting.remove(sequence)

    def _occupy(self, sequence: _Sequence, placement: Placement) -> None:
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
        self.cached_tokens += cached
        self._slots[sequence.slot] = sequence
        sequence.channel.events.put(Admitted(cached))
        self._start_watching(sequence)

    def _prompt_written(self, sequence: _Sequence, end: int) -> None:
        """Its prompt's tokens up to `end` are now in its slot's KV cache."""
        self.prefilled_tokens += end - sequence.prefilled
        sequence.prefilled = sequence.written = end

    def _prefill_groups(self, groups: list[list[_Sequence]]) -> None:
        """Prefills each group in one forward; a failing group is retried a request at a time, so that only
        the failing request fails."""
        for group in groups:
            try:
                self._prefill(group)
            except Exception as exc:  # one request's failure (e.g. out of memory) must not stop the engine
                if len(group) == 1:
                    self._free(group[0].slot, "error", _failure_message(exc))
                    continue
                for sequence in group:  # find the request that fails; the others go on
                    try:
                        self._prefill([sequence])
                    except Exception as exc:
                        self._free(sequence.slot, "error", _failure_message(exc))

    @torch.inference_mode()
    def _prefill(self, group: list[_Sequence]) -> None:
        """Prefills what is not cached of each request's prompt into its slot, right-padded, and samples its
        first token."""
        device = self.runner.device
        tokens, positions, lengths, kv_len = self._padded_prompts(group)
        rows = cache_rows([s.slot for s in group], device)
        if group[0].request.prompt_logprobs:  # such a request is prefilled alone, all of its prompt
            all_logits = self.runner.prefill(tokens, positions, rows, kv_len)
            values, alternatives = _prompt_scores(self._in_words(all_logits[0, :-1]), tokens[0, 1:],
                                                  group[0].params.top_logprobs)
            group[0].channel.events.put(PromptLogprobs(values, alternatives))
            logits = all_logits[:, -1]
        else:
            logits = self.runner.prefill(tokens, positions, rows, kv_len, logit_index=lengths - 1)[:, 0]
        for sequence in group:
            self._prompt_written(sequence, len(sequence.prompt_tokens))
        self._sample_and_deliver(group, logits)

    def _padded_prompts(self, group: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The uncomputed part of each prompt as one batch: tokens, positions and lengths as right_padded
        gives them, and the kv_len that covers every position."""
        starts = [s.prefilled for s in group]
        tokens, positions, lengths = right_padded([s.uncomputed for s in group], self.eos_id, self.runner.device,
                                                  starts, self.runner.max_seq_len)
        return tokens, positions, lengths, min(max(starts) + tokens.shape[1], self.runner.max_seq_len)

    @torch.inference_mode()
    def _prefill_next_chunk(self, riders: list[_Sequence]) -> None:
        """Prefills the next prefill_chunk tokens of the longest-waiting long prompt; after its last chunk,
        samples its first token."""
        pending = [s for s in self._slots if s is not None and s.prefilling and s not in riders]
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
                values, alternatives = _prompt_scores(self._in_words(logits[:-1]), targets, sequence.params.top_logprobs)
                sequence.prompt_lps += values
                sequence.prompt_alternatives += alternatives or []
                sequence.carried_logits = logits[-1]
                logits = logits[-1:]
            elif last:
                last_index = to_device([len(chunk) - 1], device)
                logits = self.runner.prefill(tokens, positions, rows, end, logit_index=last_index)[:, 0]
            else:  # only the cache matters; one row of logits is the least output to ask for
                self.runner.prefill(tokens, positions, rows, end, logit_index=to_device([0], device))
            self._prompt_written(sequence, end)
            if last:
                if sequence.request.prompt_logprobs:
                    sequence.channel.events.put(PromptLogprobs(
                        sequence.prompt_lps, sequence.prompt_alternatives if sequence.params.top_logprobs else None))
                    sequence.carried_logits = None
                self._sample_and_deliver([sequence], logits)
        except Exception as exc:  # e.g. out of memory: this request fails, the others go on
            self._free(sequence.slot, "error", _failure_message(exc))

    def _continue_decoding(self) -> bool:
        """With a decode step in flight and nothing else to do (no request to admit, no prompt to prefill,
        none cancelled): launches the next step from the in-flight one's tokens on the device, for the rows
        with room for another token, then delivers the in-flight step. Otherwise delivers the in-flight step
        and returns False: the turn goes on as without one."""
        step, self._in_flight = self._in_flight, None
        sequences = step.sequences
        busy = sum(s is not None for s in self._slots)
        if ((self._waiting and busy < len(self._slots)) or busy != len(sequences)
                or any(s.channel.cancelled.is_set() for s in sequences)):
            self._land(step)
            return False
        going_on = [i for i, s in enumerate(sequences) if s.generated + 1 < self._token_limit(s)]
        if going_on:
            tokens = step.next_tokens
            if len(going_on) < len(sequences):
                tokens = tokens[to_device(going_on, tokens.device)]
            self._decode_step([sequences[i] for i in going_on], [], tokens, ahead=1)
        self._land(step)
        return True

    def _land(self, step: _InFlight) -> None:
        """Delivers an in-flight step's tokens to those of its requests still in their slots."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens, logprobs, alternatives = step.host
        live = [i for i, s in enumerate(step.sequences) if self._slots[s.slot] is s]
        if len(live) < len(step.sequences):
            tokens, logprobs = tokens[live], logprobs[live]
            alternatives = None if alternatives is None else tuple(t[live] for t in alternatives)
        for i in live:
            step.sequences[i].written = step.positions[i] + 1
        self._deliver([step.sequences[i] for i in live], tokens, logprobs, alternatives)

    @torch.inference_mode()
    def _decode_step(self, active: list[_Sequence], riders: list[_Sequence], tokens: Optional[torch.Tensor] = None,
                     ahead: int = 0) -> None:
        """One new token for each active request; riders (just admitted) are prefilled in the same forward
        and get their first token. If that forward fails, the riders are prefilled on their own and the
        step is retried without them. With overlap and no riders or penalties, the step stays in flight
        (delivered by the next turn). tokens: the rows' input tokens on the device, where the in-flight
        step has them; ahead: tokens sampled for each row but not delivered yet (0 or 1)."""
        if tokens is None and not riders and self.prompt_lookup:
            drafts = self._drafts(active)
            if any(drafts):
                self._decode_drafts(active, drafts)
                return
        device = self.runner.device
        timed = self.prompt_lookup and tokens is None and not riders and len(active) == 1 and device.type == "cpu"
        try:
            if tokens is None:
                tokens = to_device([s.last_token for s in active], device, torch.long)
            next_positions = [s.next_pos + ahead for s in active]
            positions = to_device(next_positions, device)
            slots = [s.slot for s in active]
            rows = cache_rows(slots, device)
            kv_len = max(next_positions) + 1
            if riders:
                prompt_tokens, prompt_positions, lengths, prompt_kv_len = self._padded_prompts(riders)
                logits = torch.cat(self.runner.forward_spans([
                    Span(tokens[:, None], positions[:, None], rows, kv_len, torch.zeros_like(positions)),
                    Span(prompt_tokens, prompt_positions, cache_rows([s.slot for s in riders], device),
                         prompt_kv_len, lengths - 1),
                ]))
            else:
                started = time.perf_counter()
                logits = self.runner.decode(tokens, positions, rows, kv_len=kv_len, rows_end=max(slots) + 1)
                if timed:  # the forward alone, as _decode_drafts times it (on the CPU it has run by now)
                    self.draft_price.record(1, time.perf_counter() - started)
            sequences = active + riders
            sampled = self._sample(sequences, logits, ahead)
        except Exception as exc:
            if riders:
                self._prefill_groups([riders])
                self._decode_step(active, [])
                return
            for s in active:
                self._free(s.slot, "error", _failure_message(exc))
            return
        self.steps += 1
        if self.overlap and not riders and not any(s.params.penalized or s.grammar for s in active):
            self._in_flight = _InFlight(active, next_positions, sampled[0], *_copied_to_host(sampled))
            return
        for sequence, position in zip(active, next_positions):
            sequence.written = position + 1
        for sequence in riders:
            self._prompt_written(sequence, len(sequence.prompt_tokens))
        self._deliver(sequences, *sampled)

    def _sample(self, sequences: list[_Sequence], logits: torch.Tensor, ahead: int | list[int] = 0,
                allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple]]:
        """Each row's next token, drawn with its request's parameters; its log-probability under the model
        (NaN where no request of the batch asked for them); and, where some request asked for them, the
        model's most likely alternatives (log-probabilities, token ids). ahead: tokens each row (or every
        row) has sampled or drafted beyond those delivered (a seeded draw depends on the token's index).
        allowed: [rows, vocab] the tokens each row may draw; None: as the requests' grammars allow now."""
        device = self.runner.device
        params = [s.params for s in sequences]
        aheads = ahead if isinstance(ahead, list) else [ahead] * len(sequences)
        raw_logits = logits = self._in_words(logits)
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

    def _in_words(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., vocab] with a padded vocabulary's tokens past the tokenizer's words at -inf: never drawn
        or listed (they have no text), and out of the log-probabilities; others unchanged."""
        if logits.shape[-1] <= self.words:
            return logits
        masked = logits.clone()
        masked[..., self.words :] = -math.inf
        return masked

    def _penalized(self, sequences: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        device = self.runner.device
        rows = to_device([s.slot for s in sequences], device)

        def column(name: str) -> torch.Tensor:
            return to_device([[getattr(s.params, name)] for s in sequences], device)

        return apply_penalties(logits, self._seen[rows], self._counts[rows], column("repetition_penalty"),
                               column("presence_penalty"), column("frequency_penalty"))

    def _start_watching(self, sequence: _Sequence) -> None:
        """Sets up what a newly admitted request's sampling needs to follow: its tokens for penalties, its
        text for stop strings."""
        params = sequence.params
        if params.stop:
            context = () if sequence.request.standalone_text else sequence.prompt_tokens
            sequence.stop_text = (StreamDecoder(self.tokenizer, context), StopMatcher(params.stop))
        if params.penalized:
            if self._seen is None:
                shape = (self.runner.max_batch_size, self.runner.args.vocab_size)
                self._seen = torch.zeros(shape, dtype=torch.bool, device=self.runner.device)
                self._counts = torch.zeros(shape, dtype=torch.int32, device=self.runner.device)
            self._seen[sequence.slot] = False
            self._seen[sequence.slot, to_device(sequence.prompt_tokens, self.runner.device)] = True
            self._counts[sequence.slot] = 0

    def _sample_and_deliver(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        self._deliver(sequences, *self._sample(sequences, logits))

    def _deliver(self, sequences: list[_Sequence], next_tokens: torch.Tensor, logprobs: torch.Tensor,
                 alternatives: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        penalized = [i for i, s in enumerate(sequences) if s.params.penalized]
        if penalized:  # the new tokens count from the next step on
            rows = to_device([sequences[i].slot for i in penalized], self.runner.device)
            picked = next_tokens[penalized]
            self._counts[rows, picked] += 1
            self._seen[rows, picked] = True
        if alternatives is not None:
            alternatives = tuple(t.tolist() for t in alternatives)
        for i, (sequence, token, logprob) in enumerate(zip(sequences, next_tokens.tolist(), logprobs.tolist())):
            self._deliver_token(sequence, token, logprob, None if alternatives is None else
                                (alternatives[0][i], alternatives[1][i]))

    def _deliver_token(self, sequence: _Sequence, token: int, logprob: float,
                       alternatives: Optional[tuple[list[float], list[int]]]) -> bool:
        """Hands a request its next token (alternatives: the most likely ones' log-probabilities and ids),
        or ends it at a cancel, EOS, a stop string or its token limit; whether it goes on."""
        if sequence.channel.cancelled.is_set():
            self._free(sequence.slot, "cancelled")
            return False
        if token == self.eos_id:
            if sequence.grammar is not None and not sequence.grammar.accepting:  # drawn as nothing else could be
                self._free(sequence.slot, "error", sequence.grammar.dead_end, failure="grammar")
            else:
                self._free(sequence.slot, "eos")
            return False
        if sequence.grammar is not None and not sequence.grammar.accept(token):
            self._free(sequence.slot, "error", f"the reply left its grammar: {sequence.grammar.error}",
                       failure="grammar")
            return False
        sequence.output.append(token)
        sequence.last_token = token
        if sequence.lookup is not None:
            sequence.lookup.extend((token,))
        top = None
        if sequence.params.top_logprobs:
            n = sequence.params.top_logprobs
            top = list(zip(alternatives[1][:n], alternatives[0][:n]))
        sequence.channel.events.put(StreamChunk(token, logprob, top_logprobs=top))
        if sequence.stop_text is not None and self._reaches_stop(sequence, token):
            self._free(sequence.slot, "stop")
        elif sequence.grammar is not None and sequence.grammar.complete:  # only the end of sequence may follow
            self._free(sequence.slot, "eos")
        elif sequence.generated >= self._token_limit(sequence):
            self._free(sequence.slot, "length")
        else:
            return True
        return False

    # -- prompt lookup --------------------------------------------------------------------------
    def _drafts(self, active: list[_Sequence]) -> list[list[int]]:
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
            room = min(self._token_limit(sequence) - sequence.generated - 1,  # tokens it may still have
                       self.runner.max_seq_len - 1 - sequence.next_pos)  # positions its slot has
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
    def _decode_drafts(self, active: list[_Sequence], drafts: list[list[int]]) -> None:
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
            drawn, logprobs, alternatives = self._sample(rows, logits.flatten(0, 1), list(range(width)) * len(active),
                                                         allowed)
        except Exception as exc:
            for s in active:
                self._free(s.slot, "error", _failure_message(exc))
            return
        self.steps += 1
        drawn, logprobs = drawn.tolist(), logprobs.tolist()
        if alternatives is not None:
            alternatives = tuple(t.tolist() for t in alternatives)
        for i, (sequence, draft) in enumerate(zip(active, drafts)):
            row = drawn[i * width : (i + 1) * width]
            kept = 0
            while kept < len(draft) and draft[kept] == row[kept]:
                kept += 1
            self.drafted_tokens += len(draft)
            self.accepted_tokens += kept
            sequence.drafted += len(draft)
            sequence.accepted += kept
            for j in range(kept + 1):
                sequence.written = starts[i] + j + 1
                at = i * width + j
                if not self._deliver_token(sequence, row[j], logprobs[at], None if alternatives is None else
                                           (alternatives[0][at], alternatives[1][at])):
                    break

    def _token_limit(self, sequence: _Sequence) -> int:
        """The most tokens the request may generate: its max_new_tokens, or what its slot has room for."""
        return min(sequence.request.max_new_tokens, self.runner.max_seq_len - len(sequence.prompt_tokens))

    @staticmethod
    def _reaches_stop(sequence: _Sequence, token: int) -> bool:
        decoder, matcher = sequence.stop_text
        matcher.feed(decoder.push(token))
        return matcher.stopped

    def _free(self, slot: int, reason: str, message: str = "", failure: str = "") -> None:
        """Ends slot's request; the slot keeps what it wrote for later prompts, unless the request failed."""
        sequence = self._slots[slot]
        self._slots[slot] = None
        if sequence is not None:
            if reason == "error":
                self.prefix_cache.forget(slot)
            else:
                self.prefix_cache.release(slot, sequence.written_tokens)
            self._finish(sequence, reason, message, failure)

    @staticmethod
    def _finish(sequence: _Sequence, reason: str, message: str = "", failure: str = "") -> None:
        sequence.channel.events.put(Finished(reason, message, time.perf_counter(), sequence.drafted, sequence.accepted,
                                             failure))
        sequence.channel.finished.set()


def check_count(name: str, value, least: int = 0) -> None:
    """Raises InvalidRequestError unless value is an integer of at least `least` (an engine option)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidRequestError(f"{name} must be a {'positive' if least == 1 else 'non-negative'} integer, "
                                  f"got {value!r}")


def _copied_to_host(sampled: tuple) -> tuple[tuple, Optional[torch.cuda.Event]]:
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


def _prompt_scores(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[list[float], Optional[list]]:
    """The log-probabilities of tokens [N] under logits [N, V], and with top > 0 each row's top most likely
    tokens as (token id, log-probability) pairs (None with top 0)."""
    values = token_logprobs(logits, tokens).tolist()
    if not top:
        return values, None
    lps, ids = top_logprobs(logits, top)
    return values, [list(zip(row_ids, row_lps)) for row_ids, row_lps in zip(ids.tolist(), lps.tolist())]


def _failure_message(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "the request ran out of device memory; try a shorter prompt or fewer new tokens"
    return f"generation failed: {type(exc).__name__}: {exc}"
