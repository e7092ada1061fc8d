"""Prefix caching benchmark: what a chat's next turn and a system prompt shared by many users cost when the
engine reuses the KV cache of earlier prompts, against the same engine computing every prompt whole, side by
side in one process (two copies of the same random weights, one engine each).

    python scripts/bench_prefix_cache.py --shape 110m --turns 10 --runs 3

Chat: one user's conversation of --turns turns (messages of ~75 tokens, replies of --reply-tokens greedy
tokens, a short system prompt: about 1,450 tokens of history at turn 10), the same dialog sent to both
engines each turn, which goes first taking turns; reports each turn's time to first token with and
without prefix caching and their ratio (median over --runs conversations, each on fresh engines).

Shared system prompt: --users users at once, each with the same --system-tokens system prompt and a
question of its own; reports the prompt tokens each engine computed, and the time to first token (median
and slowest) and until every reply ended.

A chat's next prompt holds the previous reply as text, encoded again: a trained model's reply re-encodes
to the tokens it generated, which the cache holds (tests/test_prefix_cache.py: 79-96 % of each later turn
cached on the embedded model). Random weights pick any piece, and their text seldom re-encodes to the same
tokens; so by default (--replies words) the random model's output layer keeps only whole-word pieces
("▁king", never "ing" or a byte), whose sequences re-encode to themselves, as a trained model's replies do.
--replies any keeps every piece: each turn then also recomputes most of the previous reply.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench import SHAPES, model_args, random_model  # noqa: E402
from llama_core import LoadedModel, ModelRunner, Tokenizer  # noqa: E402
from llama_core.serving import Engine, stream_chat  # noqa: E402

LLAMA2_TOKENIZER = ROOT.parent / "shared" / "llama2" / "tokenizer.model"
LINES = [  # public-domain lines, joined into messages and system prompts
    "But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "All the world's a stage, and all the men and women merely players; they have their exits.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
    "If music be the food of love, play on; give me excess of it, that, surfeiting, the appetite may sicken.",
    "The quality of mercy is not strained; it droppeth as the gentle rain from heaven upon the place beneath.",
    "Once more unto the breach, dear friends, once more; or close the wall up with our English dead.",
    "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day.",
    "O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="110m", choices=list(SHAPES))
    p.add_argument("--tokenizer", type=Path, default=LLAMA2_TOKENIZER, help="a 32000-piece SentencePiece model")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--replies", choices=("words", "any"), default="words",
                   help="words: the model can only write whole-word pieces, whose text re-encodes to the same "
                        "tokens, as a trained model's replies do; any: every piece of the random model")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    # the same options as scripts/bench.py's model_args reads
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size"):
        p.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def whole_word_pieces(tokenizer: Tokenizer) -> list[int]:
    """Pieces that are a space and a word of two or more ASCII letters, and the whole encoding of that word."""
    pieces = []
    for token in range(tokenizer.n_words):
        piece = tokenizer.sp_model.id_to_piece(token)
        word = piece[1:]
        if piece.startswith("\u2581") and len(word) >= 2 and word.isascii() and word.isalpha() \
                and tokenizer.encode(word, bos=False, eos=False) == [token]:
            pieces.append(token)
    return pieces


def loaded_pair(a: argparse.Namespace, tokenizer: Tokenizer) -> dict[bool, LoadedModel]:
    """Two copies of one random model, each with a KV cache of its own: {prefix caching: model}."""
    model = random_model(model_args(a), torch.device("cpu"), torch.float32)
    if a.replies == "words":  # other pieces' logits are 0: below the largest of 13,000 random ones
        keep = torch.zeros(model.args.vocab_size, dtype=torch.bool)
        keep[whole_word_pieces(tokenizer)] = True
        model.output.weight[~keep] = 0.0
    slots = max(a.users, 1)
    models = {caching: LoadedModel.from_runner(ModelRunner(copy.deepcopy(model), slots, a.max_seq_len), tokenizer)
              for caching in (True, False)}
    for loaded in models.values():  # first calls are slow (allocations, kernels chosen): not in the figures
        engine = Engine(loaded, prefix_caching=False)
        list(engine.submit(list(range(3, 300)), 4, temperature=0))
        engine.close()
    return models


def message(turn: int) -> str:
    """About 75 tokens: with 64-token replies, turn 10's prompt holds about 1,450 tokens of history."""
    return " ".join(LINES[(turn + k) % len(LINES)] for k in range(3)) + f" (Turn {turn + 1}.) What say you?"


def first_token_seconds(engine: Engine, dialog: list, reply_tokens: int) -> tuple[float, str, int, int]:
    """Time to the first reply text; and the reply, the prompt's length and its cached tokens."""
    start = time.perf_counter()
    stream = stream_chat(engine, dialog, temperature=0, max_new_tokens=reply_tokens)
    batches = iter(stream.batches())
    first = next(batches)
    ttft = time.perf_counter() - start
    text = "".join(c.text for c in first) + "".join(c.text for batch in batches for c in batch)
    return ttft, text, stream.prompt_tokens, stream.cached_tokens


