"""OpenMP's worker threads (llama_core.cpu_kernels.threads): libgomp keeps a pool of workers for every thread
that has run a parallel region, and once the pools hold more threads than there are cores it stops spinning
in every wait, so a model loaded in one thread and served from another would pay for waking its workers at
every step. Starting an engine on the CPU ends the workers of the thread that starts it. Each case runs in a
fresh interpreter, whose pools no other test has touched; the threads are counted in /proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llama_core import DEFAULT_CKPT_DIR, cpu_kernels

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts a process's threads in /proc (Linux)"),
    pytest.mark.skipif(not cpu_kernels.available(), reason="llama_core's CPU kernels are not used here (no C compiler, or neither AVX-512 nor AVX2)"),
]

THREADS = '''
import os, torch
torch.set_num_threads(2)


def threads():  # once the count holds still: a thread that has just ended may linger in /proc for a moment
    import time
    count, deadline = len(os.listdir("/proc/self/task")), time.monotonic() + 2
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(os.listdir("/proc/self/task"))
        if now == count:
            break
        count = now
    return count


def parallel_work():  # big enough for torch to split it over its two threads
    x = torch.ones(1 << 22)
    x.mul_(2)
    assert x[-1] == 2


def can_release():  # the kernels built with OpenMP, on a runtime that has omp_pause_resource_all
    import threading
    from llama_core.cpu_kernels import threads as cpu_threads
    answers = []
    thread = threading.Thread(target=lambda: answers.append(cpu_threads.release_workers()))
    thread.start()
    thread.join()
    return answers[0]
'''

CANNOT_RELEASE = "the kernels run without OpenMP, or its runtime cannot release workers (OpenMP 5.0)"


def _run(script: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", THREADS + script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_releasing_ends_the_calling_threads_workers_and_parallel_work_still_runs():
    before, worked, released, after, again = _run('''
from llama_core.cpu_kernels import threads as cpu_threads
if not can_release():
    print("- - False - -")
    raise SystemExit
before = threads()
parallel_work()
worked = threads()
released = cpu_threads.release_workers()
after = threads()
parallel_work()  # starts a new pool
print(before, worked, released, after, threads())
''')
    if released == "False":
        pytest.skip(CANNOT_RELEASE)
    assert int(worked) == int(before) + 1  # the second of two threads: a worker of the calling thread's pool
    assert released == "True"
    assert int(after) == int(before)
    assert int(again) == int(worked)


@pytest.mark.skipif(not (DEFAULT_CKPT_DIR / "params.json").is_file(), reason="the embedded default model is absent")
def test_starting_an_engine_on_the_cpu_ends_the_loading_threads_workers():
    """The engine's thread becomes the only one with workers: right after start() (no request yet, so the
    engine's thread has run no region) the process has as many threads as before, its own replacing the
    loading thread's worker; and the engine still answers."""
    before, started, text = _run('''
if not can_release():
    print("- - -")
    raise SystemExit
from llama_core import load
from llama_core.serving import Engine, stream_completion
loaded = load(max_seq_len=64, max_batch_size=2)
parallel_work()  # the loading thread has its pool, whatever loading itself ran
before = threads()
engine = Engine(loaded, seed=0).start()
started = threads()
text = "".join(chunk.text for chunk in stream_completion(engine, "ROMEO:", 0.0, 1.0, 8))
engine.shutdown()
print(before, started, repr(text).replace(" ", "_"))
''')
    if before == "-":
        pytest.skip(CANNOT_RELEASE)
    assert int(started) == int(before)
    assert text not in ("''", '""')
