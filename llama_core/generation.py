"""`Llama`: Meta's reference API (build, generate, text_completion, chat_completion) and streaming, as a thin
facade over the serving engine: a generation is requests submitted to the Llama's engine and read to
their end, so the facade and a server share one decode loop."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypedDict

import torch

from . import dialog as chat_format
from .checkpoint_files import read_model_args
from .config import default_context
from .devices import resolve_kv_cache_dtype
from .errors import DialogError, InvalidRequestError, LlamaError
from .loader import DEFAULT_CKPT_DIR, LoadedModel, load
from .model import Transformer
from .runner import ModelRunner
from .serving.engine import Engine, check_count
from .serving.events import StreamChunk
from .serving.requests import MAX_SEED, check_batch, sampling_params, stop_strings
from .serving.stops import cut_at_stop
from .serving.streams import TextStream, TokenStream
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["DEFAULT_CKPT_DIR", "ChatPrediction", "CompletionPrediction", "Llama", "StreamChunk"]


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]
    logprobs: list[float]


class ChatPrediction(TypedDict, total=False):
    generation: chat_format.Message
    tokens: list[str]
    logprobs: list[float]


def _context(ckpt_dir: Optional[str | Path], asked: Optional[int]) -> int:
    """The context to allocate: the one asked for (a warning past the model's trained one), else the trained
    one, at most DEFAULT_MAX_SEQ_LEN."""
    if asked == 1 and not isinstance(asked, bool):  # other non-positive values: load says so
        raise InvalidRequestError(f"max_seq_len must be at least 2 (a prompt's first token and one more), got {asked}")
    try:
        folder = Path(ckpt_dir).expanduser() if ckpt_dir is not None else DEFAULT_CKPT_DIR
        trained = read_model_args(folder).max_seq_len
    except (LlamaError, OSError):  # load says what is wrong with the checkpoint
        trained = None
    if asked is None:
        return default_context(trained)
    if trained is not None and isinstance(asked, int) and asked > trained:
        warnings.warn(f"max_seq_len {asked} is past the {trained} tokens the model in {folder} was trained for: "
                      "text past them may lose its way", stacklevel=3)
    return asked


class Llama:
    """A loaded model, its tokenizer and the engine that serves it (max_batch_size KV-cache slots of
    max_seq_len positions).

    Generations run on the Llama's engine: in the caller's thread, or, once `serve()` has started the
    engine's own thread, batched with whatever else it serves. Built with compile=True, its step is warmed up on
    the thread that runs the steps, once: the engine's as serve() starts it, else the first generation's.
    """

    def __init__(self, model: LoadedModel, seed: Optional[int] = None, prompt_lookup: Optional[int] = None,
                 warmed_up: bool = True) -> None:
        """seed: seeds sampling (None: a random seed); prompt_lookup: the engine's (see Engine); warmed_up: False
        where the model was loaded with warm_up=False (as build loads a compiled one), so that the thread that
        runs its steps warms it up: serve()'s engine thread, or else the first generation's.

        Raises:
            InvalidRequestError: a prompt_lookup that is not a non-negative integer.
        """
        if prompt_lookup is not None:
            check_count("prompt_lookup", prompt_lookup)
        self.loaded = model
        self.runner: ModelRunner = model.runner
        self.tokenizer = model.tokenizer
        self.model: Transformer = model.runner.model
        self.args = model.runner.args
        self.max_seq_len = model.runner.max_seq_len
        self.max_batch_size = model.runner.max_batch_size
        self.device = model.runner.device
        self.dtype = model.runner.dtype
        self.ckpt_dir = model.info.ckpt_dir
        self.load_seconds = model.info.load_seconds
        self._seed = seed
        self._engine: Optional[Engine] = None
        self._engine_options: dict = dict(prompt_lookup=prompt_lookup)
        self._engine_lock = threading.Lock()
        self._warmed_up = warmed_up

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer, max_seq_len: int, max_batch_size: int,
                   seed: Optional[int] = None, compile: bool = False,
                   kv_cache_dtype: str | torch.dtype = "auto", prompt_lookup: Optional[int] = None) -> "Llama":
        """A Llama over a Transformer already in memory (weights loaded, eval mode). With compile, its step is
        warmed up as build's is: on the thread that runs the steps, or now by warm_up()."""
        runner = ModelRunner(model, max_batch_size, max_seq_len, compile,
                             kv_cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype), warm_up=False)
        return cls(LoadedModel.from_runner(runner, tokenizer), seed, prompt_lookup, warmed_up=not compile)

    @staticmethod
    def build(
        ckpt_dir: Optional[str | Path] = None,
        tokenizer_path: Optional[str | Path] = None,
        max_seq_len: Optional[int] = None,
        max_batch_size: int = 4,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: Optional[int] = None,
        device_map: Optional[str | dict] = None,
        max_memory: Optional[dict] = None,
        tensor_parallel: bool = False,
        compile: bool = False,
        quantize: Optional[str] = None,
        kv_cache_dtype: str | torch.dtype = "auto",
        prompt_lookup: Optional[int] = None,
    ) -> "Llama":
        """Loads a checkpoint in Meta or Hugging Face layout.

        Args:
            ckpt_dir: checkpoint directory; None loads the project's embedded default model.
            tokenizer_path: SentencePiece model; defaults to tokenizer.model in ckpt_dir, then its parent.
            max_seq_len: context length to allocate the KV cache for; None: the one the model was trained
                for, at most 2048. Past the trained one, a warning (replies may lose their way there).
            max_batch_size: most sequences generated at once.
            device: "auto" (CUDA when present, else CPU), "cpu" or "cuda[:N]".
            dtype: "auto" or a dtype name. "auto" on CUDA is the 16-bit dtype a Hugging Face checkpoint says it
                is stored in (float16 for Llama-2's), else bfloat16 (float16 where bf16 is unsupported); on CPU
                float32 (16-bit weights keep their 16 bits in the CPU kernels).
            seed: seeds sampling; None draws a random seed.
            compile: decode with a step compiled by torch.compile: on CUDA every slot at once, a CUDA graph per
                context length; on CPU symbolic shapes (see llama_core.runner). It is compiled on the thread that
                runs the steps (CUDA graphs are per thread), once: by serve() on the engine's, else by the first
                generation on its caller's.
            device_map: places whole layers over several devices with accelerate (instead of `device`):
                "auto" spreads them over the GPUs, offloading to CPU memory as a last resort; or a dict like
                {"tok_embeddings": 0, "layers.0": 0, ..., "output": 1} (see llama_core.distributed.device_map).
                Not with compile.
            max_memory: with a device_map strategy, the most each device may hold: {0: "20GiB", "cpu": "64GiB"}.
            tensor_parallel: under `torchrun --nproc_per_node N`, splits heads and FFN units over the N
                processes. Rank 0 gets the Llama, which drives every rank; on the other ranks this call
                serves rank 0's steps until rank 0 exits, then exits the process (see
                llama_core.distributed.parallel). Not with compile.
            quantize: "int8" stores every projection's weight as int8 with one scale per output channel,
                once loaded (on CPU faster than float32, with 8-bit activations; see llama_core.quantize);
                "int4" as 4-bit groups of 32 with a scale each, the output layer as int8 (llama_core.int4);
                None keeps the dtype's weights. Not with device_map or tensor_parallel.
            kv_cache_dtype: "auto" keeps keys and values in the model's dtype; "float16" or "bfloat16" in a
                float32 model halves the KV cache's memory (on the CPU, a long context also decodes faster),
                rounding each key and value to 16 bits.
            prompt_lookup: the most tokens a decode step drafts from the sequence's own earlier text and
                verifies at once; the text is the same as without (see Engine). None: 5 on llama_core's CPU kernels,
                0 elsewhere.

        Raises:
            CheckpointNotFoundError: a directory or file is missing.
            CheckpointError: a file is unreadable or the parts don't fit together.
            InvalidRequestError: a bad max_seq_len, max_batch_size, device, dtype, quantize, kv_cache_dtype or
                prompt_lookup;
                or, on one device (the CPU or a GPU), a model whose weights and KV cache would not fit in the
                memory free there now (the message names the arguments that would).
        """
        if prompt_lookup is not None:  # before the weights load
            check_count("prompt_lookup", prompt_lookup)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise InvalidRequestError(f"seed must be None or an integer from 0 to {MAX_SEED}, got {seed!r}")
        if not isinstance(compile, bool):
            raise InvalidRequestError(f"compile must be True or False, got {compile!r}")
        max_seq_len = _context(ckpt_dir, max_seq_len)
        loaded = load(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size, device, dtype, device_map,
                      max_memory, tensor_parallel, compile, quantize=quantize, kv_cache_dtype=kv_cache_dtype,
                      warm_up=False)
        return Llama(loaded, seed, prompt_lookup, warmed_up=not compile)

    @property
    def parameter_count(self) -> int:
        return self.runner.parameter_count

    # -- the engine ---------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine every generation of this Llama runs on (made on first use)."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = Engine(self.loaded, seed=self._seed, **self._engine_options)
            return self._engine

    def warm_up(self) -> None:
        """Compiles a compiled step now, in this thread, rather than in the first generation (a no-op where it
        is done, or nothing is compiled). Call it from the thread that will run the generations: serve() warms
        the step up on the engine's own thread instead (CUDA graphs are per thread)."""
        self._engine_here()

    def _engine_here(self) -> Engine:
        """The engine, for a generation whose turns run in the calling thread unless it is served: a step not yet
        warmed up is warmed up here first (served, the engine's thread has done it)."""
        engine = self.engine
        if not self._warmed_up and not engine.running:
            with self._engine_lock:
                if not self._warmed_up:
                    engine.warm_up()
                    self._warmed_up = True
        return engine

    def serve(self, max_waiting: int = 64, prefill_chunk: Optional[int] = None,
              after_turn: Optional[Callable[[], None]] = None, prefix_caching: bool = True,
              prompt_lookup: Optional[int] = None) -> Engine:
        """The Llama's engine, running in a thread of its own, for a server; `with llama.serve() as engine:`
        stops that thread at the end. Options other than the current engine's replace it, which needs the
        current one idle (see Engine for the options; prompt_lookup None: the Llama's own).

        Raises:
            LlamaError: the current engine is busy and other options were asked for.
        """
        if prompt_lookup is None:
            prompt_lookup = self._engine_options.get("prompt_lookup")
        options = dict(max_waiting=max_waiting, prefill_chunk=prefill_chunk, after_turn=after_turn,
                       prefix_caching=prefix_caching, prompt_lookup=prompt_lookup)
        with self._engine_lock:
            if self._engine is not None and options != self._engine_options:
                if self._engine.busy:
                    raise LlamaError("the engine is busy with requests; finish them before serving with other options")
                self._engine.close()
                self._engine = None
            self._engine_options = options
        engine = self.engine.start()  # warms the step up on its thread, the one that runs the steps from now
        self._warmed_up = True
        return engine

    # -- tokens in, tokens out -------------------------------------------------------------------
    def generate(
        self,
        prompt_tokens: list[list[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
        **controls: Any,
    ) -> tuple[list[list[int]], Optional[list[list[float]]]]:
        """Continues each prompt until its EOS or max_gen_len new tokens (or the context is full).

        The other sampling controls are keywords named as in SamplingParams: top_k, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, stop (a prompt's tokens end with the one
        that completes a stop string, found in the generated text as text_completion reads it: after the
        prompt's with echo, else alone), seed.

        Returns:
            Per prompt, the generated tokens (after the prompt tokens with echo; EOS not included), and
            with logprobs, the natural-log probability of each returned token (0.0 for the first prompt token).

        Raises:
            InvalidRequestError / ContextLengthError: a request this model can't run (nothing runs).
            RequestFailedError: a request failed inside the engine (e.g. out of memory); GrammarFailedError,
                one of them and an InvalidRequestError, where its reply could not go on in its grammar.
        """
        self._check_call(prompt_tokens, max_gen_len)
        params = sampling_params(temperature, top_p, logprobs, **controls)
        engine = self._engine_here()
        requests = [engine.check(p, self._clamped(max_gen_len), prompt_logprobs=logprobs and echo, params=params,
                                 name=f"prompt {i}", standalone_text=not echo) for i, p in enumerate(prompt_tokens)]
        streams: list[TokenStream] = []
        try:
            streams = [engine.submit_request(r) for r in requests]
            results = [list(stream) for stream in streams]  # reading one runs the turns that serve them all
        finally:
            for stream in streams:
                stream.cancel()
        out_tokens = [(list(p) if echo else []) + [c.token for c in chunks] for p, chunks in zip(prompt_tokens, results)]
        if not logprobs:
            return out_tokens, None
        out_logprobs = [[c.logprob for c in chunks] for chunks in results]
        if echo:
            out_logprobs = [[0.0] + s.prompt_logprobs + lps for s, lps in zip(streams, out_logprobs)]
        return out_tokens, out_logprobs

    def stream(
        self,
        prompt_tokens: list[int],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        continue_prompt: bool = True,
        **controls: Any,
    ) -> Iterator[StreamChunk]:
        """Generates for one prompt, yielding each token with the text it completes as soon as it exists.

        With continue_prompt, pieces are decoded after the prompt, so decode(prompt) + the pieces reads as
        decode(prompt + generated) (a completion that starts a new word starts with its space). Without it,
        the pieces join to decode(generated), as a chat reply's content is. Text held back for a whole
        character (or a possible stop string) comes last, in a chunk of token -1. Leaving the iteration early,
        or closing or dropping the iterator unread, cancels the request. Other sampling controls are keywords, as for generate (with top_logprobs, each
        chunk carries the model's most likely alternatives).

        Raises:
            InvalidRequestError / ContextLengthError: at once, for a request this model can't run.
        """
        self._check_call([prompt_tokens], max_gen_len)
        params = sampling_params(temperature, top_p, **controls)
        engine = self._engine_here()
        request = engine.check(prompt_tokens, self._clamped(max_gen_len), params=params, name="prompt 0",
                               standalone_text=not continue_prompt)
        tokens = engine.submit_request(request)
        decoder = StreamDecoder(self.tokenizer, prompt_tokens if continue_prompt else ())
        return iter(TextStream(tokens, decoder, len(prompt_tokens), self.max_seq_len, stop=params.stop))

    # -- text in, text out -----------------------------------------------------------------------
    def text_completion(
        self,
        prompts: list[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        **controls: Any,
    ) -> list[CompletionPrediction]:
        """Completes each prompt; returns dicts with "generation" (and "tokens", "logprobs" when asked).
        Other sampling controls are keywords, as for generate; a generation ends before its first stop string."""
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError("prompts must be a list of strings")
        prompt_tokens = [self.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
        tokens, lps = self.generate(
            prompt_tokens, self._default_gen_len(max_gen_len), temperature, top_p, logprobs, echo, **controls
        )
        stops = stop_strings(controls.get("stop"))
        results = []
        for i, (t, p) in enumerate(zip(tokens, prompt_tokens)):
            text = self._text(t, p if echo else [], stops)
            n = self._writing(t, text) if stops else len(t)
            results.append(self._prediction(text, t[:n], lps[i][:n] if lps else None))
        return results

    def chat_completion(
        self,
        dialogs: list[chat_format.Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        **controls: Any,
    ) -> list[ChatPrediction]:
        """Answers each dialog as the assistant. A dialog holding a special tag is not run: its reply is
        UNSAFE_ERROR; the other dialogs are answered as usual. Old turns are dropped to fit the context. A
        reply ends where the model starts writing a dialog tag, as at the stop strings of `stop`; other
        sampling controls are keywords, as for generate."""
        if not isinstance(dialogs, (list, tuple)) or not dialogs:
            raise InvalidRequestError(f"dialogs must be a non-empty list of dialogs, got {dialogs!r:.60}")
        check_batch(dialogs, self.max_batch_size, "dialogs")
        for i, dialog in enumerate(dialogs):  # a malformed dialog is an error, tags or not
            try:
                chat_format.validate_dialog(dialog)
            except DialogError as exc:
                raise DialogError(f"dialog {i}: {exc}" if len(dialogs) > 1 else str(exc)) from None
        max_gen_len = self._default_gen_len(max_gen_len)
        unsafe = [chat_format.has_special_tags(d) for d in dialogs]
        prompts = [
            self.prepare_chat(d, max_gen_len).prompt_tokens for d, bad in zip(dialogs, unsafe) if not bad
        ]
        params = sampling_params(temperature, top_p, logprobs, **controls).with_stop(chat_format.SPECIAL_TAGS)
        stops = params.stop
        tokens, lps = self.generate(prompts, max_gen_len, temperature, top_p, logprobs, params=params) if prompts else ([], None)
        results, answered = [], iter(range(len(prompts)))
        for bad in unsafe:
            if bad:  # not run: no tokens
                results.append(self._prediction({"role": "assistant", "content": chat_format.UNSAFE_ERROR}, [],
                                                [] if logprobs else None))
                continue
            i = next(answered)
            text = self._text(tokens[i], [], stops)
            n = self._writing(tokens[i], text)
            results.append(self._prediction({"role": "assistant", "content": text}, tokens[i][:n],
                                            lps[i][:n] if lps else None))
        return results

    def prepare_chat(self, dialog: chat_format.Dialog, max_gen_len: int) -> chat_format.FittedDialog:
        """Validates and encodes a dialog, dropping its oldest turns until it fits with room for the reply:
        max_gen_len tokens, but at most half the context (a longer reply still runs until the context is full)."""
        return chat_format.prepare_chat(self.tokenizer, self.max_seq_len, dialog, max_gen_len)

    # -- checks and helpers --------------------------------------------------------------------
    def _check_call(self, prompt_tokens: list[list[int]], max_gen_len: int) -> None:
        """Raises InvalidRequestError for what Meta's API checks beyond each request (which the engine checks):
        max_gen_len, and a batch of at most max_batch_size prompts."""
        if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int) or max_gen_len < 1:
            raise InvalidRequestError(f"max_gen_len must be an integer >= 1, got {max_gen_len!r}")
        check_batch(prompt_tokens, self.max_batch_size)

    def _clamped(self, max_gen_len: int) -> int:
        """Meta's max_gen_len may exceed the context; the engine's max_new_tokens may not (a reply still
        stops when the context is full)."""
        return min(max_gen_len, self.max_seq_len - 1)

    def _text(self, tokens: list[int], prompt: list[int], stops: tuple[str, ...]) -> str:
        """The text of generated tokens (after an echoed prompt's), up to the first stop string."""
        text = self.tokenizer.decode(tokens)
        if not stops:
            return text
        prompt_text = self.tokenizer.decode(prompt) if prompt else ""
        return prompt_text + cut_at_stop(text[len(prompt_text):], stops)

    def _writing(self, tokens: list[int], text: str) -> int:
        """How many of tokens it takes to write text, the generation cut before a stop string: the tokens past
        those wrote only the stop string (or a dialog tag), so a result's tokens and logprobs leave them out."""
        if len(self.tokenizer.decode(tokens)) <= len(text):
            return len(tokens)
        low, high = 0, len(tokens)  # the shortest prefix whose text reaches text's end
        while low < high:
            middle = (low + high) // 2
            if len(self.tokenizer.decode(tokens[:middle])) >= len(text):
                high = middle
            else:
                low = middle + 1
        return low

    def _default_gen_len(self, max_gen_len: Optional[int]) -> int:
        return self.max_seq_len - 1 if max_gen_len is None else max_gen_len

    def _prediction(self, generation, tokens: list[int], logprobs: Optional[list[float]]) -> dict:
        result = {"generation": generation}
        if logprobs is not None:
            result["tokens"] = [self.tokenizer.decode([t]) for t in tokens]
            result["logprobs"] = logprobs
        return result
