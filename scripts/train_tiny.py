"""Trains the project's embedded default model: a small Llama-2-architecture model (grouped-query
attention) and its SentencePiece tokenizer, on Shakespeare's plays, using llama_core's own model code.

The model sees two streams, mixed half and half:
  * the plain text of the plays (for completion), and
  * Llama-2 chat dialogs built from consecutive speeches: one speech is the user's message, the next
    the assistant's reply, the replying speaker's name in the system prompt, laid out by llama_core.dialog.

    python scripts/train_tiny.py --data ../shared/data/tinyshakespeare.txt --out llama_core/models/tiny-shakespeare

Resumable: it saves train_state.pt in --work-dir every --save-every steps and picks up from it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core.config import ModelArgs  # noqa: E402
from llama_core.dialog import SPECIAL_TAGS, encode_dialog  # noqa: E402
from llama_core.model import Transformer  # noqa: E402
from llama_core.resources import DEFAULT_CKPT_DIR, DEFAULT_PROMPTS_DIR  # noqa: E402
from llama_core.tokenizer import Tokenizer  # noqa: E402

DEFAULT_SYSTEM_PROMPT = DEFAULT_PROMPTS_DIR / "system_prompt.txt"
SPEECH = re.compile(r"^([A-Z][A-Za-z' ]+):\n(.+)$", re.S)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("../shared/data/tinyshakespeare.txt"))
    p.add_argument("--out", type=Path, default=DEFAULT_CKPT_DIR)
    p.add_argument("--work-dir", type=Path, default=Path("runs/tiny-shakespeare"))
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--multiple-of", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--evaluate", action="store_true",
                   help="only measure the exported model in --out (losses, unigram baseline) and update its training.json")
    return p.parse_args()


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Train/validation split at a speech boundary near the end of the text."""
    cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction))) + 2
    return text[:cut], text[cut:]


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs in order; speeches are blank-line separated 'NAME:\\nlines' blocks."""
    found = []
    for block in text.split("\n\n"):
        match = SPEECH.match(block.strip())
        if match and not any(tag in block for tag in SPECIAL_TAGS):
            found.append((match.group(1).strip(), match.group(2).strip()))
    return found


def chat_dialogs(text: str, default_system: str, rng: random.Random) -> list[list[dict]]:
    """Dialogs of 1-2 (user, assistant) exchanges from consecutive speeches by different speakers."""
    parts, dialogs, i = speeches(text), [], 0
    while i + 1 < len(parts):
        turns = rng.choice((2, 2, 4))
        window = parts[i : i + turns]
        i += turns
        if len(window) < 2 or len(window) % 2:
            continue
        reply_speaker = window[1][0]
        if window[0][0] == reply_speaker:
            continue
        system = rng.random()
        if system < 0.6:
            head = [{"role": "system", "content": f"You are {reply_speaker.title()}. Speak as {reply_speaker.title()} would."}]
        elif system < 0.8:
            head = [{"role": "system", "content": default_system}]
        else:
            head = []
        body = [{"role": "user" if k % 2 == 0 else "assistant", "content": speech} for k, (_, speech) in enumerate(window)]
        dialogs.append(head + body)
    return dialogs


def train_tokenizer(text: str, dialogs_text: str, vocab_size: int, out_prefix: Path) -> Path:
    import sentencepiece as spm

    corpus = out_prefix.with_suffix(".corpus.txt")
    corpus.write_text(text + "\n" + dialogs_text)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out_prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=SPECIAL_TAGS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        max_sentence_length=1 << 16,
        num_threads=2,
        minloglevel=2,
    )
    return out_prefix.with_suffix(".model")


def encode_stream(tokenizer: Tokenizer, text: str, dialogs: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor]:
    # The plays in one piece, tokenized as a prompt would be: encoding each speech on its own would
    # teach the model SentencePiece's dummy-prefix space at the start of every speech.
    plain = tokenizer.encode(text, bos=True, eos=False)
    chat = []
    for d in dialogs:
        chat += encode_completed_dialog(tokenizer, d)
    return torch.tensor(plain, dtype=torch.long), torch.tensor(chat, dtype=torch.long)


def encode_completed_dialog(tokenizer: Tokenizer, dialog: list[dict]) -> list[int]:
    """A dialog that ends with the assistant's reply, each exchange laid out as llama_core encodes a
    completed one: encode it with a placeholder user turn appended, then cut that turn (from its BOS) off."""
    tokens = encode_dialog(tokenizer, dialog + [{"role": "user", "content": "?"}])
    last_bos = len(tokens) - 1 - tokens[::-1].index(tokenizer.bos_id)
    return tokens[:last_bos]


def batch_from(streams: list[torch.Tensor], batch_size: int, seq_len: int, gen: torch.Generator):
    rows = []
    for r in range(batch_size):
        stream = streams[r % len(streams)]
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start : start + seq_len + 1])
    batch = torch.stack(rows)
    return batch[:, :-1], batch[:, 1:]


@torch.no_grad()
def evaluate(model: Transformer, streams: list[torch.Tensor], seq_len: int, device: str, max_windows: int = 64) -> float:
    """Mean next-token loss (nats) over non-overlapping windows of the given streams."""
    was_training = model.training
    model.eval()
    losses = []
    for stream in streams:
        n = min(max_windows, (len(stream) - 1) // seq_len)
        windows = stream[: n * seq_len + 1]
        x = windows[:-1].view(n, seq_len).to(device)
        y = windows[1:].view(n, seq_len).to(device)
        for i in range(0, n, 16):
            logits = model(x[i : i + 16])
            losses.append(F.cross_entropy(logits.flatten(0, 1), y[i : i + 16].flatten(), reduction="sum").item())
    model.train(was_training)
    return sum(losses) / sum(min(max_windows, (len(s) - 1) // seq_len) * seq_len for s in streams)


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    text = a.data.read_text()
    train_text, val_text = split_text(text, a.val_fraction)
    default_system = DEFAULT_SYSTEM_PROMPT.read_text().strip()
    train_dialogs = chat_dialogs(train_text, default_system, rng)
    val_dialogs = chat_dialogs(val_text, default_system, rng)

    if a.evaluate:
        report_losses(a, train_text, val_text, train_dialogs, val_dialogs)
        return

    tok_path = a.work_dir / "tokenizer.model"
    if not tok_path.exists():
        sample = "\n".join(encode_dialog_text(d) for d in train_dialogs[:3000])
        train_tokenizer(train_text, sample, a.vocab_size, a.work_dir / "tokenizer")
    tokenizer = Tokenizer(tok_path)
    train_streams = encode_stream(tokenizer, train_text, train_dialogs)
    val_streams = encode_stream(tokenizer, val_text, val_dialogs)
    print(f"train tokens: plain {len(train_streams[0]):,} chat {len(train_streams[1]):,}; "
          f"val tokens: plain {len(val_streams[0]):,} chat {len(val_streams[1]):,}")

    args = ModelArgs(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                     vocab_size=tokenizer.n_words, multiple_of=a.multiple_of, max_seq_len=2 * a.seq_len)
    model = Transformer(args).to(a.device)
    init_weights(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed)
    step, state_path = 0, a.work_dir / "train_state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step = state["step"]
        print(f"resumed from {state_path} at step {step}")
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {args}")

    model.train()
    progress = tqdm(total=a.steps, initial=step, desc="training", unit="step")
    started, loss_avg = time.time(), None
    while step < a.steps:
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch_from(list(train_streams), a.batch_size, a.seq_len, gen)
        logits = model(x.to(a.device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(a.device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        progress.update(1)
        progress.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{lr:.2e}")
        if step % a.save_every == 0 or step == a.steps:
            val = evaluate(model, list(val_streams), a.seq_len, a.device, max_windows=16)
            tqdm.write(f"step {step}: train loss {loss_avg:.3f}, val loss {val:.3f}, {time.time() - started:.0f}s")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "generator": gen.get_state(), "step": step}, state_path)
    progress.close()

    with torch.no_grad():  # measure what is shipped: weights rounded to bfloat16
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    train_loss = evaluate(model, list(train_streams), a.seq_len, a.device)
    val_loss = evaluate(model, list(val_streams), a.seq_len, a.device)
    export(model, args, tok_path, a, train_loss, val_loss, len(train_streams[0]) + len(train_streams[1]))
    print(f"final train loss {train_loss:.4f}, val loss {val_loss:.4f}; saved to {a.out}")


def unigram_loss(train_tokens: torch.Tensor, eval_tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of eval_tokens under add-one-smoothed unigram counts of train_tokens."""
    counts = torch.bincount(train_tokens, minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[eval_tokens].mean())


