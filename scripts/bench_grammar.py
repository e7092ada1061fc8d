"""Structured replies benchmark: what holding requests to a grammar costs the engine, side by side in one process
on one loaded model, taking turns.

    python scripts/bench_grammar.py --threads 2                       # the embedded model
    python scripts/bench_grammar.py --threads 2 --shape 110m          # random 110m weights, Llama-2's tokenizer

Each case decodes --batch sequences of --new-tokens tokens (greedy, prompt lookup off so that every case runs
the same steps) and reports tokens/s, the best of --runs:

* free: no grammar;
* letters: a regular expression of letters and punctuation as long as the reply (the mask almost the whole
  vocabulary, every step);
* json: a JSON Schema whose one string is as long as the reply;
* json in chat: the same, with the chat's dialog tags forbidden as a chat reply has them.

A grammar the reply keeps to for all its tokens makes every case the same number of steps: the difference is
the mask's cost (llguidance's, unpacking it, and masking the logits).

Then, for one sequence, records (--records JSON objects of a dozen short fields, in an array) with prompt
lookup off and on: with it on, the tokens the grammar forces (each key, the punctuation around it) are
drafted, so the same reply takes fewer steps.
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
from bench import SHAPES, random_model  # noqa: E402
from llama_core import Grammar, Llama  # noqa: E402
from llama_core.config import ModelArgs  # noqa: E402
from llama_core.dialog import SPECIAL_TAGS  # noqa: E402
from llama_core.serving import Engine  # noqa: E402
from llama_core.tokenizer import Tokenizer  # noqa: E402

LLAMA2_TOKENIZER = ROOT.parent / "shared" / "llama2" / "tokenizer.model"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape (stored in bfloat16) with "
                   "Llama-2's tokenizer, instead of the embedded model")
    p.add_argument("--tokenizer", type=Path, default=LLAMA2_TOKENIZER, help="Llama-2's tokenizer.model, for --shape")
    p.add_argument("--batch", default="1,8", help="sequences decoding together (default: 1,8)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--records", type=int, default=4, help="records in the drafted case's array (default: 4)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args()


def cases(new_tokens: int) -> dict[str, object]:
    least = new_tokens * 20  # characters: more than the reply can write (a token holds at most 16), so it never ends
    text = Grammar.json({"type": "object", "properties": {"line": {"type": "string", "minLength": least,
                                                                   "maxLength": 2 * least}},
                         "required": ["line"], "additionalProperties": False})
    return {"free": None, "letters": Grammar.regex(f"[A-Za-z ,.;:!?']{{{least},{2 * least}}}"), "json": text,
            "json in chat": text.forbidding(SPECIAL_TAGS)}


def record_grammar(records: int) -> Grammar:
    """An array of records, each a dozen short fields: most of its tokens are keys and punctuation."""
    fields = {"speaker": {"enum": ["ROMEO", "JULIET", "NURSE", "MERCUTIO"]}, "act": {"type": "integer", "minimum": 1,
              "maximum": 5}, "scene": {"type": "integer", "minimum": 1, "maximum": 9}, "line": {"type": "string",
              "maxLength": 12}, "mood": {"enum": ["merry", "sad", "wroth"]}, "aside": {"type": "boolean"},
              "place": {"enum": ["Verona", "Mantua"]}, "time": {"enum": ["morning", "night"]},
              "exits": {"type": "boolean"}, "enters": {"type": "boolean"}, "rhymes": {"type": "boolean"},
              "weeps": {"type": "boolean"}}
    record = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
    return Grammar.json({"type": "array", "items": record, "minItems": records, "maxItems": records})


def run_case(engine: Engine, prompts: list[list[int]], new_tokens: int, grammar) -> tuple[float, int]:
    start = time.perf_counter()
    streams = [engine.submit(p, new_tokens, temperature=0, grammar=grammar) for p in prompts]
    tokens = sum(len(list(stream)) for stream in streams)
    return time.perf_counter() - start, tokens


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in a.batch.split(",")]
    if a.shape:
        if not a.tokenizer.is_file():
            sys.exit(f"no tokenizer at {a.tokenizer}: pass --tokenizer")
        args = ModelArgs(**SHAPES[a.shape], max_seq_len=512)
        llama = Llama.from_model(random_model(args, torch.device("cpu"), torch.float32, "bfloat16"),
                                 Tokenizer(a.tokenizer), 512, max(batches))
        name = f"random {a.shape} (bf16 weights), Llama-2's tokenizer"
    else:
        llama = Llama.build(max_seq_len=512, max_batch_size=max(batches), seed=0)
        name = "embedded tiny-shakespeare"
    tokenizer = llama.tokenizer
    prompt = tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?", bos=True, eos=False)
    report = {"model": name, "new_tokens": a.new_tokens, "threads": torch.get_num_threads(), "cases": {}}
    print(f"{name}; {a.new_tokens} new tokens per sequence; {torch.get_num_threads()} threads")
    for batch in batches:
        prompts = [prompt + [13 + i] for i in range(batch)]  # different prompts: no request shares another's cache
        best: dict[str, tuple[float, int]] = {}
        for run in range(a.runs):
            order = list(cases(a.new_tokens).items())
            for label, grammar in (order if run % 2 == 0 else order[::-1]):
                engine = Engine(llama.loaded, seed=0, prompt_lookup=0, prefix_caching=False)
                run_case(engine, prompts, 4, grammar)  # warm: the grammar's vocabulary, the kernels
                seconds, tokens = run_case(engine, prompts, a.new_tokens, grammar)
                engine.close()
                if label not in best or tokens / seconds > best[label][1] / best[label][0]:
                    best[label] = (seconds, tokens)
        free = best["free"][1] / best["free"][0]
        for label, (seconds, tokens) in best.items():
            rate = tokens / seconds
            report["cases"][f"{label}, batch {batch}"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": rate,
                                                         "ratio_to_free": rate / free}
            print(f"  batch {batch:2d}  {label:13s} {tokens:5d} tokens  {rate:8.1f} tok/s  {rate / free:5.2f}x free")
    grammar, drafted = record_grammar(a.records), {}
    for run in range(a.runs):
        for lookup in ((0, 5) if run % 2 == 0 else (5, 0)):
            engine = Engine(llama.loaded, seed=0, prompt_lookup=lookup, prefix_caching=False, draft_price=0.1)
            run_case(engine, [prompt], 4, grammar)
            steps, kept = engine.steps, engine.accepted_tokens
            seconds, tokens = run_case(engine, [prompt], 480, grammar)
            steps, kept = engine.steps - steps, engine.accepted_tokens - kept
            engine.close()
            if lookup not in drafted or tokens / seconds > drafted[lookup]["tokens_per_s"]:
                drafted[lookup] = {"tokens": tokens, "steps": steps, "seconds": seconds, "tokens_per_s": tokens / seconds,
                                   "drafted_tokens_kept": kept}
    report["records"] = {"records": a.records, "prompt_lookup_off": drafted[0], "prompt_lookup_on": drafted[5],
                         "speedup": drafted[5]["tokens_per_s"] / drafted[0]["tokens_per_s"]}
    for lookup, label in ((0, "lookup off"), (5, "lookup on")):
        r = drafted[lookup]
        print(f"  {a.records} records, {label:10s} {r['tokens']:5d} tokens in {r['steps']:4d} steps  "
              f"{r['tokens_per_s']:8.1f} tok/s")
    print(f"  forced tokens drafted: {report['records']['speedup']:.2f}x the tokens/s")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