def chat(models: dict[bool, LoadedModel], a: argparse.Namespace) -> list[dict]:
    """One conversation sent to both engines turn by turn: each turn's figures."""
    engines = {caching: Engine(models[caching], seed=0, prefix_caching=caching) for caching in models}
    dialog = [{"role": "system", "content": "You are a player in a Shakespeare company; answer in verse."}]
    turns = []
    try:
        for turn in range(a.turns):
            dialog.append({"role": "user", "content": message(turn)})
            figures, reply = {}, ""
            for caching in ((True, False) if turn % 2 else (False, True)):
                ttft, text, prompt_tokens, cached = first_token_seconds(engines[caching], dialog, a.reply_tokens)
                figures["on" if caching else "off"] = ttft
                if caching:
                    reply, figures["prompt_tokens"], figures["cached_tokens"] = text, prompt_tokens, cached
            turns.append(figures)
            dialog.append({"role": "assistant", "content": reply})
    finally:
        for engine in engines.values():
            engine.close()
    return turns


def shared_system_prompt(loaded: LoadedModel, caching: bool, a: argparse.Namespace) -> dict:
    """a.users users at once, each with the same system prompt and a question of its own, on a fresh engine."""
    tokenizer = loaded.tokenizer
    system = " ".join(LINES[k % len(LINES)] for k in range(4 * a.system_tokens))
    system = tokenizer.decode(tokenizer.encode(system, bos=False, eos=False)[: a.system_tokens])
    engine = Engine(loaded, seed=0, prefix_caching=caching).start()
    ready = threading.Barrier(a.users + 1)
    ttfts, lock = [], threading.Lock()

    def user(i: int) -> None:
        dialog = [{"role": "system", "content": system}, {"role": "user", "content": f"User {i}: {LINES[i % len(LINES)]}"}]
        ready.wait()
        start = time.perf_counter()
        stream = stream_chat(engine, dialog, temperature=0, max_new_tokens=16)
        batches = iter(stream.batches())
        next(batches)
        with lock:
            ttfts.append(time.perf_counter() - start)
        for _ in batches:
            pass

    threads = [threading.Thread(target=user, args=(i,)) for i in range(a.users)]
    for t in threads:
        t.start()
    ready.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    figures = dict(prefilled_tokens=engine.prefilled_tokens, cached_tokens=engine.cached_tokens,
                   ttft_median_s=statistics.median(ttfts), ttft_max_s=max(ttfts), all_done_s=wall)
    engine.close()
    return figures


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.tokenizer.is_file():
        sys.exit(f"error: no tokenizer at {a.tokenizer}; pass --tokenizer (a 32000-piece SentencePiece model)")
    tokenizer = Tokenizer(a.tokenizer)
    models = loaded_pair(a, tokenizer)
    print(f"{a.shape}, float32, {torch.get_num_threads()} threads, {a.runs} runs, replies: {a.replies}", flush=True)
    report = {"shape": a.shape, "threads": torch.get_num_threads(), "torch": torch.__version__, "args": vars(a) | {
        "tokenizer": str(a.tokenizer), "json": str(a.json)}}

    chats = [chat(models, a) for _ in range(a.runs)]
    report["chat"] = chats
    print("\nturn  prompt  cached  TTFT on (ms)  TTFT off (ms)  off / on   (medians over runs)")
    for turn in range(a.turns):
        rows = [run[turn] for run in chats]
        on, off = statistics.median(r["on"] for r in rows), statistics.median(r["off"] for r in rows)
        ratio = statistics.median(r["off"] / r["on"] for r in rows)
        print(f"{turn + 1:>4}  {rows[0]['prompt_tokens']:>6}  {rows[0]['cached_tokens']:>6}  {1000 * on:>12.1f}  "
              f"{1000 * off:>13.1f}  {ratio:>7.1f}x", flush=True)
    last = [run[-1]["off"] / run[-1]["on"] for run in chats]
    print(f"turn {a.turns}: time to first token {statistics.median(last):.1f}x lower with prefix caching "
          f"(runs: {', '.join(f'{x:.1f}' for x in last)})")

    shared = {"on": [], "off": []}
    for _ in range(a.runs):
        for caching in (True, False):
            shared["on" if caching else "off"].append(shared_system_prompt(models[caching], caching, a))
    report["shared_system_prompt"] = shared
    print(f"\n{a.users} users at once sharing a {a.system_tokens}-token system prompt (medians over runs):")
    for name, runs in shared.items():
        print(f"  caching {name:>3}: {runs[0]['prefilled_tokens']:>5} prompt tokens computed, {runs[0]['cached_tokens']:>5} cached; "
              f"TTFT median {1000 * statistics.median(r['ttft_median_s'] for r in runs):.0f} ms, "
              f"slowest {1000 * statistics.median(r['ttft_max_s'] for r in runs):.0f} ms; "
              f"all done in {statistics.median(r['all_done_s'] for r in runs):.2f} s")
    ratios = [off["all_done_s"] / on["all_done_s"] for on, off in zip(shared["on"], shared["off"])]
    print(f"  prompt tokens computed, off / on: {shared['off'][0]['prefilled_tokens'] / shared['on'][0]['prefilled_tokens']:.1f}x; "
          f"time until every reply ended, off / on: {statistics.median(ratios):.1f}x (runs: {', '.join(f'{x:.1f}' for x in ratios)})")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
