"""What the sampling controls cost: decode tokens/s of a batch of 8 requests on random weights, with the
default controls (temperature 0.6, top-p 0.9), and with every control on (top-k, min-p, all three penalties,
stop strings, seeds, top log-probabilities), side by side, runs taking turns.

    python scripts/bench_sampling.py --shape 15m --threads 2

Stop strings need a real tokenizer to decode with: the Llama-2 tokenizer from ../shared when present
(--tokenizer), else they are left out and the report says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench import SHAPES, _Vocab, random_model  # noqa: E402
from llama_core import Llama, Tokenizer  # noqa: E402
from llama_core.config import ModelArgs  # noqa: E402

LLAMA2_TOKENIZER = ROOT.parent / "shared" / "llama2" / "tokenizer.model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="15m", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int)
    p.add_argument("--tokenizer", type=Path, default=LLAMA2_TOKENIZER)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    args = ModelArgs(**SHAPES[a.shape], max_seq_len=4096)
    tokenizer = Tokenizer(a.tokenizer) if a.tokenizer.is_file() else _Vocab(args.vocab_size)
    real_tokenizer = isinstance(tokenizer, Tokenizer) and tokenizer.n_words == args.vocab_size
    if not real_tokenizer:
        tokenizer = _Vocab(args.vocab_size)
    llama = Llama.from_model(random_model(args, torch.device("cpu"), torch.float32), tokenizer, 256, a.batch, seed=0)
    prompts = torch.randint(3, args.vocab_size, (a.batch, 16), generator=torch.Generator().manual_seed(1)).tolist()
    every = dict(top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2,
                 seed=7, top_logprobs=5)
    if real_tokenizer:
        every["stop"] = ["\n\n\n\n", "THE END"]  # watched every token, never found in random text
    configurations = {"greedy": dict(temperature=0), "defaults": dict(temperature=0.6, top_p=0.9),
                      "every control": dict(temperature=0.6, top_p=0.9, **every)}
    times = {name: [] for name in configurations}
    for name, controls in configurations.items():  # warm-up
        llama.generate(prompts, 4, **controls)
    for _ in range(a.runs):
        for name, controls in configurations.items():
            start = time.perf_counter()
            llama.generate(prompts, 1, **controls)
            first = time.perf_counter() - start
            start = time.perf_counter()
            llama.generate(prompts, a.new_tokens + 1, **controls)
            times[name].append((time.perf_counter() - start - first) / a.new_tokens)
    print(f"{a.shape}, batch {a.batch}, {torch.get_num_threads()} threads, {a.new_tokens} tokens, median of {a.runs} "
          f"runs{'' if real_tokenizer else ' (no tokenizer of this vocabulary: stop strings left out)'}")
    base = statistics.median(times["defaults"])
    for name, values in times.items():
        step = statistics.median(values)
        print(f"{name:>14}: {a.batch / step:8.1f} tok/s, {step * 1e3:6.2f} ms per step, {step / base:5.2f}x the defaults' step")


if __name__ == "__main__":
    main()
