"""Fairness benchmark: what a light client's requests wait while a heavy client floods the engine, under the
token-fair admission rule (the Virtual Token Counter of llama_core.serving.scheduler) and under the rule it
replaced (a free slot to the client with the fewest requests running), side by side in one run, on the
embedded model on the CPU.

    OMP_NUM_THREADS=1 python scripts/bench_fairness.py

Two scenarios, each run for --seconds under each rule in turn, on a fresh engine each time:
  chat  "heavy" keeps --heavy-concurrency long requests outstanding (more than the slots: some always wait);
        "light" sends one short request at a time, the next a pause after the last ends (drawn evenly from 0
        to twice --light-pause), as a chat user does. (With no pause, light's next request would often take
        the slot its last one left, before the engine's next turn gives it to heavy.)
  busy  both keep --slots requests outstanding, so each alone would fill every slot: the same demand in
        requests, but heavy's requests are longer. This is where counting tokens differs from counting requests.
The rules:
  tokens    the scheduler as it is.
  requests  the rule before a9cd67d, had by setting scheduler.PROMPT_TOKEN_WEIGHT = OUTPUT_TOKEN_WEIGHT = 0:
            service() is then 0 for every request, so every counter stays 0 (a client arriving is lifted to
            the least counter, 0; a request leaving its slot adds 0), and the admission key (counter, requests
            running, queue order) is decided by requests running, then queue order: the old rule exactly.
  fcfs      no client named: every request is anonymous, one client, first come first served (no fairness).
Reported for light: time to first token and to its reply's end, median and p90, over the requests it sent in
the window; for both clients, the tokens generated (and prompt tokens computed) per second in the window. Greedy,
end of text banned by logit_bias so every reply has the length asked for: drawn evenly from half to one and a
half times --heavy-new or --light-new for each request (replies all of one length fall into step with each
other, and the waits into a few fixed values whose median jumps from one to another between runs); prompts are
random token ids, new for each request, so the prefix cache finds nothing to reuse; prompt lookup is off (its
drafts would make a step's tokens depend on the text, not on who holds the slots).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from llama_core import Engine, load  # noqa: E402
from llama_core.errors import LlamaError  # noqa: E402
from llama_core.serving import scheduler  # noqa: E402

RULES = ("tokens", "requests", "fcfs")
SCENARIOS = ("chat", "busy")
WEIGHTS = scheduler.PROMPT_TOKEN_WEIGHT, scheduler.OUTPUT_TOKEN_WEIGHT  # the token-fair rule's, for "service/s"
HEAVY_START_SECONDS = 1.0  # heavy floods the engine this long before light starts and the window opens


@dataclass
class Load:
    """What one client sends: requests of prompt_tokens and about new_tokens each, concurrency at a time."""
    prompt_tokens: int
    new_tokens: int  # each request's drawn from half to one and a half times this
    concurrency: int
    pause: float = 0.0  # mean seconds between a reply's end and the next request


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=4, help="engine slots (max_batch_size)")
    p.add_argument("--seconds", type=float, default=6.0, help="the window each scenario runs under each rule")
    p.add_argument("--heavy-prompt", type=int, default=320, help="heavy's prompt tokens per request")
    p.add_argument("--heavy-new", type=int, default=96, help="heavy's tokens generated per request, on average")
    p.add_argument("--heavy-concurrency", type=int, default=12, help="heavy's requests outstanding in 'chat'")
    p.add_argument("--light-prompt", type=int, default=16, help="light's prompt tokens per request")
    p.add_argument("--light-new", type=int, default=32, help="light's tokens generated per request, on average")
    p.add_argument("--light-pause", type=float, default=0.1,
                   help="in 'chat', light's mean pause in seconds between a reply's end and its next request")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    p.add_argument("--rules", default=",".join(RULES), help=f"some of {', '.join(RULES)}")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = p.parse_args()
    a.scenarios, a.rules = a.scenarios.split(","), a.rules.split(",")
    for name, chosen, known in (("--scenarios", a.scenarios, SCENARIOS), ("--rules", a.rules, RULES)):
        if not set(chosen) <= set(known):
            p.error(f"{name} takes some of {', '.join(known)}, got {','.join(chosen)}")
    return a


@contextlib.contextmanager
def rule(name: str) -> Iterator[None]:
    """The scheduler's weights for the rule (see the module's docstring), put back afterwards."""
    weights = scheduler.PROMPT_TOKEN_WEIGHT, scheduler.OUTPUT_TOKEN_WEIGHT
    if name == "requests":
        scheduler.PROMPT_TOKEN_WEIGHT = scheduler.OUTPUT_TOKEN_WEIGHT = 0
    try:
        yield
    finally:
        scheduler.PROMPT_TOKEN_WEIGHT, scheduler.OUTPUT_TOKEN_WEIGHT = weights


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class Client:
    """One client's worker threads, each sending a request, reading it to its end, and sending the next."""

    def __init__(self, engine: Engine, name: str, load_: Load, named: bool, seed: int) -> None:
        self.engine, self.name, self.load, self.named = engine, name, load_, named
        self.rng = random.Random(seed)
        self.ban = {token: -100 for token in engine.end_ids}
        self.lock = threading.Lock()
        self.records: list[dict] = []  # each request sent before the window closed and ended by its engine
        self.generated = self.computed = 0  # tokens that arrived in the window; prompt tokens before them
        self.window: tuple[float, float] = (float("inf"), float("inf"))
        self.stop = threading.Event()  # send no more requests
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(load_.concurrency)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _request(self) -> tuple[list[int], int, float]:
        """A new prompt, the tokens it asks for, and the pause before it is sent."""
        with self.lock:
            pause = self.rng.uniform(0, 2 * self.load.pause) if self.load.pause else 0.0
            new_tokens = self.rng.randint(self.load.new_tokens // 2, self.load.new_tokens * 3 // 2)
            prompt = [1] + [self.rng.randrange(3, self.engine.words) for _ in range(self.load.prompt_tokens - 1)]
            return prompt, new_tokens, pause

    def _loop(self) -> None:
        while not self.stop.is_set():
            prompt, new_tokens, pause = self._request()
            time.sleep(pause)
            sent = time.perf_counter()
            if sent >= self.window[1] and self.name == "light":  # heavy floods on until told to stop
                return
            try:
                stream = self.engine.submit(prompt, new_tokens, temperature=0, logprobs=False,
                                            client=self.name if self.named else None, logit_bias=self.ban)
            except LlamaError:
                if self.stop.is_set():  # the engine closed as heavy was told to stop
                    return
                raise
            first = None
            for chunks in stream.batches(0.05):
                now = time.perf_counter()
                prompt_done, first = first is None, first or now  # the prompt is computed by the first token
                if self.window[0] <= now < self.window[1]:
                    with self.lock:
                        self.generated += len(chunks)
                        self.computed += len(prompt) if prompt_done else 0
            if stream.finish_reason == "length" and self.window[0] <= sent < self.window[1]:
                with self.lock:
                    self.records.append({"ttft_s": first - sent, "done_s": stream.finished_at - sent})


def run(loaded, scenario: str, rule_name: str, a: argparse.Namespace) -> dict:
    """One scenario under one rule on a fresh engine: light's latencies and both clients' rates."""
    heavy_concurrency = a.heavy_concurrency if scenario == "chat" else a.slots
    light_concurrency = 1 if scenario == "chat" else a.slots
    named = rule_name != "fcfs"
    with rule(rule_name):
        engine = Engine(loaded, seed=0, prompt_lookup=0).start()
        try:
            heavy = Client(engine, "heavy", Load(a.heavy_prompt, a.heavy_new, heavy_concurrency), named, seed=1)
            light_pause = a.light_pause if scenario == "chat" else 0.0
            light = Client(engine, "light", Load(a.light_prompt, a.light_new, light_concurrency, light_pause),
                           named, seed=2)
            heavy.start()
            time.sleep(HEAVY_START_SECONDS)
            began = time.perf_counter()
            heavy.window = light.window = (began, began + a.seconds)
            light.start()
            for thread in light.threads:  # light's last requests end while heavy still floods
                thread.join()
            heavy.stop.set()
        finally:
            engine.close()  # cancels heavy's requests in flight
        for thread in heavy.threads:
            thread.join()
    ttft = [r["ttft_s"] for r in light.records]
    done = [r["done_s"] for r in light.records]
    return {
        "light_requests": len(light.records),
        "light_ttft_p50_s": _percentile(ttft, 50), "light_ttft_p90_s": _percentile(ttft, 90),
        "light_done_p50_s": _percentile(done, 50), "light_done_p90_s": _percentile(done, 90),
        "light_tokens_per_s": light.generated / a.seconds, "heavy_tokens_per_s": heavy.generated / a.seconds,
        "light_prompt_tokens_per_s": light.computed / a.seconds,
        "heavy_prompt_tokens_per_s": heavy.computed / a.seconds,
        # what the token-fair rule evens out: its counters' growth per second
        "light_service_per_s": (WEIGHTS[0] * light.computed + WEIGHTS[1] * light.generated) / a.seconds,
        "heavy_service_per_s": (WEIGHTS[0] * heavy.computed + WEIGHTS[1] * heavy.generated) / a.seconds,
    }


def warm_up(loaded, a: argparse.Namespace) -> None:
    """First calls are slow (allocations, kernels chosen): a few requests of both shapes, not in the figures."""
    engine = Engine(loaded, seed=0, prompt_lookup=0).start()
    streams = [engine.submit([1] + list(range(3, 3 + (a.heavy_prompt if i % 2 else a.light_prompt))), 8,
                             temperature=0, logprobs=False) for i in range(a.slots)]
    for stream in streams:
        list(stream)
    engine.close()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(None, max_seq_len=512, max_batch_size=a.slots)
    if max(a.heavy_prompt + a.heavy_new * 3 // 2, a.light_prompt + a.light_new * 3 // 2) > loaded.runner.max_seq_len:
        sys.exit(f"error: a request of prompt and reply must fit {loaded.runner.max_seq_len} tokens")
    warm_up(loaded, a)
    print(f"embedded model, {a.slots} slots, {torch.get_num_threads()} thread(s), {a.seconds:g} s per run; "
          f"heavy {a.heavy_prompt}+~{a.heavy_new} tokens a request, light {a.light_prompt}+~{a.light_new}", flush=True)
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "torch": torch.__version__, "results": {}}
    print(f"\nlight: its requests sent in the window; tok/s: tokens generated per second, light / heavy; prompt: "
          f"prompt tokens computed per second; service: {WEIGHTS[0]} x prompt + {WEIGHTS[1]} x generated per second "
          f"(the token-fair rule's counters)")
    columns = ("light TTFT p50 / p90 ms", "light end p50 / p90 ms", "tok/s L / H", "prompt L / H", "service L / H")
    print(f"{'scenario':<8}  {'rule':<8}  {'light reqs':>10}  " + "  ".join(f"{c:>{len(c)}}" for c in columns))
    for scenario in a.scenarios:
        results = report["results"][scenario] = {}
        for rule_name in a.rules:
            r = results[rule_name] = run(loaded, scenario, rule_name, a)
            pairs = ((1000 * r["light_ttft_p50_s"], 1000 * r["light_ttft_p90_s"]),
                     (1000 * r["light_done_p50_s"], 1000 * r["light_done_p90_s"]),
                     (r["light_tokens_per_s"], r["heavy_tokens_per_s"]),
                     (r["light_prompt_tokens_per_s"], r["heavy_prompt_tokens_per_s"]),
                     (r["light_service_per_s"], r["heavy_service_per_s"]))
            print(f"{scenario:<8}  {rule_name:<8}  {r['light_requests']:>10}  " + "  ".join(
                f"{f'{x:.0f} / {y:.0f}':>{len(c)}}" for c, (x, y) in zip(columns, pairs)), flush=True)
    print()
    for scenario, results in report["results"].items():
        if "tokens" not in results:
            continue
        t = results["tokens"]
        for other in (rule_name for rule_name in results if rule_name != "tokens"):
            o = results[other]
            ratios = {"light_done_p50": o["light_done_p50_s"] / t["light_done_p50_s"],
                      "light_done_p90": o["light_done_p90_s"] / t["light_done_p90_s"],
                      "light_ttft_p50": o["light_ttft_p50_s"] / t["light_ttft_p50_s"],
                      "light_tokens_per_s": t["light_tokens_per_s"] / o["light_tokens_per_s"]}
            report.setdefault("ratios", {})[f"{scenario}: {other} / tokens"] = ratios
            print(f"{scenario}, light under {other} / under tokens: time to its reply's end p50 "
                  f"{ratios['light_done_p50']:.2f}x, p90 {ratios['light_done_p90']:.2f}x; to its first token p50 "
                  f"{ratios['light_ttft_p50']:.2f}x; its tokens/s, under tokens / under {other}: "
                  f"{ratios['light_tokens_per_s']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
