"""Serving benchmark: N concurrent clients stream completions from the running app over its HTTP API
(Gradio's, or with --client openai its OpenAI-compatible /v1/completions; or gradio_client; or with
--engine-only straight from llama_core's Engine in-process), once with one
engine slot (requests served one after another) and once with --slots slots (continuous batching).
Reports aggregate tokens/s, time to first token and per-token latency (p50/p95) for both, and the
batched/serial ratio; with --runs N the two take turns N times and the median ratio is reported.

    python scripts/bench_serving.py --clients 8 --slots 8 --requests 4 --max-new-tokens 64 --runs 7

With --llama-server DIR the two configurations are llama.cpp's llama-server and our app, each with --slots
slots and --threads threads, on the same model (exported, converted to GGUF f32), called by the same
clients (llama-server through its /v1/completions); the ratio is ours over llama-server's, and with
--temperature 0 the greedy texts of the two are compared. With --gradio-floor they are a Gradio app with the
same /complete route and no model (scripts/gradio_floor_app.py) and our app: what Gradio itself costs. With
--served-before N each server first answers N one-token requests, as a server that has been up a while has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
STREAM_UPDATE_SECONDS = 0.1  # as the app streams (llama_core.app.streaming)
PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder",
    "First Citizen:\nBefore we proceed any further,",
    "KING HENRY VI:\nO God! methinks it were a happy life",
    "JULIET:\nGood night, good night! parting is",
    "GLOUCESTER:\nNow is the winter of our discontent",
    "MENENIUS:\nI tell you, friends, most charitable care",
    "LADY CAPULET:\nWhat say you? can you love the gentleman?",
    "PETRUCHIO:\nI pray you do; I will attend her here,",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=4,
                   help="requests per client: clients x requests in all, each client taking the next when its last ends")
    p.add_argument("--slots", type=int, default=8, help="engine slots (--max-batch-size) for the batched run")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--ckpt-dir", default=None, help="model to serve (default: the embedded model)")
    p.add_argument("--engine-only", action="store_true",
                   help="drive llama_core's Engine in-process with the same workload (no HTTP, no Gradio)")
    p.add_argument("--client", choices=("http", "openai", "gradio_client"), default="http",
                   help="how the app is called: its Gradio HTTP API with server-sent events (as curl and the browser "
                        "do), its OpenAI-compatible API (streaming /v1/completions, as OpenAI clients call it), "
                        "or gradio_client")
    p.add_argument("--runs", type=int, default=1,
                   help="serial and batched runs, taking turns; the ratio reported is their median")
    p.add_argument("--gradio-floor", action="store_true",
                   help="compare our app with a Gradio app that has the same /complete route and no model "
                        "(scripts/gradio_floor_app.py), both called through --client http or gradio_client: "
                        "what Gradio itself costs a request")
    p.add_argument("--served-before", type=int, default=0, metavar="N",
                   help="each server first answers N one-token requests from the clients, as one that has been "
                        "up a while has (Gradio keeps a record of its last 10,000 events)")
    p.add_argument("--compile", action="store_true", help="our engine with its compiled decode step (--compile)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="compute threads of the engine (and of llama-server); default: the app's own on CPU")
    p.add_argument("--llama-server", type=Path, default=None, metavar="DIR",
                   help="compare with llama.cpp's llama-server (built in DIR by ../shared/peers/build_llama_cpp.sh) "
                        "on the same model, both with --slots slots, instead of serial against batched")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = p.parse_args()
    if a.gradio_floor and (a.llama_server or a.engine_only or a.client == "openai"):
        p.error("--gradio-floor compares Gradio routes: not with --llama-server, --engine-only or --client openai")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(slots: int, ckpt_dir, threads: int, compile: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--max-batch-size", str(slots),
               "--threads", str(threads)] + (["--compile"] if compile else [])
    if ckpt_dir:
        command += ["--ckpt-dir", ckpt_dir]
    return _serve(command, port)


def start_gradio_floor() -> tuple[subprocess.Popen, str]:
    """scripts/gradio_floor_app.py: the app's /complete in Gradio, answering canned text with no model."""
    port = free_port()
    return _serve([sys.executable, str(ROOT / "scripts" / "gradio_floor_app.py"), "--port", str(port)], port)


