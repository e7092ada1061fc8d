"""The web process's memory stays bounded under API traffic: Gradio's /complete and the OpenAI-compatible
/v1/completions called in turn, as scripts/stress_server.py calls them, the engine in a process of its own.

The app runs in this process (tests/app_server.py), so its resident memory is this process's. Gradio keeps
the state of each API call's session, up to server.SESSION_CAPACITY sessions (~180 KB each), and a record of
each queued event, up to GRADIO_ANALYTICS_MAX_EVENTS (10,000 by default, ~1 KB each). The test lowers both
bounds so that these stores fill during warm-up; what it measures after is what a long-running server grows
by once every store is full. Each of several batches of requests is measured, and the median batch judged:
a leak grows every batch, while the allocator grows the heap now and then, in steps. What remains (~2 KB per
request here) is largely Gradio's message queue for each API session, which it keeps for its last 2,000 sessions.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from app_server import REPO_ROOT, serve_app
from llama_core.app import server

WARM_UP = 100  # requests before measuring: half to Gradio, more than KEPT below
BATCHES, BATCH = 6, 50  # requests measured: 300
KEPT = 16  # sessions and event records Gradio keeps here
CLIENTS = 4  # requests under way at once, as a few users' would be
MAX_KB_PER_REQUEST = 10  # ~2.3 KB measured; a session kept per Gradio call would be ~90 KB per request


@pytest.fixture(scope="module")
def stress_server():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import stress_server
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    return stress_server


def resident_kb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 1024


def test_web_process_memory_per_request_stays_bounded(monkeypatch, stress_server):
    monkeypatch.setattr(server, "SESSION_CAPACITY", KEPT)
    monkeypatch.setenv("GRADIO_ANALYTICS_MAX_EVENTS", str(KEPT))  # read when server.web_app starts the queue
    with serve_app() as (_, url), httpx.Client(timeout=60) as http:
        def request(i: int) -> None:
            if i % 2:
                event, payload = stress_server.gradio_call(http, url, "complete", stress_server.GOOD_COMPLETE)
                assert event == "complete", payload
            else:
                answer = stress_server.openai_call(http, url, "completions", {"prompt": "ROMEO:", "max_tokens": 4})
                assert answer.status_code == 200, answer.text

        with ThreadPoolExecutor(CLIENTS) as clients:
            list(clients.map(request, range(WARM_UP)))
            resident, started = [resident_kb()], time.perf_counter()
            for _ in range(BATCHES):
                list(clients.map(request, range(BATCH)))
                resident.append(resident_kb())
            seconds = time.perf_counter() - started
    growth = [round(after - before) for before, after in zip(resident, resident[1:])]
    per_request = statistics.median(growth) / BATCH
    assert per_request < MAX_KB_PER_REQUEST, (
        f"the web process grew by {per_request:.1f} KB per request (median of batches of {BATCH}, each growing "
        f"by {growth} KB; {BATCHES * BATCH / seconds:.0f} requests/s) after {WARM_UP} to warm up")
