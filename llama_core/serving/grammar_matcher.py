"""Where a reply is in its grammar (llama_core.grammar): the tokens that may come next, as a mask over the
vocabulary, from llguidance; and the texts a chat reply must never write, kept out of it token by token."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterable, Iterator, Optional

import torch

from ..errors import InvalidRequestError
from ..grammar import Grammar, first_lines, unfollowable
from ..tokenizer import Tokenizer


class GrammarMatcher:
    """One reply's progress through its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, end_ids: Iterable[int] = ()) -> None:
        """end_ids: tokens that end a reply as the tokenizer's EOS does (generation_config.json's), allowed where
        EOS is and nowhere else.

        Raises InvalidRequestError where the grammar cannot be followed with this tokenizer."""
        from llguidance import LLMatcher  # imported by the first request with a grammar: the engine runs without it

        vocabulary = _Vocabulary.of(tokenizer)
        self._matcher = LLMatcher(vocabulary.llguidance, grammar.text, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(unfollowable("the grammar", self._matcher.get_error()))
        self.words = tokenizer.n_words
        self.eos = tokenizer.eos_id
        self.other_ends = sorted(t for t in set(end_ids) - {self.eos} if t < tokenizer.n_words)  # others never drawn
        self._forbidden = tuple(text.encode() for text in grammar.forbidden if text)
        self._tail = b""  # the reply's last bytes, as many as the longest forbidden text less one
        self._vocabulary = vocabulary
        self._tried: Optional[int] = None  # tokens accepted inside trying(), to take back

    def check_start(self, vocab_size: int) -> None:
        """Raises InvalidRequestError where no reply can begin: the grammar fails at its first token (past the
        lexer's limits, a schema that only refers to itself) or allows none (in a chat, only a dialog tag)."""
        allowed = self.allowed(vocab_size)
        if self._matcher.is_error():
            raise InvalidRequestError(unfollowable("the grammar", self._matcher.get_error()))
        allowed[[t for t in (self.eos, *self.other_ends) if t < vocab_size]] = False
        if not self.accepting and not bool(allowed.any()):
            raise InvalidRequestError(f"no reply can follow the grammar{self._stuck}")

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens that may come next (see allowed_tokens)."""
        return allowed_tokens([self], vocab_size)[0]

    def banned(self) -> list[int]:
        """The tokens the grammar allows that would write a forbidden text now."""
        return self._vocabulary.writing(self._forbidden, self._tail) if self._forbidden else []

    def accept(self, token: int) -> bool:
        """Moves past a drawn token; False if the grammar does not allow it (the matcher then stays failed)."""
        if self._forbidden:
            keep = max(map(len, self._forbidden)) - 1
            self._tail = (self._tail + self._vocabulary.tokens[token])[-keep:] if keep else b""
        accepted = self._matcher.consume_token(token)
        if accepted and self._tried is not None:
            self._tried += 1
        return accepted

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, as the tokenizer spells the bytes it forces (a JSON object's
        next key, say); empty where more than one way on is open."""
        return self._matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the start, the grammar would accept now (nothing is consumed)."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    @contextlib.contextmanager
    def trying(self) -> Iterator[None]:
        """Tokens accepted inside are taken back at its end (masks for a draft's positions)."""
        tail, self._tried = self._tail, 0
        try:
            yield
        finally:
            if self._tried:
                self._matcher.rollback(self._tried)
            self._tail, self._tried = tail, None

    @property
    def complete(self) -> bool:
        """Whether the grammar allows nothing more than the end of the reply."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the reply may end here: the grammar is matched (though it may allow more)."""
        return self._matcher.is_accepting()

    @property
    def dead_end(self) -> str:
        """Why the reply ends before its grammar is matched: nothing the grammar allows next may be written."""
        return f"the reply cannot follow its grammar{self._stuck}"

    @property
    def _stuck(self) -> str:
        if self._forbidden:
            tags = ", ".join(text.decode() for text in self._forbidden)
            return f" without writing a text a chat reply may not hold ({tags})"
        return ": no token can come next"

    @property
    def error(self) -> str:
        return first_lines(self._matcher.get_error())


def allowed_tokens(matchers: list[Optional[GrammarMatcher]], vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool on the CPU: the tokens each row may draw next. A row without a grammar may draw
    any; one with a grammar, the tokens the grammar allows (the end of sequence, and the other end ids, only where
    it is complete) less those that would write a forbidden text, and none past the tokenizer's words (a model's
    padded vocabulary); where that leaves none, the end of sequence."""
    allowed = torch.ones(len(matchers), vocab_size, dtype=torch.bool)
    held = [(i, matcher) for i, matcher in enumerate(matchers) if matcher is not None]
    if not held:
        return allowed
    words = max(matcher.words for _, matcher in held)
    masks = torch.zeros((len(held), (words + 31) // 32), dtype=torch.int32)  # the rows with a grammar only
    for row, (_, matcher) in zip(masks, held):  # each releases the interpreter's lock while it computes
        matcher._matcher.unsafe_compute_mask_ptr(row.data_ptr(), masks.shape[1] * 4)
    width = min(words, vocab_size)
    bits = ((masks[:, :, None] >> _BITS) & 1).view(len(held), -1)[:, :width].bool()
    if len(held) == len(matchers):
        allowed[:, :width] = bits
    else:
        allowed[[i for i, _ in held], :width] = bits
    for i, matcher in held:
        if matcher.words < vocab_size:
            allowed[i, matcher.words :] = False  # a model's padded vocabulary, past its tokenizer's words
        banned = [token for token in matcher.banned() if token < vocab_size]
        if banned:
            allowed[i, banned] = False
        ends = [token for token in matcher.other_ends if token < vocab_size]
        if ends:  # the grammar reads them as text: they end the reply, so they may come where EOS may
            allowed[i, ends] = bool(allowed[i, matcher.eos])
    any_allowed = allowed.view(torch.uint8).amax(dim=1).tolist()
    for i, matcher in held:
        if not any_allowed[i]:
            allowed[i, matcher.eos] = True
    return allowed


def allowed_along_drafts(matchers: list[Optional[GrammarMatcher]], drafts: list[list[int]], width: int,
                         vocab_size: int) -> torch.Tensor:
    """[len(matchers) * width, vocab_size] bool: for a forward over each request's last token and its draft
    (width positions each), the tokens each position may draw: position j after the draft's first j tokens.
    Each draft must be one its grammar accepts (valid_prefix); positions past a draft may draw any token."""
    allowed = torch.ones(len(matchers) * width, vocab_size, dtype=torch.bool)
    with contextlib.ExitStack() as trials:
        for matcher in matchers:
            if matcher is not None:
                trials.enter_context(matcher.trying())
        for j in range(width):
            at = [m if m is not None and j <= len(d) else None for m, d in zip(matchers, drafts)]
            if not any(at):
                break
            allowed[j::width] = allowed_tokens(at, vocab_size)
            for matcher, draft in zip(at, drafts):
                if matcher is not None and j < len(draft):
                    matcher.accept(draft[j])
    return allowed


_BITS = torch.arange(32, dtype=torch.int32)


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
        self._newline = sp.encode("\n")
        self._by_bytes: dict[bytes, int] = {}  # for greedy tokenizing: each text's first plain token
        for token, piece in enumerate(self.tokens):
            if token not in self.special_token_ids and piece:
                self._by_bytes.setdefault(piece, token)
        self._longest = max(map(len, self._by_bytes), default=1)
        from llguidance import LLTokenizer, TokenizerWrapper

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
        """text's tokens as they follow other text: exactly its bytes. SentencePiece starts a text with a
        space, unless it follows a newline (where the tokenizer keeps newlines); elsewhere the longest tokens
        that spell it, one after another."""
        wanted = text.encode()
        for ids in (self._sp.encode("\n" + text)[len(self._newline):] if self._newline else None,
                    self._sp.encode(text)):
            if ids is not None and b"".join(self.tokens[i] for i in ids) == wanted:
                return ids
        return self.greedy(wanted)

    def greedy(self, text: bytes) -> list[int]:
        """The longest token at each place, where it spells a whole token (every byte has one in Llama-2's
        tokenizers); a byte with none is left out."""
        ids, at = [], 0
        while at < len(text):
            for length in range(min(self._longest, len(text) - at), 0, -1):
                token = self._by_bytes.get(text[at : at + length])
                if token is not None:
                    ids.append(token)
                    at += length
                    break
            else:
                at += 1
        return ids

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