def _serve(command: list[str], port: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("app did not start within 180 s")


Request = Callable[[int, str, argparse.Namespace], tuple[Optional[float], int, str]]  # first text at, tokens, text


def http_request(url: str, clients: int) -> Request:
    """One /complete request of client i through the app's HTTP API, as curl or a browser streams it: POST
    /gradio_api/call/complete, then read the server-sent events of its GET: (time of the first text, tokens
    generated). Each client keeps one HTTP connection open and one session through every run, as a browser
    tab does (Gradio builds a session's state, a copy of every component's config, on its first call)."""
    import httpx

    endpoint = url + "gradio_api/call/complete"
    tls = ssl.create_default_context()  # one for all: httpx would build one per client (see below)
    pool = [(httpx.Client(timeout=120, verify=tls), uuid.uuid4().hex) for _ in range(clients)]

    def request(i: int, prompt: str, a: argparse.Namespace) -> tuple[Optional[float], int]:
        http, session = pool[i]
        # Raw HTTP sends every parameter, the optional sampling controls at their defaults too.
        arguments = [prompt, a.temperature, 0.95, a.max_new_tokens, False, False, 0, 0.0, 1.0, 0.0, 0.0, None, None, "text", ""]
        call = http.post(endpoint, json={"data": arguments, "session_hash": session})
        call.raise_for_status()
        first, event = None, None
        with http.stream("GET", f"{endpoint}/{call.json()['event_id']}") as events:
            for line in events.iter_lines():
                if line.startswith("event:"):
                    event = line.removeprefix("event:").strip()
                elif line.startswith("data:"):
                    data = json.loads(line.removeprefix("data:"))
                    if event == "error":
                        raise RuntimeError(f"the app answered an error: {data}")
                    text, _, stats = data[0]
                    if first is None and text:
                        first = time.perf_counter()
                    if event == "complete":
                        return first, stats["generated_tokens"], text
        raise RuntimeError("the event stream ended without a complete event")

    return request


def openai_request(url: str, clients: int) -> Request:
    """One streaming /v1/completions request of client i, as an OpenAI client sends it (the usage of its last
    event counts the tokens, or else its events do, one token each as llama-server sends them): (time of the
    first text, tokens generated, text). Each client keeps one connection."""
    import httpx

    pool = [httpx.Client(timeout=120) for _ in range(clients)]

    def request(i: int, prompt: str, a: argparse.Namespace) -> tuple[Optional[float], int, str]:
        try:
            return attempt(i, prompt, a)
        except httpx.RemoteProtocolError:  # the server closed the idle kept-alive connection as it was reused
            return attempt(i, prompt, a)

    def attempt(i: int, prompt: str, a: argparse.Namespace) -> tuple[Optional[float], int, str]:
        body = {"prompt": prompt, "temperature": a.temperature, "top_p": 0.95, "max_tokens": a.max_new_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        first, tokens, pieces = None, None, []
        with pool[i].stream("POST", url + "v1/completions", json=body) as events:
            if events.status_code != 200:
                raise RuntimeError(f"the API answered {events.status_code}: {events.read().decode()[:200]}")
            for line in events.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"the API answered an error: {data['error']}")
                if data["choices"] and data["choices"][0]["text"]:
                    first = first or time.perf_counter()
                    pieces.append(data["choices"][0]["text"])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        return first, len(pieces) if tokens is None else tokens, "".join(pieces)

    return request


def gradio_client_request(url: str, clients: int) -> Request:
    """One /complete request of client i through gradio_client: (time of the first text, tokens generated).
    The clients are connected before any timing starts (each fetches and parses the app's API description). gradio_client
    checks for new messages every 50 ms, which a closed-loop client adds to each request."""
    from gradio_client import Client

    # gradio_client opens a new httpx connection per call, and httpx builds an SSL context (loading the CA
    # bundle, tens of ms of CPU) for each unless given one: share one, so the clients, which run on the
    # server's own cores here, don't take that CPU from it. The URL is plain http; nothing is verified.
    tls = ssl.create_default_context()
    pool = [Client(url, verbose=False, ssl_verify=tls) for _ in range(clients)]

    def request(i: int, prompt: str, a: argparse.Namespace) -> tuple[Optional[float], int]:
        first = None
        job = pool[i].submit(prompt, a.temperature, 0.95, a.max_new_tokens, False, False, api_name="/complete")
        for text, _, _ in job:
            if first is None and text:
                first = time.perf_counter()
        return first, job.outputs()[-1][2]["generated_tokens"], job.outputs()[-1][0]

    return request


def engine_request(engine) -> Request:
    """The same request straight to llama_core's Engine, read as the app reads it: in batches, at most one
    every STREAM_UPDATE_SECONDS."""
    from llama_core.serving import stream_completion

    def request(i: int, prompt: str, a: argparse.Namespace) -> tuple[Optional[float], int]:
        first, text = None, ""
        stream = stream_completion(engine, prompt, a.temperature, 0.95, a.max_new_tokens)
        for chunks in stream.batches(STREAM_UPDATE_SECONDS):
            if first is None and any(chunk.text for chunk in chunks):
                first = time.perf_counter()
            text += "".join(chunk.text for chunk in chunks)
        return first, stream.generated_tokens, text

    return request


def run_clients(request: Request, a: argparse.Namespace) -> dict:
    """a.clients clients send a.clients * a.requests requests in all, as `ab -n ... -c ...` does: each takes
    the next one as soon as its previous one ends, so a client whose replies end early (at end of text)
    takes more of them, and the run does not end with some clients done while others work through their
    share."""
    records, errors, lock = [], [], threading.Lock()
    jobs = iter(range(a.clients * a.requests))

    def client_loop(index: int) -> None:
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            start = time.perf_counter()
            try:
                first, tokens, text = request(index, PROMPTS[job % len(PROMPTS)], a)
            except Exception as exc:  # noqa: BLE001 - reported, not raised: one failure must not end the run
                with lock:
                    errors.append(str(exc))
                continue
            end = time.perf_counter()
            with lock:
                records.append({"start": start, "first": first or end, "end": end, "tokens": tokens,
                                "prompt": job % len(PROMPTS), "text": text})

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(a.clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    ttft = [r["first"] - r["start"] for r in records]
    per_token = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return {
        "requests": len(records),
        "errors": errors,
        "tokens": sum(r["tokens"] for r in records),
        "wall_s": wall,
        "aggregate_tokens_per_s": sum(r["tokens"] for r in records) / wall,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "per_token_p50_s": _percentile(per_token, 50),
        "per_token_p95_s": _percentile(per_token, 95),
        "texts": {r["prompt"]: r["text"] for r in records},
    }


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:  # llama-server can wait on its clients' kept-alive connections
        process.kill()
        process.wait(timeout=15)


def start_llama_server(a: argparse.Namespace, stack: contextlib.ExitStack) -> str:
    """llama.cpp's llama-server on the same model: exported to Hugging Face's layout (llama_core.export),
    converted to GGUF f32 by llama.cpp's converter, a.slots parallel sequences of the same context as ours,
    a.threads threads. Returns its URL once it answers /health."""
    import tempfile

    import httpx

    sys.path.insert(0, str(ROOT))
    from llama_core.export import export_hf
    from llama_core.resources import DEFAULT_CKPT_DIR
    from llama_cpp_peer import LlamaCpp

    peer = LlamaCpp(a.llama_server)
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    exported = export_hf(Path(a.ckpt_dir) if a.ckpt_dir else DEFAULT_CKPT_DIR, folder / "hf")
    gguf = peer.convert(folder / "hf", folder / "model-f32.gguf", "f32")
    port = free_port()
    log = stack.enter_context(tempfile.TemporaryFile("w+"))
    process = peer.server(gguf, port, a.threads, a.slots, context=exported.max_position_embeddings, log=log)
    stack.callback(_stop, process)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited with code {process.returncode}: {log.read()[-1000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "health", timeout=2).status_code == 200:
                return url
        time.sleep(0.5)
    raise RuntimeError("llama-server did not start within 120 s")


def main() -> None:
    a = parse_args()
    if a.llama_server:
        from llama_cpp_peer import LlamaCpp, PeerError

        try:
            LlamaCpp(a.llama_server)
        except PeerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    report = {"clients": a.clients, "requests_per_client": a.requests, "max_new_tokens": a.max_new_tokens,
              "threads": a.threads, "compile": a.compile}
    report["through"] = "engine" if a.engine_only else f"app ({a.client})"
    warm_up = argparse.Namespace(**{**vars(a), "requests": 1})  # every client once: its connection and session
    if a.llama_server:
        configurations = (("llama_server", a.slots), ("llama_core", a.slots))
    elif a.gradio_floor:
        configurations = (("gradio_floor", a.slots), ("llama_core", a.slots))
    else:
        configurations = (("serial", 1), ("batched", a.slots))
    client = {"http": http_request, "openai": openai_request, "gradio_client": gradio_client_request}[a.client]
    with contextlib.ExitStack() as stack:
        requests = {}
        for name, slots in configurations:  # both servers up at once, so their runs can take turns
            if name == "llama_server":
                requests[name] = openai_request(start_llama_server(a, stack), a.clients)
            elif a.engine_only:
                sys.path.insert(0, str(ROOT))
                import torch

                from llama_core import Engine, load

                torch.set_num_threads(a.threads)
                loaded = load(a.ckpt_dir, max_seq_len=512, max_batch_size=slots, compile=a.compile)
                engine = stack.enter_context(Engine(loaded, seed=0))
                requests[name] = engine_request(engine)
            else:
                process, url = (start_gradio_floor() if name == "gradio_floor"
                                else start_app(slots, a.ckpt_dir, a.threads, a.compile))
                stack.callback(_stop, process)
                requests[name] = client(url, a.clients)
        for name in requests:
            run_clients(requests[name], warm_up)
        if a.served_before:
            per_client = -(-a.served_before // a.clients)
            before = argparse.Namespace(**{**vars(a), "requests": per_client, "max_new_tokens": 1})
            report["served_before"] = {}
            for name in requests:
                served = run_clients(requests[name], before)
                report["served_before"][name] = {k: served[k] for k in ("requests", "wall_s", "errors")}
                print(f"{name} first served {served['requests']} one-token requests in {served['wall_s']:.1f} s "
                      f"({served['requests'] / served['wall_s']:.0f}/s, {len(served['errors'])} errors)", flush=True)
        runs = []
        for _ in range(a.runs):
            runs.append({name: {"slots": slots, **run_clients(requests[name], a)} for name, slots in configurations})
    (base, _), (measured, _) = configurations
    for run in runs:
        for name, _ in configurations:
            if not run[name]["tokens"]:
                sys.exit(f"{name} served no tokens; its errors: {run[name]['errors'][:3]}")
    ratios = [run[measured]["aggregate_tokens_per_s"] / run[base]["aggregate_tokens_per_s"] for run in runs]
    for name, _ in configurations:  # the figures of the run whose ratio is the median
        report[name] = runs[ratios.index(statistics.median_low(ratios))][name]
        r, slots = report[name], report[name]["slots"]
        through = ("llama-server (/v1/completions)" if name == "llama_server" else
                   f"Gradio without a model ({a.client})" if name == "gradio_floor" else report["through"])
        print(f"{through} {name:>8} ({slots} slot{'s' if slots > 1 else ''}): {r['aggregate_tokens_per_s']:.1f} tok/s aggregate, "
              f"TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms / p95 {r['ttft_p95_s'] * 1000:.0f} ms, "
              f"per token p50 {r['per_token_p50_s'] * 1000:.1f} ms / p95 {r['per_token_p95_s'] * 1000:.1f} ms, "
              f"{r['requests']} requests, {len(r['errors'])} errors", flush=True)
    report["runs"], report["ratios"] = runs, ratios
    report[f"{measured}_over_{base}"] = statistics.median(ratios)
    print(f"aggregate throughput, {measured} / {base}: {statistics.median(ratios):.2f}x"
          + (f" (median of {len(ratios)} runs taking turns: {', '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""))
    # A run's first-token p50 moves by milliseconds from run to run here: the median over the runs is steadier.
    report["ttft_p50_s_median_of_runs"] = {name: statistics.median(run[name]["ttft_p50_s"] for run in runs)
                                           for name, _ in configurations}
    print("time to first token, median of the runs' p50s: " + ", ".join(
        f"{name} {seconds * 1000:.1f} ms" for name, seconds in report["ttft_p50_s_median_of_runs"].items()))
    if a.temperature == 0 and not a.gradio_floor:
        texts = [report[name]["texts"] for name, _ in configurations]
        common = sorted(set(texts[0]) & set(texts[1]))
        report["identical_greedy_texts"] = sum(texts[0][i] == texts[1][i] for i in common)
        print(f"greedy texts identical for {report['identical_greedy_texts']} of {len(common)} prompts")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
