"""SentencePiece tokenizer with Meta's interface, and incremental decoding for streaming."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from sentencepiece import SentencePieceProcessor

from .errors import CheckpointError, CheckpointNotFoundError


class Tokenizer:
    """Encodes text to token ids and back, like Meta's llama.Tokenizer."""

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise CheckpointNotFoundError(f"tokenizer model not found: {path}")
        self.sp_model = SentencePieceProcessor()
        try:
            self.sp_model.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read tokenizer model {path}: {exc}") from exc
        self.model_path = path
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of s, optionally framed by BOS and EOS ids."""
        if not isinstance(s, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(s).__name__}")
        ids = self.sp_model.encode(s)
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp_model.decode(list(ids))

    def token_text(self, token: int) -> str:
        """One token's text as it reads inside a sequence (its leading space kept; a byte piece as <0xNN>)."""
        return self.sp_model.id_to_piece(int(token)).replace("\u2581", " ")


class StreamDecoder:
    """Turns a growing list of token ids into text pieces as they become final.

    SentencePiece drops the leading space of a sequence's first piece, and a character spelled in
    byte-fallback pieces is only complete after its last byte. So each new piece is decoded together
    with a few tokens of context, and text ending in an incomplete character is held back. A context that
    ends within a character (a prompt of token ids cut there) has that character completed by the new
    tokens: it is their text.
    """

    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(context[-self._CONTEXT:])
        self.prefix_start = 0  # tokens[prefix_start:emitted_end] decode to text already emitted
        self.emitted_end = len(self.tokens)

    def push(self, token: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self.tokens.append(token)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_start : self.emitted_end])
        full = self.tokenizer.decode(self.tokens[self.prefix_start :])
        shown = _shared_length(prefix, full)
        if full.endswith("\ufffd") or len(full) <= shown:
            return ""
        piece = full[shown:]
        self.prefix_start = max(self.prefix_start, len(self.tokens) - self._CONTEXT)
        self.emitted_end = len(self.tokens)
        return piece

    def flush(self) -> str:
        """Text of any held-back tokens, as decoded now (replacement characters included)."""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_start : self.emitted_end])
        full = self.tokenizer.decode(self.tokens[self.prefix_start :])
        self.emitted_end = len(self.tokens)
        return full[_shared_length(prefix, full) :]


def _shared_length(shown: str, full: str) -> int:
    """How much of `full` is the text already shown: all of `shown`, but where `shown` ends in a character cut
    short (a context ending within one, its bytes decoded as U+FFFD) that the new tokens complete, the part
    before it."""
    if full.startswith(shown):
        return len(shown)
    return len(os.path.commonprefix([shown, full]))
