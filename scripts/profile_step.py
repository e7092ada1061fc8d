"""Where one engine step's time goes: N requests decoding together in llama_core's Engine, in-process.

    python scripts/profile_step.py --rows 8 --threads 1            # the embedded model, as the app runs it
    python scripts/profile_step.py --rows 8 --threads 1 --compile  # with the compiled decode step

Wall-clock per decode step with all rows busy, split into scheduling (retiring, admitting), the forward,
sampling (the next tokens and their log-probabilities) and delivery (the events each stream gets), then
the torch profiler's per-operator table over the same steps.
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
    a = p.parse_args()
    torch.set_num_threads(a.threads)
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

    engine._retire_cancelled = timed("scheduling", engine._retire_cancelled)
    engine._admit = timed("scheduling", engine._admit)
    engine.runner.decode = timed("forward", engine.runner.decode)
    engine._sample = timed("sampling", engine._sample)
    engine._deliver = timed("delivery", engine._deliver)
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


if __name__ == "__main__":
    main()
