"""Prometheus metrics of a server, for GET /metrics: the engine's counters, read at each scrape, and the replies the
server streams (its page's and its API's), counted as their readers read them.

prometheus_client keeps the counts and writes the text format. Each server keeps its metrics in a
CollectorRegistry of its own, never the library's global one, so that two servers in one process (tests make
many) count apart.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import LlamaError
from ..serving.events import FINISH_REASONS
from ..serving.streams import TextEngine, TokenStream

CONTENT_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text format, as exposition() writes it
SCRAPE_ANSWER_SECONDS = 5.0  # a scrape's wait for a model process's counters (Prometheus gives up after 10 s)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# The engine's counters (Engine.stats) as metrics: (name after llama_core_engine_, its key in stats, help)
ENGINE_GAUGES = (
    ("requests_running", "active", "Requests holding a slot of the engine (prefilling or decoding)."),
    ("requests_waiting", "waiting", "Requests waiting for a free slot."),
)
ENGINE_COUNTERS = (
    ("decode_steps", "steps", "Batched decode steps the engine has run."),
    ("prompt_tokens_computed", "prefilled_tokens", "Prompt tokens the engine has computed (prefilled)."),
    ("prompt_tokens_cached", "cached_tokens", "Prompt tokens the engine found in its prefix cache instead of "
                                              "computing them."),
    ("generated_tokens", "generated_tokens", "Tokens the engine has generated for requests, whoever reads them "
                                             "(end-of-sequence tokens left out)."),
)
SLOTS_HELP = "Slots of the engine's KV cache: the most requests it runs at once (max_batch_size)."
UNRESPONSIVE_HELP = ("1 when the engine did not answer this scrape (its process stopped, restarting or stuck), its "
                     "running, waiting and counted figures then left out; else 0.")

log = logging.getLogger(__name__)


class EngineCollector(Collector):
    """The engine's counters, asked for at each scrape; where the engine does not answer, what is known without
    it, and llama_core_engine_unresponsive at 1. A scrape never fails for the engine."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        """The metrics' names, without asking the engine (the registry checks them for clashes)."""
        return [GaugeMetricFamily(f"llama_core_engine_{name}", text) for name, _, text in ENGINE_GAUGES] + [
            CounterMetricFamily(f"llama_core_engine_{name}", text) for name, _, text in ENGINE_COUNTERS] + [
            GaugeMetricFamily("llama_core_engine_slots", SLOTS_HELP),
            GaugeMetricFamily("llama_core_engine_unresponsive", UNRESPONSIVE_HELP)]

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        info = self.engine.info
        if info is not None:
            yield GaugeMetricFamily("llama_core_engine_slots", SLOTS_HELP, value=info.max_batch_size)
        yield GaugeMetricFamily("llama_core_engine_unresponsive", UNRESPONSIVE_HELP, value=int(stats is None))
        if stats is None:
            return
        for name, key, text in ENGINE_GAUGES:
            yield GaugeMetricFamily(f"llama_core_engine_{name}", text, value=stats[key])
        for name, key, text in ENGINE_COUNTERS:
            yield CounterMetricFamily(f"llama_core_engine_{name}", text, value=stats[key])

    def _stats(self) -> Optional[dict[str, int]]:
        """The engine's counters, or None where it does not answer."""
        try:
            return self.engine.stats(SCRAPE_ANSWER_SECONDS)
        except LlamaError:  # its process ended a moment ago, or is restarting
            return None
        except Exception:  # noqa: BLE001 - a scrape reports the engine as not answering rather than failing
            log.exception("the engine's counters could not be read for /metrics")
            return None


class ServerMetrics:
    """A server's metrics, in its own `registry`: the engine's (EngineCollector), and its replies' (this is the
    RequestMeter that the text stream of each request submitted through a MeteredEngine tells)."""

    def __init__(self, engine: TextEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.time_to_first_token = Histogram(
            "llama_core_time_to_first_token_seconds", "Time from a request's submission to the first token of its "
            "reply, as the server's reader got it (queueing and prefill included).", buckets=FIRST_TOKEN_BUCKETS,
            registry=self.registry)
        self.request_duration = Histogram(
            "llama_core_request_duration_seconds", "Time from a request's submission to the end of its reply.",
            buckets=REQUEST_BUCKETS, registry=self.registry)
        self.requests_finished = Counter(
            "llama_core_requests_finished", "Replies ended, by reason: eos (the model ended it), stop (a stop "
            "string), length (its token limit or the context), cancelled (its client left or stopped it) or error.",
            ["reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # each shown from the start, at 0
            self.requests_finished.labels(reason)
        self.generated_tokens = Counter(
            "llama_core_generated_tokens", "Tokens of the replies the server streamed (its page and its API), as "
            "their readers got them.", registry=self.registry)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def request_ended(self, reason: str, seconds: float, generated_tokens: int) -> None:
        self.request_duration.observe(seconds)
        self.requests_finished.labels(reason).inc()
        self.generated_tokens.inc(generated_tokens)

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (media type CONTENT_TYPE)."""
        return generate_latest(self.registry)


class MeteredEngine:
    """An engine as a server serves it: the text stream of each request submitted through it tells the server's
    `metrics` of its reply; everything else is the engine's own. A server gives its page and its API the same one,
    so that GET /metrics counts the replies of both."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine)

    def submit(self, *args: Any, **kwargs: Any) -> TokenStream:
        """As the engine's submit (Engine.submit); the stream's reply is counted."""
        stream = self.engine.submit(*args, **kwargs)
        stream.meter = self.metrics
        return stream

    def __getattr__(self, name: str) -> Any:  # tokenizer, info, capacity, stats, alive, state, drain...
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)
