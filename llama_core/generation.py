"""`Llama`: build a model from a checkpoint and generate from it, with Meta's reference API."""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, TypedDict

import torch

from . import dialog as chat_format
from .checkpoint import load_model, read_model_args
from .config import ModelArgs
from .decode import DecodeStep, right_padded
from .errors import CheckpointError, CheckpointNotFoundError, ContextLengthError, InvalidRequestError, LlamaError
from .model import Transformer, execution_device
from .sampling import sample, token_logprobs, validate_sampling
from .tokenizer import StreamDecoder, Tokenizer

DEFAULT_CKPT_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-shakespeare"


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]
    logprobs: list[float]


class ChatPrediction(TypedDict, total=False):
    generation: chat_format.Message
    tokens: list[str]
    logprobs: list[float]


@dataclass
class StreamChunk:
    """One generated token as it streams: its id, log-probability and the text it completes."""

    token: int
    logprob: float
    text: str


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} asked for, but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidRequestError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise InvalidRequestError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return names[dtype]


class Llama:
    """A loaded model, its tokenizer and its KV cache (max_batch_size rows of max_seq_len positions)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        max_seq_len: int,
        max_batch_size: int,
        seed: Optional[int] = None,
        ckpt_dir: Optional[Path] = None,
        load_seconds: float = 0.0,
        compile: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.args: ModelArgs = model.args
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.ckpt_dir = ckpt_dir
        self.load_seconds = load_seconds
        self.device = execution_device(model.tok_embeddings)  # where inputs go; logits come back here too
        self.dtype = model.tok_embeddings.weight.dtype
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._cache_lock = threading.Lock()
        self._cache_owner: Optional[object] = None  # an Engine serving this Llama
        self._cache_holder: Optional[int] = None  # thread running a generation
        if model.layers[0].attention.wqkv is None:
            model.fuse_projections()
        if self.device.type == "cpu":
            model.use_column_major_weights()
        model.setup_caches(max_batch_size, max_seq_len)
        self.decode_step = DecodeStep(model, max_batch_size, compile)

    @staticmethod
    def build(
        ckpt_dir: Optional[str | Path] = None,
        tokenizer_path: Optional[str | Path] = None,
        max_seq_len: int = 2048,
        max_batch_size: int = 4,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: Optional[int] = None,
        device_map: Optional[str | dict] = None,
        max_memory: Optional[dict] = None,
        tensor_parallel: bool = False,
        compile: bool = False,
    ) -> "Llama":
        """Loads a checkpoint in Meta or Hugging Face layout.

        Args:
            ckpt_dir: checkpoint directory; None loads the project's embedded default model.
            tokenizer_path: SentencePiece model; defaults to tokenizer.model in ckpt_dir, then its parent.
            max_seq_len: context length to allocate the KV cache for.
            max_batch_size: most sequences generated at once.
            device: "auto" (CUDA when present, else CPU), "cpu" or "cuda[:N]".
            dtype: "auto" (bfloat16 on CUDA, float16 where bf16 is unsupported, float32 on CPU) or a dtype name.
            seed: seeds sampling; None draws a random seed.
            compile: decode with static shapes under torch.compile (a CUDA graph per step on CUDA);
                the first steps are slow while it compiles (see llama_core.decode).
            device_map: places whole layers over several devices with accelerate (instead of `device`):
                "auto" spreads them over the GPUs, offloading to CPU memory as a last resort; or a dict like
                {"tok_embeddings": 0, "layers.0": 0, ..., "output": 1} (see llama_core.device_map).
            max_memory: with a device_map strategy, the most each device may hold: {0: "20GiB", "cpu": "64GiB"}.
            tensor_parallel: under `torchrun --nproc_per_node N`, splits heads and FFN units over the N
                processes. Rank 0 gets the Llama, which drives every rank; on the other ranks this call
                serves rank 0's steps until rank 0 exits, then exits the process (see llama_core.parallel).

        Raises:
            CheckpointNotFoundError: a directory or file is missing.
            CheckpointError: a file is unreadable or the parts don't fit together.
            InvalidRequestError: a bad max_seq_len, max_batch_size, device or dtype.
        """
        start = time.perf_counter()
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        ckpt_dir = Path(ckpt_dir).expanduser() if ckpt_dir is not None else DEFAULT_CKPT_DIR
        if not ckpt_dir.is_dir():
            hint = " (the embedded default model; see models/README.md)" if ckpt_dir == DEFAULT_CKPT_DIR else ""
            raise CheckpointNotFoundError(f"checkpoint directory not found: {ckpt_dir}{hint}")
        tokenizer = Tokenizer(_find_tokenizer(ckpt_dir, tokenizer_path))
        args = read_model_args(ckpt_dir)
        if args.vocab_size == -1:
            args.vocab_size = tokenizer.n_words
        if args.vocab_size != tokenizer.n_words:
            raise CheckpointError(
                f"tokenizer {tokenizer.model_path} has {tokenizer.n_words} pieces but the model in "
                f"{ckpt_dir} has vocab_size {args.vocab_size}"
            )
        if max_memory is not None and not isinstance(device_map, str):
            raise InvalidRequestError("max_memory goes with a device_map strategy such as device_map='auto'")
        if tensor_parallel:
            from . import parallel

            if device_map is not None:
                raise InvalidRequestError("device_map and tensor_parallel exclude each other: choose one")
            torch_device = parallel.init_distributed(device, args)
            model = parallel.load_model_shard(ckpt_dir, args, torch_device, resolve_dtype(dtype, torch_device))
        elif device_map is not None:
            from .device_map import load_dispatched

            if str(device) != "auto":
                raise InvalidRequestError(f"device_map places the model: leave device as 'auto', got {device!r}")
            model = load_dispatched(ckpt_dir, args, dtype, device_map, max_memory, max_batch_size, max_seq_len)
        else:
            torch_device = resolve_device(device)
            model = load_model(ckpt_dir, args, torch_device, resolve_dtype(dtype, torch_device))
        llama = Llama(model, tokenizer, max_seq_len, max_batch_size, seed, ckpt_dir, time.perf_counter() - start, compile)
        if tensor_parallel:
            parallel.lead_or_serve(llama)  # returns on rank 0 only
        return llama

    def claim_cache(self, owner: object) -> bool:
        """Gives the KV cache to owner (a serving engine) until release_cache; False if already owned."""
        with self._cache_lock:
            if self._cache_owner is not None:
                return False
            self._cache_owner = owner
            return True

    def release_cache(self, owner: object) -> None:
        with self._cache_lock:
            if self._cache_owner is owner:
                self._cache_owner = None

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- tokens in, tokens out -------------------------------------------------------------------
    def generate(
        self,
        prompt_tokens: list[list[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
    ) -> tuple[list[list[int]], Optional[list[list[float]]]]:
        """Continues each prompt until its EOS or max_gen_len new tokens (or the context is full).

        Returns:
            Per prompt, the generated tokens (after the prompt tokens with echo; EOS not included), and
            with logprobs, the natural-log probability of each returned token (0.0 for the first prompt token).
        """
        self.check_request(prompt_tokens, max_gen_len, temperature, top_p)
        out_tokens = [list(p) if echo else [] for p in prompt_tokens]
        out_logprobs = [[] for _ in prompt_tokens]
        prompt_lps = [[] for _ in prompt_tokens] if (logprobs and echo) else None
        steps = list(self._generate_steps(prompt_tokens, max_gen_len, temperature, top_p, logprobs, prompt_lps))
        # One transfer for the whole generation: the decode loop itself never waits for the host.
        tokens, lps, emits = (torch.stack(column, dim=1).tolist() for column in zip(*steps))
        for row in range(len(prompt_tokens)):
            out_tokens[row] += [t for t, e in zip(tokens[row], emits[row]) if e]
            out_logprobs[row] += [lp for lp, e in zip(lps[row], emits[row]) if e]
        if not logprobs:
            return out_tokens, None
        if echo:
            out_logprobs = [[0.0] + p + g for p, g in zip(prompt_lps, out_logprobs)]
        return out_tokens, out_logprobs

    def stream(
        self,
        prompt_tokens: list[int],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        continue_prompt: bool = True,
    ) -> Iterator[StreamChunk]:
        """Generates for one prompt, yielding each token with the text it completes as soon as it exists.

        With continue_prompt, pieces are decoded after the prompt, so decode(prompt) + the pieces reads as
        decode(prompt + generated) (a completion that starts a new word starts with its space). Without it,
        the pieces join to decode(generated), as a chat reply's content is.

        Raises:
            InvalidRequestError / ContextLengthError: at once, for a request this model can't run.
        """
        self.check_request([prompt_tokens], max_gen_len, temperature, top_p)
        decoder = StreamDecoder(self.tokenizer, prompt_tokens if continue_prompt else ())
        return self._stream_chunks(decoder, prompt_tokens, max_gen_len, temperature, top_p)

    def _stream_chunks(self, decoder, prompt_tokens, max_gen_len, temperature, top_p) -> Iterator[StreamChunk]:
        steps = self._generate_steps([prompt_tokens], max_gen_len, temperature, top_p, want_logprobs=True, sync_every=1)
        for tokens, logprobs, emits in steps:
            if bool(emits[0]):
                token = int(tokens[0])
                yield StreamChunk(token, float(logprobs[0]), decoder.push(token))
        tail = decoder.flush()
        if tail:
            yield StreamChunk(-1, 0.0, tail)

    # -- text in, text out -----------------------------------------------------------------------
    def text_completion(
        self,
        prompts: list[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
    ) -> list[CompletionPrediction]:
        """Completes each prompt; returns dicts with "generation" (and "tokens", "logprobs" when asked)."""
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError("prompts must be a list of strings")
        prompt_tokens = [self.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
        tokens, lps = self.generate(
            prompt_tokens, self._default_gen_len(max_gen_len), temperature, top_p, logprobs, echo
        )
        return [self._prediction(self.tokenizer.decode(t), t, lps[i] if lps else None) for i, t in enumerate(tokens)]

    def chat_completion(
        self,
        dialogs: list[chat_format.Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
    ) -> list[ChatPrediction]:
        """Answers each dialog as the assistant. A dialog holding a special tag is not run: its reply is
        UNSAFE_ERROR; the other dialogs are answered as usual. Old turns are dropped to fit the context."""
        if not isinstance(dialogs, (list, tuple)) or not dialogs:
            raise InvalidRequestError(f"dialogs must be a non-empty list of dialogs, got {dialogs!r:.60}")
        max_gen_len = self._default_gen_len(max_gen_len)
        unsafe = [chat_format.has_special_tags(d) for d in dialogs]
        prompts = [
            self.prepare_chat(d, max_gen_len).prompt_tokens for d, bad in zip(dialogs, unsafe) if not bad
        ]
        tokens, lps = self.generate(prompts, max_gen_len, temperature, top_p, logprobs) if prompts else ([], None)
        results, answered = [], iter(range(len(prompts)))
        for bad in unsafe:
            if bad:
                results.append({"generation": {"role": "assistant", "content": chat_format.UNSAFE_ERROR}})
                continue
            i = next(answered)
            text = self.tokenizer.decode(tokens[i])
            results.append(self._prediction({"role": "assistant", "content": text}, tokens[i], lps[i] if lps else None))
        return results

    def prepare_chat(self, dialog: chat_format.Dialog, max_gen_len: int) -> chat_format.FittedDialog:
        """Validates and encodes a dialog, dropping its oldest turns until it fits with room for the reply:
        max_gen_len tokens, but at most half the context (a longer reply still runs until the context is full)."""
        return prepare_chat(self.tokenizer, self.max_seq_len, dialog, max_gen_len)

    # -- checks and helpers --------------------------------------------------------------------
    def check_request(self, prompt_tokens: Sequence[Sequence[int]], max_gen_len: int, temperature: float, top_p: float) -> None:
        """Raises InvalidRequestError or ContextLengthError for a request this model can't run."""
        validate_sampling(temperature, top_p)
        if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int) or max_gen_len < 1:
            raise InvalidRequestError(f"max_gen_len must be an integer >= 1, got {max_gen_len!r}")
        if not isinstance(prompt_tokens, (list, tuple)) or not prompt_tokens:
            raise InvalidRequestError("no prompts given: expected a non-empty list of prompts")
        if len(prompt_tokens) > self.max_batch_size:
            raise InvalidRequestError(
                f"{len(prompt_tokens)} prompts given, but max_batch_size is {self.max_batch_size}"
            )
        for i, prompt in enumerate(prompt_tokens):
            if not isinstance(prompt, (list, tuple)) or not prompt:
                raise InvalidRequestError(f"prompt {i} is empty: it needs at least one token")
            if not all(isinstance(t, int) and 0 <= t < self.args.vocab_size for t in prompt):
                raise InvalidRequestError(f"prompt {i} has token ids outside [0, {self.args.vocab_size})")
            if len(prompt) >= self.max_seq_len:
                raise ContextLengthError(
                    f"prompt {i} has {len(prompt)} tokens, but max_seq_len is {self.max_seq_len}: "
                    f"it must be at most {self.max_seq_len - 1} to leave room for a reply"
                )

    def _default_gen_len(self, max_gen_len: Optional[int]) -> int:
        return self.max_seq_len - 1 if max_gen_len is None else max_gen_len

    def _prediction(self, generation, tokens: list[int], logprobs: Optional[list[float]]) -> dict:
        result = {"generation": generation}
        if logprobs is not None:
            result["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
            result["logprobs"] = logprobs
        return result

    @torch.inference_mode()
    def _generate_steps(
        self,
        prompt_tokens: Sequence[Sequence[int]],
        max_gen_len: int,
        temperature: float,
        top_p: float,
        want_logprobs: bool = False,
        prompt_logprobs: Optional[list[list[float]]] = None,
        sync_every: Optional[int] = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yields, each decode step, device tensors (tokens [B], logprobs [B], emits [B]): emits marks the
        rows whose token is generated output (not EOS, not past the row's end); logprobs are NaN unless
        want_logprobs. Whether every row is done is read on the host only every sync_every steps
        (default: each step on CPU, every 8th on CUDA, where waiting each step would stall the GPU).

        Prompts are right-padded and prefilled together; each row then decodes at its own position, so a
        row's tokens equal its solo generation. If prompt_logprobs is given, it is filled with each row's
        log-probabilities of prompt tokens 1..n-1.
        """
        if self._cache_holder == threading.get_ident():
            raise LlamaError(
                "the KV cache is in use by an unfinished generation on this thread (a stream not read to "
                "the end?): finish or close() it before generating again"
            )
        with self._cache_lock:
            self._cache_holder = threading.get_ident()
            try:
                yield from self._decode(
                    prompt_tokens, max_gen_len, temperature, top_p, want_logprobs, prompt_logprobs, sync_every
                )
            finally:
                self._cache_holder = None

    def _decode(self, prompt_tokens, max_gen_len, temperature, top_p, want_logprobs, prompt_logprobs, sync_every):
        """The body of _generate_steps, run while holding the KV cache."""
        if self._cache_owner is not None:
            raise LlamaError("this Llama is being served by an Engine, which owns its KV cache: submit to the engine")
        device, batch = self.device, len(prompt_tokens)
        tokens, positions, lengths = right_padded(prompt_tokens, self.tokenizer.eos_id, device)
        longest = tokens.shape[1]
        if prompt_logprobs is None:
            logits = self.model(tokens, positions, kv_len=longest, logit_index=lengths - 1)[:, 0]
        else:
            all_logits = self.model(tokens, positions, kv_len=longest)
            prompt_lp = token_logprobs(all_logits[:, :-1], tokens[:, 1:]).tolist()
            for row, prompt in enumerate(prompt_tokens):
                prompt_logprobs[row].extend(prompt_lp[row][: len(prompt) - 1])
            logits = all_logits[torch.arange(batch, device=device), lengths - 1]
        budget = torch.clamp(self.max_seq_len - lengths, max=max_gen_len)
        generated = torch.zeros_like(lengths)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        if sync_every is None:
            sync_every = 1 if device.type == "cpu" else 8
        for step in itertools.count(1):
            next_tokens = sample(logits, temperature, top_p, self.generator)
            logprobs = token_logprobs(logits, next_tokens) if want_logprobs else torch.full_like(logits[:, 0], math.nan)
            emits = ~done & (next_tokens != self.tokenizer.eos_id)
            generated += emits
            done |= ~emits | (generated >= budget)
            yield next_tokens, logprobs, emits
            if step % sync_every == 0 or step >= max_gen_len:
                if bool(done.all()):
                    return
            positions = torch.clamp(lengths + generated - 1, max=self.max_seq_len - 1)
            # Every row's position is at most longest + step - 1: a bound known without asking the device.
            logits = self.decode_step(next_tokens, positions, kv_len=min(longest + step, self.max_seq_len))


def prepare_chat(tokenizer: Tokenizer, max_seq_len: int, dialog: chat_format.Dialog, max_gen_len: int) -> chat_format.FittedDialog:
    """Llama.prepare_chat for a model with this tokenizer and context length."""
    chat_format.validate_dialog(dialog)
    room = max(1, min(max_gen_len, max_seq_len // 2))
    return chat_format.fit_dialog(tokenizer, dialog, max_seq_len - room)


def _find_tokenizer(ckpt_dir: Path, tokenizer_path: Optional[str | Path]) -> Path:
    if tokenizer_path is not None:
        path = Path(tokenizer_path).expanduser()
        if not path.is_file():
            raise CheckpointNotFoundError(f"tokenizer model not found: {path}")
        return path
    for candidate in (ckpt_dir / "tokenizer.model", ckpt_dir.parent / "tokenizer.model"):
        if candidate.is_file():
            return candidate
    raise CheckpointNotFoundError(
        f"no tokenizer.model in {ckpt_dir} or its parent {ckpt_dir.parent}; pass tokenizer_path"
    )
