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

The engine coordinates; each part of a turn is a module of its own: scheduler (the waiting queue, the slots
and admission), prefill, decode (the step and the overlap pipeline), drafts (prompt lookup), sampler and
delivery; sequence holds what the engine keeps of each request.
"""

from __future__ import annotations

import atexit
import itertools
import math
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from ..cpu_kernels import threads as cpu_threads
from ..errors import EngineUnavailableError, LlamaError, InvalidRequestError
from .grammar_matcher import GrammarMatcher
from ..loader import LoadedModel, ModelInfo
from ..tokenizer import StreamDecoder, Tokenizer
from .decode import Decoder
from .delivery import Delivery
from .drafts import DRAFT_PRICE_ROWS_APART, DRAFT_PRICE_ROWS_AS_ONE, DRAFT_ROWS, Drafter
from .events import Channel
from .lookup import DraftPrice
from .prefill import Prefiller
from .requests import MAX_SEED, GenerationRequest, SamplingParams, sampling_params
from .sampler import Sampler
from .scheduler import Scheduler, client_capacity
from .sequence import STOPPING, EngineCounts, Sequence, failure_message
from .stops import StopMatcher
from .streams import TokenStream



CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK = 512, 2048  # Engine's default prefill_chunk
CPU_PROMPT_LOOKUP = 5  # Engine's default prompt_lookup on the CPU kernels (off elsewhere)


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
        max_waiting: requests queued beyond the busy slots before submit answers busy; one named client may
        hold every slot and half of these (see scheduler.client_capacity).
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
        thread, so there is nothing to overlap and each token would only come a step later; under tensor
        parallelism each forward's inputs go to the other ranks through the host, a wait on the device.
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
        # What ends a reply as EOS does: the tokenizer's EOS and the ids generation_config.json names (a fine-tune's
        # end-of-turn token, say); delivery checks each drawn token on the host, where it already is
        self.end_ids = frozenset((self.eos_id, *model.info.generation_config.eos_token_ids))
        self.words = model.tokenizer.n_words  # a model's padded vocabulary may have more rows: never drawn
        self.generator = torch.Generator()  # draws a seed for each request that brings none
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._arrivals = itertools.count()
        self._wakeup = threading.Condition()
        self._turn_lock = threading.Lock()  # one turn at a time, whichever thread runs it
        self._running = False
        self._closed = False
        self._draining = False
        self._lost = ""  # why the engine's thread stopped, where it failed
        self._thread: Optional[threading.Thread] = None
        self._after_turn = after_turn or (lambda: None)
        self.prompt_lookup = prompt_lookup
        if draft_price is None:
            self.draft_price = DraftPrice(DRAFT_PRICE_ROWS_AS_ONE if self.runner.rows_read_as_one >= DRAFT_ROWS
                                          else DRAFT_PRICE_ROWS_APART)
        else:
            self.draft_price = DraftPrice(float(draft_price), fixed=True)
        self.overlap = (self.runner.device.type == "cuda" and not prompt_lookup and not self.runner.tensor_parallel
                        if overlap is None else overlap)
        self._cache_version: Optional[int] = None  # the KV cache's version after this engine's last turn
        self._counts = EngineCounts()
        runner, counts = self.runner, self._counts
        self._scheduler = Scheduler(runner, self._wakeup, counts, prefill_chunk, prefix_caching, self._watch)
        self.prefix_cache = self._scheduler.prefix_cache
        self._sampler = Sampler(self.words, runner.args.vocab_size, runner.max_batch_size, runner.device)
        self._delivery = Delivery(self._scheduler, self._sampler, self.end_ids, runner.max_seq_len, counts)
        self._prefiller = Prefiller(runner, self._scheduler, self._sampler, self._delivery, counts, prefill_chunk,
                                    self.eos_id)
        drafter = Drafter(runner, self._scheduler, self._sampler, self._delivery, counts, prompt_lookup,
                          self.draft_price)
        self._decoder = Decoder(runner, self._scheduler, self._sampler, self._delivery, self._prefiller, drafter,
                                counts, self.overlap)

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

    # The counts of the engine's work, for tests and stats (see EngineCounts).
    steps = property(lambda self: self._counts.steps, doc="Decode steps run.")
    prefilled_tokens = property(lambda self: self._counts.prefilled_tokens, doc="Prompt tokens computed.")
    cached_tokens = property(lambda self: self._counts.cached_tokens,
                             doc="Prompt tokens found in the KV cache instead of computed.")
    generated_tokens = property(lambda self: self._counts.generated_tokens,
                                doc="Tokens handed to requests as their replies (EOS left out).")
    drafted_tokens = property(lambda self: self._counts.drafted_tokens,
                              doc="Tokens drafted by prompt lookup and verified.")
    accepted_tokens = property(lambda self: self._counts.accepted_tokens, doc="Of those, the ones kept.")

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
            self._end_all(self._scheduler.take_waiting(), reason, message, failure)
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
        client: Optional[str] = None,
        **controls,
    ) -> TokenStream:
        """Queues a request; returns its token stream (with prompt_logprobs, also the log-probabilities of
        prompt tokens 1..n-1, set on the stream before its first token). Without logprobs, chunks carry NaN
        log-probabilities. The other sampling controls (top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, stop, seed, top_logprobs) are keywords named as in SamplingParams, or all of them
        in params. prediction_tokens: the reply as the caller expects it; with prompt lookup, drafts come from
        it first (the reply itself is the same, sooner where the prediction is right). standalone_text: stop
        strings are found in the reply's text read alone (a chat reply's content), not after the prompt.
        client: who sends it (an address, a session, an API key's name): free slots go first to the clients
        served the fewest tokens lately (see scheduler), and a named client holds at most client_capacity
        requests; None, anonymous (every such request counts as one client, not bounded so: see scheduler).

        Raises:
            InvalidRequestError / ContextLengthError: bad prompt or parameters.
            ServerBusyError: every slot is busy and the waiting queue is full, or the client holds
                client_capacity requests.
        """
        return self.submit_request(self.check(prompt_tokens, max_new_tokens, temperature, top_p, prompt_logprobs,
                                              logprobs, params=params, prediction_tokens=prediction_tokens,
                                              standalone_text=standalone_text, client=client,
                                              **controls))

    def submit_request(self, request: GenerationRequest) -> TokenStream:
        """Queues a checked request (see check); returns its token stream.

        Raises:
            ServerBusyError: every slot is busy and the waiting queue is full, or its client holds
                client_capacity requests.
        """
        channel = Channel()
        self.add(request, channel)
        return TokenStream(channel, len(request.prompt_tokens), self)

    def check(self, prompt_tokens, max_new_tokens, temperature=0.6, top_p=0.9, prompt_logprobs=False,
              logprobs=True, *, params: Optional[SamplingParams] = None, name: str = "prompt",
              prediction_tokens=(), standalone_text=False, client=None, **controls) -> GenerationRequest:
        """The checked request for this model, or InvalidRequestError / ContextLengthError (naming the prompt
        as `name`)."""
        params = sampling_params(temperature, top_p, logprobs, params, **controls)
        return GenerationRequest.checked(prompt_tokens, max_new_tokens, params, prompt_logprobs,
                                         vocab_size=self.words, max_seq_len=self.runner.max_seq_len,
                                         name=name, prediction_tokens=prediction_tokens,
                                         standalone_text=standalone_text, client=client)

    def add(self, request: GenerationRequest, channel: Channel) -> None:
        """Queues a checked request whose events go to channel.

        Raises:
            InvalidRequestError: its grammar cannot be followed with this model's tokenizer.
            LlamaError: the engine is closed.
            ServerBusyError: every slot is busy and the waiting queue is full, or its client holds
                client_capacity requests.
        """
        sequence = Sequence(request, channel, arrival=next(self._arrivals))
        if request.params.grammar is not None:
            sequence.grammar = GrammarMatcher(request.params.grammar, self.tokenizer, self.end_ids)
            sequence.grammar.check_start(self.runner.args.vocab_size)
        with self._wakeup:
            if self._closed:
                raise LlamaError("the engine is closed")
            if self._draining:
                raise EngineUnavailableError(STOPPING)
            if self._lost:
                raise EngineUnavailableError(self._lost)
            drawn = self.generator.get_state() if request.params.seed is None else None
            sequence.seed = request.params.seed
            if sequence.seed is None:
                sequence.seed = int(torch.randint(0, MAX_SEED, (1,), generator=self.generator))
            try:
                self._scheduler.enqueue(sequence, self.max_waiting)
            except BaseException:
                if drawn is not None:  # a request refused takes no seed from the ones after it
                    self.generator.set_state(drawn)
                raise

    @property
    def active_count(self) -> int:
        return len(self._scheduler.active)

    @property
    def capacity(self) -> int:
        """The most requests it holds at once, running and waiting: more are answered busy."""
        return len(self._scheduler.slots) + self.max_waiting

    @property
    def client_capacity(self) -> int:
        """The most requests one named client holds at once, running and waiting: more are answered busy."""
        return client_capacity(len(self._scheduler.slots), self.max_waiting)

    @property
    def busy(self) -> bool:
        """Whether it holds a request its reader still wants (a cancelled one ends at the next turn)."""
        return any(not s.channel.cancelled.is_set() for s in self._scheduler.held())

    @property
    def free_slots(self) -> int:
        return self._scheduler.free_slots

    @property
    def waiting_count(self) -> int:
        return len(self._scheduler.waiting)

    def stats(self, seconds: Optional[float] = None) -> dict[str, int]:
        """Its counters: requests running ("active") and waiting, decode steps run, prompt tokens computed
        ("prefilled_tokens") and found in the KV cache instead ("cached_tokens": the prefix cache's work), and
        tokens generated ("generated_tokens"). seconds: what a caller would wait for them from a model process
        (EngineProcess.stats); this engine answers at once."""
        return dict(active=self.active_count, waiting=self.waiting_count, steps=self.steps,
                    prefilled_tokens=self.prefilled_tokens, cached_tokens=self.cached_tokens,
                    generated_tokens=self.generated_tokens)

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
            self.warm_up()
        except BaseException as exc:  # start() raises it
            self._abandon(exc)
            warmed_up.set_exception(exc)
            return
        warmed_up.set_result(None)
        try:
            while True:
                with self._wakeup:
                    while self._running and self._scheduler.idle:
                        self._wakeup.wait()
                    if not self._running:
                        return
                with self._turn_lock:
                    self._turn()
        except BaseException as exc:  # the loop itself failed (after_turn raised, say): no reader may wait
            self._abandon(exc)  # on a thread that is gone
            raise

    def warm_up(self) -> None:
        """Warms the runner's compiled step up in the calling thread, which is to run the engine's turns (see
        ModelRunner.warm_up): start() calls it on the engine's own thread; where readers run the turns, call it
        in the reader's thread before the first request (the Llama facade does, for a model it loaded cold)."""
        with self._turn_lock:
            self._forget_foreign_writes()
            self.runner.warm_up()
            self._cache_version = self.runner.kv_cache_version  # it wrote only the spare position, no slot's

    def _abandon(self, exc: BaseException) -> None:
        """Ends every request, waiting or running, with the error that stopped the engine's thread; later
        submissions are refused until start() runs it again."""
        self._lost = f"the engine stopped: {failure_message(exc)}"
        with self._wakeup:
            self._running = False
            pending = self._scheduler.take_waiting()
        with self._turn_lock:
            self._end_all(pending, "error", self._lost, "engine")

    def _end_all(self, waiting: list[Sequence], reason: str, message: str = "", failure: str = "") -> None:
        """Ends the requests taken from the queue and every running one (the caller holds the turn lock)."""
        self._decoder.in_flight = None
        for sequence in waiting:
            sequence.finish(reason, message, failure)
        self._scheduler.free_all(reason, message, failure)

    def _turn(self) -> bool:
        """Retires cancelled requests, admits waiting ones, prefills, and runs one decode step; whether
        there was anything to do."""
        if self._scheduler.idle:
            return False
        try:
            self._forget_foreign_writes()
            self._scheduler.retire_abandoned()  # with a step ahead in flight too: they count against max_waiting
            if self._decoder.in_flight is None or not self._decoder.continue_decoding():
                self._scheduler.retire_cancelled()
                riders = self._admit()
                self._prefiller.prefill_next_chunk(riders)
                decoding = [s for s in self._scheduler.active if not s.prefilling and s not in riders]
                if decoding:
                    self._decoder.step(decoding, riders)
                elif riders:
                    self._prefiller.prefill_groups([riders])
        except Exception as exc:  # a bug must fail the requests in flight, not hang them
            self._decoder.in_flight = None
            self._scheduler.free_all("error", failure_message(exc))
        self._cache_version = self.runner.kv_cache_version
        self._after_turn()
        return True

    def _forget_foreign_writes(self) -> None:
        """Forgets what the slots hold if anything but this engine wrote the KV cache since its last turn
        (the model run directly, another engine before this one was made)."""
        if self.runner.kv_cache_version != self._cache_version:
            self.prefix_cache.forget_all()

    def _admit(self) -> list[Sequence]:
        """Moves waiting requests into free slots and prefills them (see Scheduler.admit); returns those left
        to ride along in this turn's decode step."""
        groups, riders = self._scheduler.admit()
        self._prefiller.prefill_groups(groups)
        return riders

    def _watch(self, sequence: Sequence) -> None:
        """Sets up what a newly admitted request's sampling needs to follow: its tokens for penalties, its
        text for stop strings."""
        params = sequence.params
        if params.stop:
            context = () if sequence.request.standalone_text else sequence.prompt_tokens
            sequence.stop_text = (StreamDecoder(self.tokenizer, context), StopMatcher(params.stop))
        self._sampler.watch(sequence)


def check_count(name: str, value, least: int = 0) -> None:
    """Raises InvalidRequestError unless value is an integer of at least `least` (an engine option)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidRequestError(f"{name} must be a {'positive' if least == 1 else 'non-negative'} integer, "
                                  f"got {value!r}")
