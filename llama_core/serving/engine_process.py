"""The serving engine in a process of its own, so that its loop never waits for the web server's Python.

A Python process runs one thread at a time (the interpreter lock): an Engine inside a web server takes
turns with the server's event loop and request threads, and every decode step waits for them. An
`EngineProcess` loads the model and runs the Engine in a child process; requests and their tokens travel
over a pipe. It has the Engine's `submit`, `tokenizer` and `info` (the model's facts, without its
weights).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import queue
import signal
import sys
import threading
import time
import types
import warnings
from typing import Any, Optional

import torch

from .. import errors
from ..errors import EngineUnavailableError, LlamaError, ServerBusyError
from ..loader import ModelInfo, load
from ..tokenizer import Tokenizer
from .engine import STOPPING, Engine
from .events import Admitted, Channel, Finished, PromptLogprobs, StreamChunk
from .grammar_matcher import GrammarMatcher
from .requests import GenerationRequest, SamplingParams, sampling_params
from .scheduler import client_capacity
from .streams import TokenStream, vocabulary

_STARTUP_SECONDS = 3600  # loading a large checkpoint from a slow disk can take long; a crash ends it at once


STOPPED_UNEXPECTEDLY = "the model process stopped unexpectedly"
ANSWER_SECONDS = 30.0  # what /health waits for the model process: it answers between turns (a turn takes less)
RESTARTS_FORGIVEN_AFTER = 300.0  # seconds of serving after which earlier restarts no longer count as in a row


class EngineProcess:
    """An Engine serving a model that a child process loads with `llama_core.loader.load(**build)` (build
    may also hold the engine's `seed`); max_waiting, prefill_chunk, prefix_caching, prompt_lookup and
    draft_price are the Engine's.

    Use as a context manager, or start() and shutdown(). start() raises what loading raised.

    The child is supervised: if it dies (out of memory, a crash, kill -9), the requests in flight end with
    an error saying so, new ones are refused as "restarting" until a new child has loaded the model, and
    after max_restarts restarts in a row (none of them serving for RESTARTS_FORGIVEN_AFTER seconds) the
    engine gives up: `state` is then "failed".
    """

    def __init__(self, build: dict[str, Any], max_waiting: int = 64, prefill_chunk: Optional[int] = None,
                 threads: Optional[int] = None, prefix_caching: bool = True, max_restarts: int = 3,
                 prompt_lookup: Optional[int] = None, draft_price: Optional[float] = None) -> None:
        self._build = dict(build)
        self._engine_options = dict(max_waiting=max_waiting, prefill_chunk=prefill_chunk,
                                    prefix_caching=prefix_caching, prompt_lookup=prompt_lookup,
                                    draft_price=draft_price)
        self._threads = threads
        self.max_restarts = max_restarts
        self.state = "stopped"  # "starting", "running", "restarting", "stopping" (drain), "failed" or "stopped"
        self.restarts = 0  # restarts in a row
        self._started_at = 0.0
        self.info: Optional[ModelInfo] = None
        self.tokenizer: Optional[Tokenizer] = None
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._channels: dict[int, Channel] = {}
        self._clients: dict[int, str] = {}  # request id -> its named client, while in flight
        self._replies: dict[int, list] = {}  # request id -> [threading.Event, reply]
        self._lock = threading.Lock()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()  # ids of cancelled requests, for the canceller
        self._stopped = False
        self._shut = False  # shutdown() was called: a child a restart loads meanwhile is stopped, not served

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "EngineProcess":
        if self._process is not None:
            return self
        self._shut = False
        self.state = "starting"
        try:
            self._spawn()
        except BaseException:
            self.state = "stopped"
            raise
        self.tokenizer = Tokenizer(self.info.tokenizer_path)
        self._cancels = queue.SimpleQueue()
        threading.Thread(target=self._send_cancels, args=(self._cancels,), name="llama-engine-canceller",
                         daemon=True).start()
        atexit.register(self.shutdown)
        return self

    def _spawn(self) -> None:
        """Starts a child, waits until it has loaded the model, and starts reading its messages; raises what
        loading raised."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: safe with CUDA and threads
        conn, child_end = context.Pipe()
        process = context.Process(
            target=_serve, args=(child_end, self._build, self._engine_options, self._threads), name="llama-engine",
            daemon=True,
        )
        with _without_main_module():
            process.start()
        child_end.close()
        try:
            if not conn.poll(_STARTUP_SECONDS):
                raise LlamaError(f"the engine process did not load the model within {_STARTUP_SECONDS} s")
            message = conn.recv()
        except (EOFError, OSError):
            message = ("failed", "LlamaError", f"the engine process exited (code {process.exitcode}) while loading the model")
        except BaseException:
            process.kill()
            raise
        if message[0] == "failed":
            process.join(timeout=30)
            conn.close()
            raise _exception(message[1], message[2])
        with self._send_lock:
            if self._shut:  # shut down while a restart loaded this child: it serves no one
                process.kill()
                conn.close()
                return
            self._process, self._conn, self.info = process, conn, message[1]
        self._stopped = False
        self._started_at = time.monotonic()
        self.state = "running"
        threading.Thread(target=self._read, args=(conn, process), name="llama-engine-reader", daemon=True).start()

    def shutdown(self) -> None:
        with self._send_lock:
            self._shut = True
        if self._process is None:
            return
        self._cancels.put(None)
        self.state = "stopped"
        try:
            self._send(("stop",))
        except (OSError, ValueError, LlamaError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        self._process = None
        self._conn.close()
        atexit.unregister(self.shutdown)

    def _may_restart(self) -> bool:
        """Whether a child that died now is restarted: fewer than max_restarts restarts in a row were made."""
        if time.monotonic() - self._started_at > RESTARTS_FORGIVEN_AFTER:
            self.restarts = 0
        return self.restarts < self.max_restarts

    def _restart(self, exitcode: Optional[int]) -> None:
        """After the child died: a new one, unless max_restarts restarts in a row have been made."""
        if not self._may_restart():
            self.state = "failed"
            print(f"error: {STOPPED_UNEXPECTEDLY} (exit code {exitcode}) {self.restarts + 1} times in a row; "
                  "not restarting it again", file=sys.stderr, flush=True)
            return
        self.restarts += 1
        print(f"warning: {STOPPED_UNEXPECTEDLY} (exit code {exitcode}); restarting it "
              f"({self.restarts} of at most {self.max_restarts} restarts in a row)", file=sys.stderr, flush=True)
        try:
            self._spawn()
        except BaseException as exc:  # the model no longer loads: nothing more to try
            self.state = "failed"
            print(f"error: the model process could not be restarted: {exc}", file=sys.stderr, flush=True)

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        """Whether the engine takes requests: its process was started, runs, and its pipe is open."""
        return (self.state == "running" and self._process is not None and not self._stopped
                and self._process.is_alive())

    @property
    def pid(self) -> Optional[int]:
        """The model process's id, while one runs."""
        return self._process.pid if self._process is not None else None

    def drain(self, seconds: float) -> None:
        """Before a shutdown: refuses new requests (EngineUnavailableError, the server is stopping), gives those
        in flight up to `seconds` to end, then ends the rest with that error (EngineLostError for their
        readers: a client sees an error, not a dropped connection) and cancels them in the model process."""
        if self.state == "running":
            self.state = "stopping"
        deadline = time.monotonic() + seconds
        while self._channels and time.monotonic() < deadline and self._process is not None and self._process.is_alive():
            time.sleep(0.02)
        with self._lock:
            left = list(self._channels.items())
        for rid, channel in left:
            self._finish(rid, "error", STOPPING, failure="engine")
            channel.cancelled.set()

    def unavailable_reason(self) -> str:
        if self.state == "stopping":
            return STOPPING
        if self.state == "restarting":
            return f"{STOPPED_UNEXPECTEDLY} and is restarting; try again in a moment"
        if self.state == "failed":
            return f"{STOPPED_UNEXPECTEDLY} and could not be restarted; the server must be restarted"
        return "the engine process is not running"

    # -- submitting ---------------------------------------------------------------------------
    def submit(self, prompt_tokens: list[int], max_new_tokens: int, temperature: float = 0.6, top_p: float = 0.9,
               prompt_logprobs: bool = False, logprobs: bool = True, *, params: Optional[SamplingParams] = None,
               prediction_tokens: tuple[int, ...] | list[int] = (), standalone_text: bool = False,
               client: Optional[str] = None, **controls) -> TokenStream:
        """As Engine.submit: the request is checked here, and sent to the child without waiting for it (the
        caller may be an event loop), so the errors a request can meet are raised here: a bad request, and a
        full engine or client, counted here as the requests sent and not yet ended. A refusal of the child's
        own (it is shutting down) ends the stream with an error.

        Raises:
            InvalidRequestError / ContextLengthError: a bad request.
            ServerBusyError: every slot is busy and the waiting queue is full, or the client holds
                client_capacity requests.
            EngineUnavailableError: the model process is restarting, or stopped.
        """
        if self.state != "running" or self._stopped:
            raise EngineUnavailableError(self.unavailable_reason())
        request = GenerationRequest.checked(prompt_tokens, max_new_tokens,
                                            sampling_params(temperature, top_p, logprobs, params, **controls),
                                            prompt_logprobs, vocab_size=vocabulary(self),
                                            max_seq_len=self.info.max_seq_len, prediction_tokens=prediction_tokens,
                                            standalone_text=standalone_text, client=client)
        if request.params.grammar is not None:  # one no reply can begin (llguidance's limits) is a bad request
            GrammarMatcher(request.params.grammar, self.tokenizer, self.info.generation_config.eos_token_ids
                           ).check_start(self.info.args.vocab_size)  # here, not an error in the stream from the child
        rid = next(self._ids)
        channel = Channel(cancelled=_Cancel(lambda: self._cancels.put(rid)))
        slots = self.info.max_batch_size
        with self._lock:
            in_flight = len(self._channels)
            if in_flight >= slots + self._engine_options["max_waiting"]:
                running = min(in_flight, slots)
                raise ServerBusyError.full(running, in_flight - running)
            if client is not None:
                held = sum(c == client for c in self._clients.values())
                if held >= self.client_capacity:
                    raise ServerBusyError.client_full(held)
                self._clients[rid] = client
            self._channels[rid] = channel
        try:
            self._send(("submit", rid, request))
        except Exception:
            with self._lock:
                self._channels.pop(rid, None)
                self._clients.pop(rid, None)
            raise
        return TokenStream(channel, len(request.prompt_tokens))

    @property
    def capacity(self) -> int:
        """The most requests it holds at once, running and waiting: more are answered busy."""
        return self.info.max_batch_size + self._engine_options["max_waiting"]

    @property
    def client_capacity(self) -> int:
        """The most requests one named client holds at once, running and waiting: more are answered busy."""
        return client_capacity(self.info.max_batch_size, self._engine_options["max_waiting"])

    @property
    def active_count(self) -> int:
        return self._stats()["active"]

    @property
    def waiting_count(self) -> int:
        return self._stats()["waiting"]

    @property
    def steps(self) -> int:
        """Decode steps the engine has run."""
        return self._stats()["steps"]

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the engine has computed."""
        return self._stats()["prefilled_tokens"]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine found in its KV cache instead of computing them."""
        return self._stats()["cached_tokens"]

    @property
    def generated_tokens(self) -> int:
        """Tokens the engine has handed to requests as their replies."""
        return self._stats()["generated_tokens"]

    def _stats(self) -> dict:  # the child answers between two turns
        return self._ask(("stats", next(self._ids)))[2]

    def stats(self, seconds: float = ANSWER_SECONDS) -> Optional[dict]:
        """The engine's counters (as Engine.stats), or None where the model process does not answer within
        `seconds`, as it does between two engine turns: one stopped or stuck (a hung device, a deadlock) does
        not, though it is alive.

        Raises:
            EngineUnavailableError: the model process ended (or its pipe closed) before answering."""
        try:
            return self._ask(("stats", next(self._ids)), timeout=seconds)[2]
        except TimeoutError:
            return None

    def responsive(self, seconds: float = ANSWER_SECONDS) -> bool:
        """Whether the model process answers within `seconds` (see stats)."""
        try:
            return self.stats(seconds) is not None
        except LlamaError:
            return False

    def _ask(self, message: tuple, timeout: Optional[float] = None) -> tuple:
        """Sends message (its second item a fresh id) and waits for the child's answer to it; raises
        EngineUnavailableError where the child stopped before answering, TimeoutError where it did not answer
        within timeout seconds."""
        rid, reply = message[1], [threading.Event(), None]
        with self._lock:
            self._replies[rid] = reply
        try:
            self._send(message)
            if not reply[0].wait(timeout):
                raise TimeoutError(f"the model process did not answer in {timeout:g} s")
        finally:
            with self._lock:
                self._replies.pop(rid, None)
        if reply[1][0] == "rejected":
            raise _exception(reply[1][1], reply[1][2])
        return reply[1]

    # -- the pipe -----------------------------------------------------------------------------
    def _send_cancels(self, cancels: queue.SimpleQueue) -> None:
        """Tells the child to cancel the requests whose ids the cancels queue gets, until shutdown() puts None.
        A cancel is only queued where it is made (SimpleQueue.put may run inside anything): it may be made by a
        finalizer or the garbage collector (a stream dropped unread, a partly read one's iterator closed),
        inside a send that holds the pipe's lock, which a send of its own would wait for forever."""
        while (rid := cancels.get()) is not None:
            with contextlib.suppress(LlamaError):  # the child is gone: nothing left to cancel
                self._send(("cancel", rid))

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineUnavailableError(self.unavailable_reason()) from exc

    def _read(self, conn, process) -> None:
        """Routes the child's messages to their requests until the pipe closes; then, unless the engine was
        shut down, ends the requests in flight and restarts the child."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":  # one engine turn's events
                for event in message[1]:
                    self._route(event)
            else:
                self._route(message)
        crashed = self.state == "running"
        if crashed:
            self.state = "restarting"
        self._stopped = True
        process.join(timeout=5)
        if crashed:
            reason = f"{STOPPED_UNEXPECTEDLY}; " + ("restarting" if self._may_restart() else "it is not restarted "
                                                     "again, and the server stops")
        else:
            reason = "the engine process stopped"
        with self._lock:
            pending, replies = list(self._channels), list(self._replies.values())
        for reply in replies:
            reply[1] = ("rejected", "EngineUnavailableError", reason)
            reply[0].set()
        for rid in pending:
            self._finish(rid, "error", reason, failure="engine")
        if crashed:
            self._restart(process.exitcode)

    def _route(self, message: tuple) -> None:
        kind, rid = message[0], message[1]
        with self._lock:
            channel, reply = self._channels.get(rid), self._replies.get(rid)
        if kind == "stats" and reply is not None:  # the child's only answers to _ask
            reply[1] = message
            reply[0].set()
        elif channel is None:
            return
        elif kind == "rejected":  # a submitted request the child refused
            self._finish(rid, "error", message[3])
        elif kind == "chunk":
            channel.events.put(StreamChunk(message[2], message[3], top_logprobs=message[4]))
        elif kind == "prompt_logprobs":
            channel.events.put(PromptLogprobs(message[2], message[3]))
        elif kind == "admitted":
            channel.events.put(Admitted(message[2]))
        elif kind == "done":
            self._finish(rid, message[2], message[3], *message[4:7])

    def _finish(self, rid: int, reason: str, message: str, drafted_tokens: int = 0, accepted_tokens: int = 0,
                failure: str = "") -> None:
        with self._lock:
            channel = self._channels.pop(rid, None)
            self._clients.pop(rid, None)
        if channel is not None:
            channel.events.put(Finished(reason, message, time.perf_counter(), drafted_tokens, accepted_tokens,
                                        failure))
            channel.finished.set()


class _Cancel(threading.Event):
    """A request's cancelled flag that also tells the child process, through notify: it must not wait on
    anything (see Channel.cancelled)."""

    def __init__(self, notify) -> None:
        super().__init__()
        self._notify = notify

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._notify()


class _Outbox:
    """The child's side of its requests' event queues: events wait here and go to the parent together, one
    pipe message per engine turn (Engine's after_turn), rather than one per token. Used by the child's one
    thread only."""

    def __init__(self, send) -> None:
        self._send, self._events = send, []

    def queue_for(self, rid: int) -> "_Forward":
        return _Forward(rid, self)

    def send(self, message: tuple) -> None:
        """A message of the child's own (an answer to a command), sent at once."""
        self._send(message)

    def add(self, event: tuple) -> None:
        self._events.append(event)

    def flush(self) -> None:
        events, self._events = self._events, []
        if events:
            try:
                self._send(("events", events))
            except (OSError, ValueError):
                pass  # the parent is gone; the child's main loop sees the closed pipe and stops


class _Forward:
    """A child-side request's event queue: each event goes to the parent through the outbox."""

    def __init__(self, rid: int, outbox: _Outbox) -> None:
        self.rid, self._outbox = rid, outbox

    def put(self, item) -> None:
        if isinstance(item, StreamChunk):
            self._outbox.add(("chunk", self.rid, item.token, item.logprob, item.top_logprobs))
        elif isinstance(item, PromptLogprobs):
            self._outbox.add(("prompt_logprobs", self.rid, item.values, item.alternatives))
        elif isinstance(item, Admitted):
            self._outbox.add(("admitted", self.rid, item.cached_tokens))
        elif isinstance(item, Finished):
            self._outbox.add(("done", self.rid, item.reason, item.message, item.drafted_tokens, item.accepted_tokens,
                              item.failure))


def _serve(conn, build: dict, engine_options: dict, threads: Optional[int]) -> None:
    """The child process: loads the model, runs an Engine, and serves the parent's commands. One thread does
    it all, the one that loaded the model (a second would share the interpreter, and OpenMP's workers, with
    the turns): a turn, then whatever commands came during it; with nothing to do, it waits for the next."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches both; the parent stops the child
    warnings.formatwarning = lambda message, *_: f"warning: {message}\n"  # on the parent's terminal, as its lines
    if threads:
        torch.set_num_threads(threads)
    outbox = _Outbox(conn.send)
    try:
        build = dict(build)
        seed = build.pop("seed", None)
        loaded = load(**build)
        engine = Engine(loaded, seed=seed, **engine_options, after_turn=outbox.flush)
    except BaseException as exc:  # reported to the parent, which raises it from start()
        with contextlib.suppress(OSError):  # unless the parent is gone
            conn.send(("failed", type(exc).__name__, str(exc)))
        return
    # Loaded, it stops when the parent says so: a SIGTERM to the whole group (systemd, `timeout`, Kubernetes)
    # reaches the parent too, which stops it; ended first, it would be taken for a crash and restarted.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        conn.send(("ready", loaded.info))
    except OSError:  # the parent stopped while the model loaded: no one to serve, nothing to report
        engine.close()
        return
    channels: dict[int, Channel] = {}
    try:
        serving = True
        while serving:
            worked = engine.pump()  # one turn, if a request runs or waits
            while serving and (not worked or conn.poll()):
                try:
                    serving = _obey(conn.recv(), engine, channels, outbox)
                except (EOFError, OSError):
                    serving = False  # the parent is gone
                worked = True  # a new request: a turn for it
    finally:
        engine.close()


def _obey(command: tuple, engine: Engine, channels: dict[int, Channel], outbox: _Outbox) -> bool:
    """Carries out one of the parent's commands in the child; False for "stop"."""
    if command[0] == "stop":
        return False
    if command[0] == "cancel":
        channel = channels.get(command[1])
        if channel is not None:
            channel.cancelled.set()
    elif command[0] == "stats":
        outbox.send(("stats", command[1], engine.stats()))
    else:
        _, rid, request = command
        channel = Channel(events=outbox.queue_for(rid))
        try:
            engine.add(request, channel)
        except LlamaError as exc:
            outbox.send(("rejected", rid, type(exc).__name__, str(exc)))
            return True
        channels[rid] = channel
        for done in [r for r, c in channels.items() if c.finished.is_set()]:
            del channels[done]
    return True


@contextlib.contextmanager
def _without_main_module():
    """Starts a spawned child without re-importing the parent's main script (a web app importing its UI
    toolkit, say): the child needs llama_core only, and finds _serve there."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _exception(type_name: str, message: str) -> Exception:
    """The parent-side exception for one the child raised: llama_core's own by name, else a RuntimeError
    (a MemoryError stays one), so that callers catch what they would catch in-process."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, LlamaError):
        return cls(message)
    if type_name == "MemoryError":
        return MemoryError(message)
    return RuntimeError(f"{type_name}: {message}")
