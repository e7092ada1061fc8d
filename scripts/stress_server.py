"""Stress the running app over loopback: every class of bad input to each route, and the web process's
memory over many requests.

Starts `python app.py` (the embedded model, or --ckpt-dir) on a free port, then:
1. sends each bad input below over raw HTTP to Gradio's /complete and /chat and to the OpenAI routes, and
   checks that each answer names the problem (never a null message, never a 500) and that a normal request
   right after it succeeds;
2. sends --requests small requests (after --warm-up ones) and reports how much the web process's resident
   memory grew per request (the engine's process is not counted).
Bounded in count and time; nothing leaves this machine.

    python scripts/stress_server.py --requests 1000 --warm-up 200
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
GOOD_COMPLETE = ["ROMEO:", 0.0, 0.9, 4, False, False, 0, 0.0, 1.0, 0.0, 0.0, None, None, "text", ""]
GOOD_CHAT = ["Good morrow", [], "", 0.0, 0.9, 4, 0, 0.0, 1.0, 0.0, 0.0, None, None, "text", ""]
HUGE = 10**400

# (route, data or body, what the answer must mention); Gradio routes take the data list.
BAD_GRADIO = [
    ("complete", ["ROMEO:"], "the /complete route takes 15 values (prompt, temperature, "),
    ("complete", [], "takes 15 values"),
    ("complete", [123, *GOOD_COMPLETE[1:]], "prompt"),
    ("complete", ["", *GOOD_COMPLETE[1:]], "prompt"),
    ("complete", ["\ud800", *GOOD_COMPLETE[1:]], "prompt"),
    ("complete", ["x" * 200_000, *GOOD_COMPLETE[1:]], "prompt"),
    ("complete", ["ROMEO:", "hot", *GOOD_COMPLETE[2:]], "temperature"),
    ("complete", ["ROMEO:", HUGE, *GOOD_COMPLETE[2:]], "temperature"),
    ("complete", ["ROMEO:", 0.5, HUGE, *GOOD_COMPLETE[3:]], "top_p"),
    ("complete", ["ROMEO:", 0.5, 0.9, -4, *GOOD_COMPLETE[4:]], "max_new_tokens"),
    ("complete", ["ROMEO:", 0.5, 0.9, HUGE, *GOOD_COMPLETE[4:]], "max_new_tokens"),
    ("complete", ["ROMEO:", 0.5, 0.9, 4, "yes", *GOOD_COMPLETE[5:]], "echo"),
    ("complete", [*GOOD_COMPLETE[:6], -1, *GOOD_COMPLETE[7:]], "top_k"),
    ("complete", [*GOOD_COMPLETE[:8], 0, *GOOD_COMPLETE[9:]], "repetition_penalty"),
    ("complete", [*GOOD_COMPLETE[:11], ["a", ""], *GOOD_COMPLETE[12:]], "stop"),
    ("complete", [*GOOD_COMPLETE[:12], HUGE, *GOOD_COMPLETE[13:]], "seed"),
    ("complete", [*GOOD_COMPLETE[:13], "xml", ""], "output_format"),
    ("complete", [*GOOD_COMPLETE[:13], "json_schema", '{"type": "foo"}'], "output_grammar"),
    ("complete", [*GOOD_COMPLETE[:13], "regex", ""], "output_grammar"),
    ("chat", ["hi"], "the /chat route takes 15 values (message, history, "),
    ("chat", GOOD_CHAT[:6], "takes 15 values"),
    ("chat", [*GOOD_CHAT, 0.5], "takes 15 values"),
    ("chat", [*GOOD_CHAT[:13], "lark", "start: nowhere"], "output_grammar"),
    ("chat", [None, *GOOD_CHAT[1:]], "message"),
    ("chat", ["hi", "not a list", *GOOD_CHAT[2:]], "history"),
    ("chat", ["hi", [{"role": "user"}], *GOOD_CHAT[2:]], "history[0]"),
    ("chat", ["hi", [{"role": "bot", "content": "x"}], *GOOD_CHAT[2:]], "history[0]"),
    ("chat", ["hi", [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}], *GOOD_CHAT[2:]],
     "history[0]"),
    ("chat", ["hi", [{"role": "user", "content": "x"}], *GOOD_CHAT[2:]], "history"),
    ("chat", ["hi\ud800", *GOOD_CHAT[1:]], "message"),
    ("chat", ["hi", [], 5, *GOOD_CHAT[3:]], "system_prompt"),
    ("chat", ["x " * 20_000, *GOOD_CHAT[1:]], "token"),
]
BAD_OPENAI = [
    ("chat/completions", '{"messages": [', "JSON"),
    ("chat/completions", "[1]", "JSON object"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": HUGE}, "temperature"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "1"}, "temperature"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 20_000}]}, "context"),
    ("completions", {"prompt": ["a", 1]}, "prompt"),
    ("completions", {"prompt": [1, 10**9]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [-4]]}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "a", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "a", "seed": HUGE}, "seed"),
    ("completions", {"prompt": "a", "stop": ["a"] * 9}, "stop"),
    ("completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                        "schema": {"type": "foo"}}}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
     "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "a b"}}]}, "tools[0].function.name"),
    ("responses", {"input": 5}, "input"),
    ("responses", {"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ("responses", {"input": [{"type": "reasoning"}]}, "input[0]"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(ckpt_dir: Optional[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--max-seq-len", "256"]
    command += ["--ckpt-dir", ckpt_dir] if ckpt_dir else []
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the app exited with code {process.returncode}")
        try:
            if httpx.get(url + "health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the app did not start within 180 s")


def gradio_call(http: httpx.Client, url: str, route: str, data: Any) -> tuple[str, Any]:
    """(last event's name, its data) of one raw-HTTP call of a Gradio route, or ("http <status>", body)."""
    body = json.dumps({"data": data}, allow_nan=False).encode("utf-8", "surrogatepass")
    posted = http.post(url + f"gradio_api/call/{route}", content=body, headers={"Content-Type": "application/json"})
    if posted.status_code != 200:
        return f"http {posted.status_code}", posted.text
    event, payload = None, None
    with http.stream("GET", url + f"gradio_api/call/{route}/{posted.json()['event_id']}") as events:
        for line in events.iter_lines():
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                payload = json.loads(line.removeprefix("data:"))
    return event or "none", payload


def openai_call(http: httpx.Client, url: str, route: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body).encode("utf-8", "surrogatepass")
    return http.post(url + f"v1/{route}", content=content, headers={"Content-Type": "application/json"})


def check_bad_inputs(http: httpx.Client, url: str) -> list[str]:
    """Each bad input's answer must name the problem, and a normal request must succeed after it."""
    problems = []
    for route, data, mention in BAD_GRADIO:
        event, payload = gradio_call(http, url, route, data)
        message = payload.get("error") if isinstance(payload, dict) else None
        if event != "error" or not message or mention.lower() not in message.lower():
            problems.append(f"gradio /{route} {str(data)[:60]}: {event} {str(payload)[:160]}")
        good = gradio_call(http, url, route, GOOD_COMPLETE if route == "complete" else GOOD_CHAT)
        if good[0] != "complete":
            problems.append(f"gradio /{route}: a normal request after {str(data)[:40]} failed: {good}")
    for route, body, mention in BAD_OPENAI:
        answer = openai_call(http, url, route, body)
        error = answer.json().get("error", {}) if answer.headers.get("content-type", "").startswith("application/json") else {}
        if answer.status_code != 400 or not error.get("message") or mention.lower() not in error["message"].lower():
            problems.append(f"openai /v1/{route} {str(body)[:60]}: {answer.status_code} {answer.text[:160]}")
        good = openai_call(http, url, "completions", {"prompt": "ROMEO:", "max_tokens": 4})
        if good.status_code != 200:
            problems.append(f"openai: a normal request after {str(body)[:40]} failed: {good.status_code}")
    return problems


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def memory_per_request(http: httpx.Client, url: str, pid: int, warm_up: int, requests: int, routes: str) -> dict:
    def one(i: int) -> None:
        if routes == "gradio" or (routes == "both" and i % 2):
            gradio_call(http, url, "complete", GOOD_COMPLETE)
        else:
            openai_call(http, url, "completions", {"prompt": "ROMEO:", "max_tokens": 4})

    for i in range(warm_up):
        one(i)
    before, started = rss_mb(pid), time.perf_counter()
    for i in range(requests):
        one(i)
    after = rss_mb(pid)
    return {"requests": requests, "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "kb_per_request": round((after - before) * 1024 / requests, 2),
            "requests_per_s": round(requests / (time.perf_counter() - started), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warm-up", type=int, default=200)
    p.add_argument("--routes", choices=("both", "gradio", "openai"), default="both",
                   help="which routes the memory run calls: Gradio's /complete, /v1/completions, or both in turn")
    p.add_argument("--skip-bad-inputs", action="store_true", help="only the memory run")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args()
    process, url = start_app(a.ckpt_dir)
    try:
        with httpx.Client(timeout=60) as http:
            problems = [] if a.skip_bad_inputs else check_bad_inputs(http, url)
            print(f"bad inputs: {len(BAD_GRADIO)} to Gradio's routes, {len(BAD_OPENAI)} to the OpenAI routes; "
                  f"{len(problems)} answered badly", flush=True)
            for problem in problems:
                print(f"  {problem}", flush=True)
            memory = memory_per_request(http, url, process.pid, a.warm_up, a.requests, a.routes)
            print(f"memory ({a.routes}): {memory['rss_before_mb']} -> {memory['rss_after_mb']} MB over {a.requests} requests "
                  f"after {a.warm_up} to warm up: {memory['kb_per_request']} KB per request "
                  f"({memory['requests_per_s']} requests/s)", flush=True)
            healthy = httpx.get(url + "health", timeout=5).status_code == 200
            print(f"healthy at the end: {healthy}")
    finally:
        process.terminate()
        process.wait(timeout=30)
    if a.json:
        a.json.write_text(json.dumps({"problems": problems, "memory": memory, "healthy": healthy}, indent=2) + "\n")
    return 0 if not problems and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
