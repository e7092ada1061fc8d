"""Where one engine step's time goes: N requests decoding together in llama_core's Engine, in-process.

    python scripts/profile_step.py --rows 8 --threads 1            # the embedded model, as the app runs it
    python scripts/profile_step.py --rows 8 --threads 1 --compile  # with the compiled decode step
    python scripts/profile_step.py --riders 7 --rider-tokens 12 --threads 1  # prompts riding a decode step
    python scripts/profile_step.py --rows 8 --threads 2 --engine-thread      # steps in the engine's own thread

Wall-clock per decode step with all rows busy, split into scheduling (retiring, admitting), the forward,
sampling (the next tokens and their log-probabilities) and delivery (the events each stream gets), then
the torch profiler's per-operator table over the same steps. With --riders P, instead: the forward of P
new prompts of --rider-tokens tokens prefilled in the same step as one decoding row (what requests arriving
together wait for before their first token), median ms. With --engine-thread, instead: the steps as a
started engine's own thread runs them, the model loaded in this thread, as an in-process engine serves
(`llama.serve()`, the app's --single-process; rows kept busy by new requests as others end), ms per step
over each of three one-second windows.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core import Engine, load  # noqa: E402

PARTS = ("scheduling", "forward", "sampling", "delivery")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="requests decoding at once")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-dir", default=None, help="default: the embedded model")
    p.add_argument("--compile", action="store_true", help="the compiled decode step")
    p.add_argument("--top-ops", type=int, default=15)
    p.add_argument("--riders", type=int, default=0, help="time P prompts riding one decoding row instead")
    p.add_argument("--engine-thread", action="store_true", help="time the steps of a started engine's thread instead")
    p.add_argument("--rider-tokens", type=int, default=12, help="tokens of each riding prompt")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.riders:
        time_riders(a)
        return
    if a.engine_thread:
        time_engine_thread(a)
        return
    loaded = load(a.ckpt_dir, max_seq_len=512, max_batch_size=a.rows, compile=a.compile)
    engine = Engine(loaded, seed=0)
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return wrapper

    engine._scheduler.retire_cancelled = timed("scheduling", engine._scheduler.retire_cancelled)
    engine._admit = timed("scheduling", engine._admit)
    engine.runner.decode = timed("forward", engine.runner.decode)
    engine._sampler.sample = timed("sampling", engine._sampler.sample)
    engine._delivery.deliver = timed("delivery", engine._delivery.deliver)
    prompt = loaded.tokenizer.encode("ROMEO:\nBut soft, what light through yonder", bos=True, eos=False)

    def run_steps(profiler=None) -> list[dict]:
        streams = [engine.submit(prompt, a.new_tokens, temperature=0) for _ in range(a.rows)]
        while not engine.active_count == a.rows:  # admitted and prefilled together
            engine.pump()
        steps = []
        while engine.active_count == a.rows:
            spent.clear()
            start = time.perf_counter()
            engine.pump()
            steps.append({"step": time.perf_counter() - start, **spent})
            if profiler is not None:
                profiler.step()
        for stream in streams:
            stream.cancel()
        while engine.pump():
            pass
        return steps[1:]  # the first carries the prefill's sampling

    run_steps()  # warm-up
    steps = run_steps()
    median = {key: statistics.median(s.get(key, 0.0) for s in steps) * 1e3 for key in ("step", *PARTS)}
    print(f"{len(steps)} steps of {a.rows} rows, {torch.get_num_threads()} thread(s), "
          f"{'compiled' if a.compile else 'eager'} decode step; median ms per step:")
    for key in ("step", *PARTS):
        print(f"  {key:<11} {median[key]:7.3f}")
    print(f"  {'other':<11} {median['step'] - sum(median[k] for k in PARTS):7.3f}  (the turn's own Python)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run_steps()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top_ops))


def time_engine_thread(a: argparse.Namespace) -> None:
    """Steps as Engine.start()'s thread runs them, a.rows requests decoding at all times: ms per step in
    each of three one-second windows (this thread only tops the rows up)."""
    loaded = load(a.ckpt_dir, max_seq_len=512, max_batch_size=a.rows, compile=a.compile)
    engine = Engine(loaded, seed=0).start()
    prompt = loaded.tokenizer.encode("ROMEO:\nBut soft, what light through yonder", bos=True, eos=False)
    streams = []

    def window(seconds: float) -> float:
        start, steps = time.perf_counter(), engine.steps
        while time.perf_counter() - start < seconds:
            while engine.active_count + engine.waiting_count < a.rows:
                streams.append(engine.submit(prompt, a.new_tokens, temperature=0))
            time.sleep(0.0005)
        return (time.perf_counter() - start) / max(1, engine.steps - steps) * 1e3

    try:
        window(0.5)  # warm-up
        figures = [window(1.0) for _ in range(3)]
    finally:
        engine.shutdown()
    print(f"{a.rows} rows decoding in the engine's own thread, {torch.get_num_threads()} thread(s): "
          f"{', '.join(f'{ms:.2f}' for ms in figures)} ms per step (three one-second windows)")


def time_riders(a: argparse.Namespace) -> None:
    """The forward of a.riders fresh prompts prefilled together with one decoding row, as the engine runs
    it when requests arrive while another decodes (Transformer.forward_spans)."""
    from llama_core.model import Span
    from llama_core.runner import cache_rows

    runner = load(a.ckpt_dir, max_seq_len=512, max_batch_size=a.riders + 1).runner
    vocab = runner.args.vocab_size
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        prompts = torch.randint(0, vocab, (a.riders, a.rider_tokens), generator=generator)
        positions = torch.arange(a.rider_tokens)[None].expand(a.riders, a.rider_tokens)
        decoding = Span(torch.randint(0, vocab, (1, 1), generator=generator), torch.tensor([[100]]),
                        cache_rows([0], "cpu"), 101, torch.zeros(1, dtype=torch.long))
        riding = Span(prompts, positions, cache_rows(list(range(1, a.riders + 1)), "cpu"), a.rider_tokens,
                      torch.full((a.riders,), a.rider_tokens - 1))
        start = time.perf_counter()
        with torch.inference_mode():
            runner.forward_spans([decoding, riding])
        return time.perf_counter() - start

    for _ in range(5):
        step()
    median = statistics.median(step() for _ in range(40)) * 1e3
    print(f"{a.riders} prompts of {a.rider_tokens} tokens riding one decoding row, {torch.get_num_threads()} "
          f"thread(s): {median:.2f} ms per forward (median of 40)")


if __name__ == "__main__":
    main()