def held_out_losses(model: Transformer, tokenizer: Tokenizer, train_text: str, val_text: str, seq_len: int,
                    val_dialogs=(), windows: int = 64) -> dict:
    """Model and unigram losses (nats/token) on the held-out plain text, and the model's on held-out chats."""
    train_plain, _ = encode_stream(tokenizer, train_text, [])
    val_plain, val_chat = encode_stream(tokenizer, val_text, list(val_dialogs))
    n = min(windows, (len(val_plain) - 1) // seq_len)
    result = {
        "val_loss_plain": evaluate(model, [val_plain], seq_len, "cpu", max_windows=windows),
        "unigram_val_loss_plain": unigram_loss(train_plain, val_plain[1 : n * seq_len + 1], tokenizer.n_words),
    }
    if len(val_chat) > seq_len:
        result["val_loss_chat"] = evaluate(model, [val_chat], seq_len, "cpu", max_windows=windows)
    return result


def report_losses(a, train_text: str, val_text: str, train_dialogs, val_dialogs) -> None:
    from llama_core.checkpoint import load_model
    from llama_core.checkpoint_files import read_model_args

    args = read_model_args(a.out)
    tokenizer = Tokenizer(a.out / "tokenizer.model")
    args.vocab_size = tokenizer.n_words
    model = load_model(a.out, args, torch.device("cpu"), torch.float32)
    seq_len = json.loads((a.out / "training.json").read_text())["seq_len"]
    losses = held_out_losses(model, tokenizer, train_text, val_text, seq_len, val_dialogs)
    train_plain, train_chat = encode_stream(tokenizer, train_text, train_dialogs)
    losses["train_loss"] = evaluate(model, [train_plain, train_chat], seq_len, "cpu")
    record = json.loads((a.out / "training.json").read_text())
    record.update({k: round(v, 4) for k, v in losses.items()})
    (a.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


def encode_dialog_text(dialog: list[dict]) -> str:
    """The dialog in its chat layout as plain text (BOS/EOS omitted), for tokenizer training."""
    from llama_core.dialog import B_INST, B_SYS, E_INST, E_SYS

    turns = list(dialog)
    if turns[0]["role"] == "system":
        turns = [{"role": "user", "content": B_SYS + turns[0]["content"] + E_SYS + turns[1]["content"]}] + turns[2:]
    return " ".join(
        f"{B_INST} {u['content'].strip()} {E_INST} {r['content'].strip()}" for u, r in zip(turns[::2], turns[1::2])
    )


def init_weights(model: Transformer, args: ModelArgs) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            torch.nn.init.normal_(p, mean=0.0, std=std)


def export(model: Transformer, args: ModelArgs, tok_path: Path, a, train_loss: float, val_loss: float, n_tokens: int) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    torch.save(state, a.out / "consolidated.00.pth")
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "multiple_of": args.multiple_of, "ffn_dim_multiplier": None,
              "norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "max_seq_len": args.max_seq_len}
    (a.out / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    (a.out / "tokenizer.model").write_bytes(tok_path.read_bytes())
    (a.out / "training.json").write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "steps": a.steps, "batch_size": a.batch_size,
        "seq_len": a.seq_len, "lr": a.lr, "seed": a.seed, "train_tokens": n_tokens,
        "train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4), "val_fraction": a.val_fraction,
        "val_start_char": len(split_text(a.data.read_text(), a.val_fraction)[0]),
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
