"""What the page shows of requests and of the model, as text: the line under a reply or completion, a completion's
prompt size, its tokens' alternatives and marked text, the probabilities' colours, and the Model tab's table."""

from __future__ import annotations

import colorsys
import os
from typing import Any, Optional

from ..errors import LlamaError
from ..loader import ModelInfo
from ..serving import requests
from ..serving.streams import TextEngine

PROBABILITY_LABELS = [f"{i / 100:.2f}" for i in range(101)]
PROBABILITY_COLORS = {  # red (unlikely) through amber to green (likely)
    label: "#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hls_to_rgb(float(label) / 3, 0.78, 0.75))
    for label in PROBABILITY_LABELS
}


def prompt_size_line(engine: TextEngine, prompt: Any) -> str:
    """The completion prompt's size in tokens (BOS included) against the model's context, or what is wrong."""
    try:
        prompt = requests.text(prompt, "prompt")
    except LlamaError as exc:
        return f"Prompt: {exc}."
    if not prompt:
        return "Prompt: empty."
    tokens, max_seq_len = len(engine.tokenizer.encode(prompt, bos=True, eos=False)), engine.info.max_seq_len
    if tokens >= max_seq_len:
        return (f"Prompt: **{tokens:,} tokens**, but the model holds {max_seq_len:,} in all: shorten it by at "
                f"least {plural(tokens - max_seq_len + 1, 'token')} to leave room for any continuation.")
    return (f"Prompt: **{tokens:,} tokens** (BOS included) of the model's {max_seq_len:,}; room for "
            f"{max_seq_len - tokens:,} more.")


def marked_completion(prompt: str, generated: str) -> list[tuple[str, Optional[str]]]:
    """The prompt as plain text and the generated text marked, for a gr.HighlightedText."""
    return [(prompt, None)] + ([(generated, "generated")] if generated else [])


def alternatives_table(token: dict) -> str:
    """A generated token's most likely alternatives, as a Markdown table (empty for a prompt token)."""
    rows = token.get("alternatives") or []
    if not rows:
        return ""
    head = f"**{_markdown_cell(token['token'])}** ({token['probability']:.1%}) · the model's most likely tokens here:\n\n"
    return head + "| token | probability |\n|---|---|\n" + "\n".join(
        f"| {_markdown_cell(row['token'])} | {row['probability']:.1%} |" for row in rows)


def _markdown_cell(text: str) -> str:
    shown = text.replace("\n", "↵").replace("|", "\\|").replace("`", "'")
    return f"`{shown}`" if shown.strip() else f"`{shown or '∅'}`"


STOPPED_STATS = "Stopped: the reply above was cut short."  # under a reply Stop ended
AT_TOKEN_LIMIT = " · stopped at the token limit"  # in the line under a reply that max_new_tokens ended


def plural(count: int, noun: str) -> str:
    """"1 exchange", "2 exchanges"."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def stats_line(stats: dict, reply: Optional[str] = None) -> str:
    """The line shown under a reply (its text: `reply`): speed, tokens, context used, and whether old exchanges
    were dropped."""
    if stats["finish_reason"] == "refused":
        return "Refused: the message holds reserved chat-format tags."
    drafted = f" ({stats['accepted_tokens']} of them drafted ahead)" if stats.get("accepted_tokens") else ""
    speed = f"{stats['tokens_per_second']:.1f} tokens/s · " if stats["tokens_per_second"] > 0 else ""  # none to measure
    generated, used = stats["generated_tokens"], stats["prompt_tokens"] + stats["generated_tokens"]
    line = (f"{speed}{generated} token{'' if generated == 1 else 's'} generated{drafted} · context "
            f"{used} / {stats['max_seq_len']} tokens "
            f"({stats['prompt_tokens']} prompt" + (f", {stats['cached_tokens']} of them cached" if stats.get("cached_tokens") else "")
            + ")")
    if stats["finish_reason"] == "length":
        line += " · stopped: the context is full" if used >= stats["max_seq_len"] else AT_TOKEN_LIMIT
    elif stats["finish_reason"] in ("eos", "stop") and not generated:
        line += " · nothing written: the model ended at once"
    elif stats["finish_reason"] in ("eos", "stop") and reply is not None and not reply.strip():
        line += " · nothing to read: the model wrote only white space, then ended"
    if stats["dropped_pairs"]:
        dropped = stats["dropped_pairs"]
        line += (f"\n\n**Note:** the {'oldest exchange was' if dropped == 1 else f'{dropped} oldest exchanges were'} "
                 f"left out to fit the {stats['max_seq_len']}-token context: the model no longer sees "
                 f"{'it' if dropped == 1 else 'them'}.")
    return line


def model_facts(info: ModelInfo) -> str:
    args = info.args
    # Meta's params.json does not state the trained context: say so rather than show an assumed 4,096.
    trained_for = f"trained for {args.max_seq_len:,}" if args.max_seq_len is not None else \
        "the trained context not stated by the checkpoint"
    rows = [
        # Names only: the page must not show the server's disk layout.
        ("Checkpoint", f"`{os.path.basename(os.path.normpath(str(info.ckpt_dir)))}`"),
        ("Tokenizer", f"`{os.path.basename(str(info.tokenizer_path))}` ({args.vocab_size:,} pieces)"),
        ("Parameters", f"{info.parameter_count:,}"),
        ("Layers · width · heads (kv)", f"{args.n_layers} · {args.dim} · {args.n_heads} ({args.n_kv_heads})"),
        ("dtype · device", f"{info.weights} · {info.device}"),
        *([("CPU products", info.cpu_products)] if info.cpu_products else []),
        ("Memory", f"weights {_size(info.weights_bytes)} · KV cache {_size(info.kv_cache_bytes)}"
                   + (f" in {info.kv_cache_dtype}" if info.kv_cache_dtype else "")),
        ("Context (max_seq_len)", f"{info.max_seq_len:,} tokens ({trained_for})"),
        ("Batch (max_batch_size)", f"{info.max_batch_size} requests decoded together"),
        ("Load time", f"{info.load_seconds:.2f} s"),
    ]
    return "| Model | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"

