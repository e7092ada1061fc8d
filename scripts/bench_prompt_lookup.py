"""Prompt-lookup decoding benchmark: decoding with drafts from the text so far (Engine's prompt_lookup) against
the same engine without, side by side in one process on one loaded model, taking turns.

    python scripts/bench_prompt_lookup.py --threads 2                     # the embedded model, stories260K
    python scripts/bench_prompt_lookup.py --threads 2 --shapes 110m,7b-4  # and random weights of these shapes

For each model: the workload's tokens per second with and without drafts (the best of --runs, the two
taking turns), decode steps, drafted and kept tokens, and whether every reply was the same token for token
(it must be). The workload is greedy and seeded-sampled replies to a few prompts, one request at a time.
Then predicted outputs: one greedy reply without drafts, with itself as the prediction, and with a
prediction that differs from it at every 16th token.

The real models are the embedded tiny-shakespeare and, where ../shared has it, stories260K. The shapes are
random weights stored in bfloat16 (as Llama-2's), or quantized with --quantize: "7b-4" is the 7B's width
with 4 of its 32 blocks. Their greedy text falls into loops, which drafts follow (an upper bound: a reply
copying its prompt); their sampled text never repeats (the lower bound: what drafting costs where nothing
repeats).

Per shape it also times one forward of 1 + k tokens of one sequence (k drafted) against one decode step
at the same place (--depth tokens into the context): the price of a draft, from which the speedup at any
acceptance rate a follows (1 + a + ... + a^k tokens for that price).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench import SHAPES, _Vocab, random_model  # noqa: E402
from llama_core import DEFAULT_CKPT_DIR, Llama  # noqa: E402
from llama_core.config import ModelArgs  # noqa: E402
from llama_core.int4 import quantize_int4  # noqa: E402
from llama_core.quantize import quantize_int8  # noqa: E402
from llama_core.serving import Engine  # noqa: E402

STORIES_DIR = ROOT.parent / "shared" / "models" / "stories260K"
TEXT_PROMPTS = ["ROMEO:", "First Citizen:\nWe are accounted poor citizens", "To be, or not to be",
                "KING RICHARD III:\nNow is the winter of our discontent"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-lookup", type=int, default=5, help="the most tokens drafted a step (default: 5)")
    p.add_argument("--shapes", default="", help="comma-separated random-weight shapes: 15m, 110m, 7b-4 (7B width, 4 blocks)")
    p.add_argument("--new-tokens", type=int, default=200, help="tokens per reply (default: 200)")
    p.add_argument("--shape-new-tokens", type=int, default=64, help="tokens per reply of the shapes (default: 64)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--depth", type=int, default=300, help="context before the timed forwards (default: 300)")
    p.add_argument("--skip-models", action="store_true", help="the shapes only")
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default="none",
                   help="the shapes' weights quantized so (the real models stay float32)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args()


def workload(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[tuple[int, float]]]:
    replies = []
    for prompt in prompts:
        for kind in (dict(temperature=0), dict(temperature=0.8, top_p=0.95, seed=1)):
            replies.append([(c.token, c.logprob) for c in engine.submit(prompt, new_tokens, **kind)])
    return replies


def compare(loaded, prompts: list[list[int]], new_tokens: int, prompt_lookup: int, runs: int) -> dict:
    """Both engines' best tokens/s over runs, taking turns (which goes first alternates)."""
    result: dict = {}
    replies = {}
    for run in range(runs):
        for lookup in ((0, prompt_lookup) if run % 2 == 0 else (prompt_lookup, 0)):
            engine = Engine(loaded, seed=0, prompt_lookup=lookup)
            start = time.perf_counter()
            replies[lookup] = workload(engine, prompts, new_tokens)
            seconds = time.perf_counter() - start
            tokens = sum(len(r) for r in replies[lookup])
            row = result.setdefault("drafts" if lookup else "plain", {"tokens_per_s": 0.0})
            row.update(tokens=tokens, steps=engine.steps, drafted=engine.drafted_tokens, kept=engine.accepted_tokens)
            if lookup:
                row["learned_price"] = engine.draft_price.price
            row["tokens_per_s"] = max(row["tokens_per_s"], tokens / seconds)
            engine.close()
    result["same_replies"] = replies[0] == replies[prompt_lookup]
    result["speedup"] = result["drafts"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    return result


def predicted(loaded, prompt: list[int], new_tokens: int, prompt_lookup: int, runs: int) -> dict:
    """A greedy reply decoded without drafts, with the reply itself as the prediction (every drafted token
    right), and with a prediction that differs at every 16th token (an edit's worth): best tokens/s of each."""
    engine = Engine(loaded, seed=0, prompt_lookup=0)
    reply = [c.token for c in engine.submit(prompt, new_tokens, temperature=0)]
    engine.close()
    edited = [t if i % 16 != 15 else (t + 1) % loaded.runner.args.vocab_size for i, t in enumerate(reply)]
    result: dict = {}
    for run in range(runs):
        for name, lookup, prediction in (("plain", 0, ()), ("exact prediction", prompt_lookup, reply),
                                         ("edited prediction", prompt_lookup, edited)):
            engine = Engine(loaded, seed=0, prompt_lookup=lookup)
            start = time.perf_counter()
            stream = engine.submit(prompt, new_tokens, temperature=0, prediction_tokens=prediction)
            tokens = [c.token for c in stream]
            seconds = time.perf_counter() - start
            row = result.setdefault(name, {"tokens_per_s": 0.0})
            row.update(same_reply=tokens == reply, steps=engine.steps, kept=stream.accepted_tokens,
                       drafted=stream.drafted_tokens)
            row["tokens_per_s"] = max(row["tokens_per_s"], len(tokens) / seconds)
            engine.close()
    for name in ("exact prediction", "edited prediction"):
        result[name]["speedup"] = result[name]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    return result


def draft_prices(llama: Llama, depth: int, most: int) -> dict[int, float]:
    """Seconds of a forward of 1 + k tokens over one decode step's, k = 0..most (best of 5 x 10)."""
    runner = llama.engine.runner
    llama.engine.close()
    vocab = runner.args.vocab_size
    with torch.inference_mode():
        runner.prefill(torch.randint(3, vocab, (1, depth)), torch.arange(depth)[None], slice(0, 1), depth)

        def best(call) -> float:
            call()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    call()
                times.append((time.perf_counter() - start) / 10)
            return min(times)

        one = best(lambda: runner.decode(torch.tensor([5]), torch.tensor([depth]), slice(0, 1), depth + 1))
        prices = {0: 1.0}
        for k in range(1, most + 1):
            tokens = torch.randint(3, vocab, (1, 1 + k))
            positions = (depth + torch.arange(1 + k))[None]
            prices[k] = best(lambda: runner.prefill(tokens, positions, slice(0, 1), depth + 1 + k)) / one
    return prices


def speedup_at(prices: dict[int, float], acceptance: float) -> float:
    """The best k's tokens per unit of time, at an acceptance rate, over one token per step."""
    return max(sum(acceptance ** j for j in range(k + 1)) / price for k, price in prices.items())


def shape_model(name: str, quantize: str = "none") -> Llama:
    base, _, blocks = name.partition("-")
    shape = dict(SHAPES[base])
    if blocks:
        shape["n_layers"] = int(blocks)
    args = ModelArgs(**shape, max_seq_len=1024)
    model = random_model(args, torch.device("cpu"), torch.float32, "bfloat16")
    if quantize != "none":
        model = {"int8": quantize_int8, "int4": quantize_int4}[quantize](model)
    return Llama.from_model(model, _Vocab(args.vocab_size), 1024, 2)


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    report = {"threads": torch.get_num_threads(), "prompt_lookup": a.prompt_lookup, "quantize": a.quantize,
              "models": {}, "shapes": {}}
    models = {} if a.skip_models else {"tiny-shakespeare (embedded)": DEFAULT_CKPT_DIR}
    if (STORIES_DIR / "params.json").is_file() and not a.skip_models:
        models["stories260K"] = STORIES_DIR
    for name, folder in models.items():
        llama = Llama.build(folder, max_seq_len=512, max_batch_size=2, device="cpu", seed=0)
        prompts = ([[1], [1, 403, 407], [1, 48], [1, 73, 9]] if folder == STORIES_DIR else
                   [llama.tokenizer.encode(t, bos=True, eos=False) for t in TEXT_PROMPTS])
        report["models"][name] = compare(llama.loaded, prompts, a.new_tokens, a.prompt_lookup, a.runs)
        report["models"][name]["prediction"] = predicted(llama.loaded, prompts[0], a.new_tokens, a.prompt_lookup,
                                                         a.runs)
        llama.engine.close()
        print(name, json.dumps(report["models"][name]), flush=True)
    for name in filter(None, a.shapes.split(",")):
        llama = shape_model(name, a.quantize)
        prompts = [torch.randint(3, llama.args.vocab_size, (32,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(2)]
        result = compare(llama.loaded, prompts, a.shape_new_tokens, a.prompt_lookup, a.runs)
        result["prediction"] = predicted(llama.loaded, prompts[0], a.shape_new_tokens, a.prompt_lookup, a.runs)
        prices = draft_prices(llama, a.depth, a.prompt_lookup)
        result["price_of_k_drafted"] = prices
        result["speedup_at_acceptance"] = {str(x): speedup_at(prices, x) for x in (0.3, 0.5, 0.7, 0.8, 0.9)}
        report["shapes"][name] = result
        print(name, json.dumps(result), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
