"""Where a reply is in its grammar (llama_core.grammar): the tokens that may come next, as a mask over the
vocabulary, from llguidance; and the texts a chat reply must never write, kept out of it token by token."""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from ..errors import InvalidRequestError
from ..grammar import Grammar, first_lines
from ..tokenizer import Tokenizer


class GrammarMatcher:
    """One reply's progress through its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer) -> None:
        """Raises InvalidRequestError where the grammar cannot be followed with this tokenizer."""
        vocabulary = _Vocabulary.of(tokenizer)
        self._matcher = LLMatcher(vocabulary.llguidance, grammar.text, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be followed: {first_lines(self._matcher.get_error())}")
        self.words = tokenizer.n_words
        self.eos = tokenizer.eos_id
        self._forbidden = tuple(text.encode() for text in grammar.forbidden if text)
        self._tail = b""  # the reply's last bytes, as many as the longest forbidden text less one
        self._vocabulary = vocabulary

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens that may come next (the end of sequence only where the grammar is
        complete, or where the only ways on write a forbidden text; none past the tokenizer's words, which a
        model's padded vocabulary may have)."""
        words = torch.empty((self.words + 31) // 32, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        width = min(vocab_size, self.words)
        allowed[:width] = bits[:width]
        if self._forbidden:
            writing = [t for t in self._vocabulary.writing(self._forbidden, self._tail) if t < width]
            allowed[writing] = False
        if not allowed.any():
            allowed[self.eos] = True
        return allowed

    def accept(self, token: int) -> bool:
        """Moves past a drawn token; False if the grammar does not allow it (the matcher then stays failed)."""
        if self._forbidden:
            keep = max(map(len, self._forbidden)) - 1
            self._tail = (self._tail + self._vocabulary.tokens[token])[-keep:] if keep else b""
        return self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Whether the grammar allows nothing more than the end of the reply."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return first_lines(self._matcher.get_error())


def allowed_tokens(matchers: list[Optional[GrammarMatcher]], vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool on the CPU: the tokens each row may draw next (all of them for a row without a
    grammar; none of those past the tokenizer's words, which a model's padded vocabulary may have)."""
    allowed = torch.ones(len(matchers), vocab_size, dtype=torch.bool)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            allowed[i] = matcher.allowed(vocab_size)
    return allowed


class _Vocabulary:
    """A SentencePiece tokenizer as the grammar sees it: each token's bytes (a control token's name marked with
    0xFF, as special), an encoder of text that starts mid-sequence (no leading space added), the LLTokenizer
    llguidance builds from them, and the tokens that would write a forbidden text. Made once per tokenizer
    (0.1 s for Llama-2's 32,000 tokens)."""

    _made: "weakref.WeakKeyDictionary[Tokenizer, _Vocabulary]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer) -> None:
        sp = tokenizer.sp_model
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token in range(tokenizer.n_words):
            piece = sp.id_to_piece(token)
            if sp.is_byte(token):
                self.tokens.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(token) or sp.is_unknown(token):
                self.tokens.append(b"\xff" + piece.encode())
                self.special_token_ids.append(token)
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode())
        self._sp = sp
        self._newline = len(sp.encode("\n"))
        self.llguidance = LLTokenizer(TokenizerWrapper(self))
        self._found: dict = {}  # texts (a tuple) or a text's rest (bytes): the tokens holding or starting with it

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "_Vocabulary":
        with cls._lock:
            found = cls._made.get(tokenizer)
            if found is None:
                found = cls._made[tokenizer] = cls(tokenizer)
            return found

    def __call__(self, text: str) -> list[int]:
        # SentencePiece starts a text with a space; after a newline it does not, so encode behind one.
        return self._sp.encode("\n" + text)[self._newline :]

    def writing(self, texts: tuple[bytes, ...], tail: bytes) -> list[int]:
        """The tokens that would write one of `texts` after a reply ending in `tail`: those holding a whole one,
        and those that start with the rest of one whose beginning `tail` ends with."""
        found = set(self._holding(texts))
        for text in texts:
            for split in range(1, len(text)):
                if tail.endswith(text[:split]):
                    found.update(self._starting(text[split:]))
        return sorted(found)

    def _holding(self, texts: tuple[bytes, ...]) -> tuple[int, ...]:
        if texts not in self._found:
            self._found[texts] = tuple(t for t, piece in enumerate(self.tokens) if any(x in piece for x in texts))
        return self._found[texts]

    def _starting(self, start: bytes) -> tuple[int, ...]:
        if start not in self._found:
            self._found[start] = tuple(t for t, piece in enumerate(self.tokens) if piece.startswith(start))
        return self._found[start]
