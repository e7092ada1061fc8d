"""Run under torchrun by tests/test_parallel.py: builds a tensor-parallel Llama, and on rank 0 generates
greedily (directly, through an Engine with concurrent requests, and with a prompt prefix copied between
KV-cache slots) and writes the results as JSON. Ranks > 0 never return from Llama.build: they follow rank 0
and exit when it does.

With --after-sigterm, rank 0 instead writes OUT.ready once built, waits for SIGTERM (as torchrun sends it to
every process), then asks its engine for greedy completions of the prompts and writes their tokens (or the
error each request got) as JSON."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_core import Llama  # noqa: E402


def shared_prefix_requests(engine, prompts: list[list[int]], max_gen_len: int) -> dict:
    """Two greedy requests whose prompts share a long prefix, the second submitted while the first decodes
    (with prefix caching, its prefix is copied out of the first one's slot): their tokens, log-probabilities
    and cached_tokens, and the length of the prefix they share. The engine's turns must run in the thread
    that reads its streams."""
    shared = prompts[0] + [t for p in prompts[1:] for t in p[1:]]
    shared += shared[1:]
    running = engine.submit(shared + prompts[1][1:3], max_gen_len, temperature=0)
    chunks = iter(running)
    head = next(chunks)
    joining = engine.submit(shared + prompts[2][1:3], max_gen_len, temperature=0)
    replies = [[head] + list(chunks), list(joining)]  # the next turn admits the second while the first decodes
    return {
        "tokens": [[c.token for c in r] for r in replies],
        "logprobs": [[c.logprob for c in r] for r in replies],
        "cached": [running.cached_tokens, joining.cached_tokens],
        "shared": len(shared),
    }


def requests_after_sigterm(llama, prompts: list[list[int]], max_gen_len: int) -> list:
    """Each prompt's greedy tokens through the engine, or {"error": what the request was told}."""
    replies = []
    with llama.serve() as engine:
        for prompt in prompts:
            try:
                replies.append([c.token for c in engine.submit(prompt, max_gen_len, temperature=0)])
            except Exception as exc:  # noqa: BLE001 - the test reads what the request was told
                replies.append({"error": f"{type(exc).__name__}: {exc}"})
    return replies


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-gen-len", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--after-sigterm", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    prompts = json.loads(args.prompts)
    terminated = threading.Event()
    if args.after_sigterm and os.environ["RANK"] == "0":  # as the app's server does: it ends its requests first
        signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())

    llama = Llama.build(args.ckpt_dir, max_seq_len=128, max_batch_size=4, device="cpu", dtype="float32", seed=0,
                        tensor_parallel=True)
    if args.after_sigterm:
        llama.generate(prompts[:1], 1, temperature=0)  # its all-reduces return once every rank follows rank 0
        args.out.with_suffix(".ready").write_text("")
        terminated.wait(timeout=120)
        args.out.write_text(json.dumps(requests_after_sigterm(llama, prompts, args.max_gen_len)))
        return
    tokens, logprobs = llama.generate(prompts, args.max_gen_len, temperature=0, logprobs=True)
    echo_tokens, echo_logprobs = llama.generate(prompts[:1], 4, temperature=0, logprobs=True, echo=True)

    engine_results: list = [None] * len(prompts)
    with llama.serve() as engine:
        def run(i: int) -> None:
            chunks = list(engine.submit(prompts[i], args.max_gen_len, temperature=0))
            engine_results[i] = ([c.token for c in chunks], [c.logprob for c in chunks])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        steps = engine.steps
    prefix = shared_prefix_requests(engine, prompts, args.max_gen_len)  # its thread stopped: reading runs it

    result = {
        "world_size": torch.distributed.get_world_size(),
        "heads_per_rank": llama.model.layers[0].attention.n_heads,
        "tokens": tokens,
        "logprobs": logprobs,
        "echo_tokens": echo_tokens,
        "echo_logprobs": echo_logprobs,
        "engine_tokens": [r[0] for r in engine_results],
        "engine_logprobs": [r[1] for r in engine_results],
        "engine_steps": steps,
        "prefix": prefix,
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
