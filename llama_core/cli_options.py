"""What the command lines (`llama-chat`, `llama-generate`) share: their argument parser, the model options
and the checks of those options before a model loads; `llama-export` checks its checkpoint with them too.

`add_model_options(parser)` adds --ckpt-dir, --tokenizer, --max-seq-len, --allow-longer-context, --device,
--dtype, --quantize, --kv-cache-dtype and --prompt-lookup (the engine's, read directly). `check_model_options(args)` judges them cheapest first: the
checkpoint's files, config and tokenizer (milliseconds, no torch), then the device and dtype (imports
torch, loads nothing);
`check_memory(plan, max_batch_size)` then asks whether a CPU model fits in the memory that is free. A value that
cannot work raises `OptionError`, whose message names the flag and the fix; the command prints it as one
line and exits before any weight is read: with status 2 (a usage error, as argparse's own) for the options
themselves, 1 (`ResourceError`) where what they name cannot be used here: a checkpoint or file missing or
unreadable, a device this machine lacks, too little memory (see `exit_status`).
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checkpoint_files import (checkpoint_layout, find_tokenizer, read_model_args, stored_dtype, vocabulary_fits,
                               weight_files)
from .config import DEFAULT_MAX_SEQ_LEN, ModelArgs, default_context
from .errors import CheckpointError, CheckpointNotFoundError, LlamaError
from .resources import DEFAULT_CKPT_DIR, PACKAGE_DIR
from .tokenizer import Tokenizer

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("none", "int8", "int4")  # --quantize; llama_core.quantize.QUANTIZATIONS besides none


EXIT_FAILURE = 1  # the command line was fine, running it failed: files, the machine, the model, the prompt
EXIT_USAGE = 2  # the command line itself is wrong, as argparse's own errors
# Under torchrun, what a rank > 0 waits before leaving with a refusal that rank 0 says: torchrun stops every process
# as soon as one fails, and rank 0, stopped before it had printed, said nothing.
RANK_0_FIRST_SECONDS = 5.0
EXIT_STATUS_EPILOG = ("exit status: 0 success; 1 a failure at run time (a checkpoint or file missing or unusable, a "
                      "device this machine lacks, too little memory, weights that fail to load, a bad prompt); 2 a "
                      "usage error (an unknown option, a bad value, options that exclude each other)")


class OptionError(LlamaError, ValueError):
    """A command-line option that cannot work; the message names the flag and what to do instead. A usage
    error: the command exits with status 2."""


class ResourceError(OptionError):
    """An option whose value is well formed but names what cannot be used here: a checkpoint, tokenizer or file
    missing or unreadable, a device this machine lacks, too little free memory. A run-time failure: the command
    exits with status 1."""


def exit_status(error: LlamaError) -> int:
    """A command's exit status for an error it stops on: 2 (EXIT_USAGE) for an option that cannot work whatever
    the machine, 1 (EXIT_FAILURE) for any other: what the options name, loading the model, or the prompt."""
    return EXIT_USAGE if isinstance(error, OptionError) and not isinstance(error, ResourceError) else EXIT_FAILURE


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors like the checks' own (no usage block before them)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class ModelPlan:
    """The model a command line will load, from its checked options."""

    ckpt_dir: Path
    tokenizer_path: Path
    args: ModelArgs  # vocab_size filled in from the tokenizer
    max_seq_len: int  # context to allocate
    device: str  # what "auto" resolved to: "cpu", "cuda:0"..., or "device map auto"
    dtype: str  # "float32", "bfloat16" or "float16"
    warnings: tuple[str, ...] = ()  # accepted, but the user should know (a context beyond training)
    quantize: Optional[str] = None  # "int8" or "int4", or None for the dtype's own weights
    kv_cache_dtype: str = "auto"  # "auto" is dtype

    @property
    def name(self) -> str:
        return self.ckpt_dir.name

    def summary(self) -> str:
        """One line: name, size, context, device, dtype and int8 or int4 weights where quantized."""
        trained = self.args.max_seq_len
        trained_for = f"trained for {trained:,}" if trained else "trained context not stated by the checkpoint"
        return (f"{self.name}: {_count(self.args.parameter_count)} parameters, context {self.max_seq_len:,} tokens "
                f"({trained_for}), {self.device}, {self.dtype}" + (f", {self.quantize} weights" if self.quantize else "")
                + (f", {self.kv_cache_dtype} KV cache" if self.kv_cache_dtype not in ("auto", self.dtype) else ""))


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Adds the flags check_model_options reads."""
    parser.add_argument("--ckpt-dir", type=Path, help="checkpoint directory, Meta or Hugging Face layout "
                        f"(default: the embedded model, {DEFAULT_CKPT_DIR.relative_to(PACKAGE_DIR.parent)})")
    parser.add_argument("--tokenizer", type=Path, help="SentencePiece tokenizer.model (default: in the checkpoint "
                        "directory, then its parent)")
    parser.add_argument("--max-seq-len", type=positive_int, help="context length in tokens, prompt and reply "
                        f"together (default: the model's trained context, at most {DEFAULT_MAX_SEQ_LEN})")
    parser.add_argument("--allow-longer-context", action="store_true", help="accept a --max-seq-len beyond the "
                        "context the model was trained for (output degrades past it)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N "
                        "(default: auto)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights' dtype; auto is, on CUDA, the 16-bit dtype the checkpoint is stored in (else "
                             "bfloat16), and float32 on CPU (default: auto)")
    parser.add_argument("--quantize", default="none", choices=QUANTIZE_CHOICES,
                        help="int8: store the projections' weights as int8, one scale per output channel (on CPU "
                        "faster than float32; log-probabilities move slightly). int4: 4-bit weights in groups of 32 "
                        "with a scale each, the output layer int8: about 0.6 of int8's memory, on CPU faster still "
                        "at a few rows; log-probabilities move more (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=DTYPES,
                        help="keys and values kept for the context; auto is --dtype's. float16 with float32 on CPU "
                             "holds twice the context in the same memory and decodes long contexts faster, each key "
                             "and value rounded to 16 bits (default: auto)")
    parser.add_argument("--prompt-lookup", type=non_negative_int, metavar="N",
                        help="draft up to N tokens a step from what followed the reply's last few tokens earlier in "
                             "the prompt or reply, and keep those the model confirms in the same forward (prompt-"
                             "lookup decoding): the same text, faster where it repeats earlier text; 0 is off "
                             "(default: 5 on CPU with llama_core's kernels, else 0)")


def non_negative_int(text: str) -> int:
    """argparse type: 0 or a positive integer."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return int(text)


def plain_warnings() -> None:
    """Shows Python warnings as a command's own lines, `warning: ...`, not with their source file and line."""
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def check_model_options(options: argparse.Namespace, device_map: Optional[str] = None) -> ModelPlan:
    """Checks the model options without loading weights; with device_map, the device is accelerate's to place.

    Raises:
        OptionError: a value that cannot work, named with its flag and the fix; a ResourceError where the value
            names a checkpoint, tokenizer or device that cannot be used here.
    """
    ckpt_dir = check_checkpoint(options.ckpt_dir)
    tokenizer_path, vocab_size = check_tokenizer(ckpt_dir, options.tokenizer)
    args = read_model_args(ckpt_dir)
    if args.vocab_size == -1:
        args.vocab_size = vocab_size
    if not vocabulary_fits(vocab_size, args.vocab_size):
        raise ResourceError(f"--tokenizer {_shown(tokenizer_path)} has {vocab_size:,} pieces but the model in {_shown(ckpt_dir)} has "
                          f"vocab_size {args.vocab_size:,}: pass the tokenizer.model that came with these weights")
    max_seq_len, warnings = check_context(options.max_seq_len, options.allow_longer_context, args, ckpt_dir.name)
    warnings += thread_warnings(getattr(options, "threads", None))
    quantize = check_quantize(options.quantize, device_map)
    device, dtype = check_device(options.device, options.dtype, device_map, stored_dtype(ckpt_dir))
    return ModelPlan(ckpt_dir, tokenizer_path, args, max_seq_len, device, dtype, warnings, quantize,
                     options.kv_cache_dtype)


def thread_warnings(threads: Optional[int]) -> tuple[str, ...]:
    """A warning where --threads asks for more threads than this process may run at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None or threads <= cores:
        return ()
    return (f"--threads {threads} is more than the {cores} CPU core(s) this process may use: threads then take "
            f"turns on a core, and run slower than {cores} would",)


def check_memory(plan: ModelPlan, max_batch_size: int, compile: bool = False) -> None:
    """Refuses a CPU model whose weights and KV cache (for max_batch_size slots of the whole context) would not
    fit in the memory free now: loading it would swap, or end with the system killing the process. The
    message gives what would fit. A GPU's free memory is checked by the process that loads the model
    (asking here would start CUDA in the web server's process)."""
    from .memory_plan import cpu_shortfall

    if plan.device != "cpu":
        return
    shortfall = cpu_shortfall(plan.args, plan.ckpt_dir, plan.dtype, plan.quantize, plan.kv_cache_dtype,
                              max_batch_size, plan.max_seq_len, compile)
    if shortfall is not None:
        raise ResourceError(shortfall.describe("flags"))


def _shown(path: object) -> str:
    """A path for an error's one line: as typed, or quoted where it holds a newline or another unprintable
    character."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def check_checkpoint(ckpt_dir: Optional[Path]) -> Path:
    """The checkpoint folder to load (the embedded model for None), holding a config and weights."""
    if ckpt_dir is None:
        if not DEFAULT_CKPT_DIR.is_dir():
            raise ResourceError(f"the embedded default model is missing from {DEFAULT_CKPT_DIR}: reinstall llama_core, "
                              "or pass --ckpt-dir")
        ckpt_dir = DEFAULT_CKPT_DIR
    ckpt_dir = ckpt_dir.expanduser()
    layouts = "params.json (Meta layout) or config.json (Hugging Face layout)"
    if ckpt_dir.is_file():
        raise ResourceError(f"--ckpt-dir {_shown(ckpt_dir)} is a file, not a directory: pass the folder holding {layouts} "
                          f"and the weights, e.g. --ckpt-dir {ckpt_dir.parent}")
    if not ckpt_dir.is_dir():
        raise ResourceError(f"--ckpt-dir {_shown(ckpt_dir)}: no such directory; pass the folder holding {layouts} and the weights")
    try:
        checkpoint_layout(ckpt_dir)
    except CheckpointNotFoundError as exc:
        raise ResourceError(f"--ckpt-dir {_shown(ckpt_dir)} holds no {layouts}: pass the folder of a checkpoint") from exc
    try:
        read_model_args(ckpt_dir)
    except CheckpointError as exc:
        raise ResourceError(f"--ckpt-dir {_shown(ckpt_dir)}: {exc}") from exc
    try:
        weight_files(ckpt_dir)
    except (CheckpointNotFoundError, CheckpointError) as exc:
        raise ResourceError(f"--ckpt-dir {_shown(ckpt_dir)} has no weights: {exc}; put the weight files (consolidated.NN.pth, "
                          "*.safetensors or pytorch_model*.bin) beside its config, or pass the folder that has them") from exc
    return ckpt_dir


def check_tokenizer(ckpt_dir: Path, tokenizer: Optional[Path]) -> tuple[Path, int]:
    """The tokenizer file (given, or found beside the checkpoint) and how many pieces it has."""
    if tokenizer is not None and tokenizer.expanduser().is_dir():
        inside = tokenizer.expanduser() / "tokenizer.model"
        hint = f"--tokenizer {inside}" if inside.is_file() else "the tokenizer.model file"
        raise ResourceError(f"--tokenizer {_shown(tokenizer)} is a directory: pass {hint}")
    try:
        path = find_tokenizer(ckpt_dir, tokenizer)
    except CheckpointNotFoundError as exc:
        if tokenizer is not None:
            raise ResourceError(f"--tokenizer {_shown(tokenizer)}: no such file; pass the SentencePiece tokenizer.model that "
                              "came with the weights") from exc
        raise ResourceError(f"no tokenizer.model in {_shown(ckpt_dir)} or its parent: pass --tokenizer "
                          "PATH/tokenizer.model (the SentencePiece model that came with the weights)") from exc
    try:
        return path, Tokenizer(path).n_words
    except LlamaError as exc:
        flag = "--tokenizer" if tokenizer is not None else "the tokenizer"
        raise ResourceError(f"{flag} {_shown(path)} is not a SentencePiece model ({exc}): pass the tokenizer.model that came "
                          "with the weights") from exc


def check_context(max_seq_len: Optional[int], allow_longer: bool, args: ModelArgs, name: str) -> tuple[int, tuple[str, ...]]:
    """The context to allocate, and a warning where it runs past the trained one by --allow-longer-context.
    A checkpoint that does not state its trained context (Meta's params.json) takes any --max-seq-len."""
    trained = args.max_seq_len
    if max_seq_len is None:
        return default_context(trained), ()
    if trained is None or max_seq_len <= trained:
        return max_seq_len, ()
    if not allow_longer:
        raise OptionError(f"--max-seq-len {max_seq_len} is beyond the {trained:,} tokens {name} was trained for: "
                          f"pass --max-seq-len {trained} or less, or add --allow-longer-context to run past it anyway")
    return max_seq_len, (f"--max-seq-len {max_seq_len:,} is beyond the {trained:,} tokens {name} was trained for "
                         f"(--allow-longer-context): expect the output to lose coherence past {trained:,} tokens",)


def check_device(device: str, dtype: str, device_map: Optional[str] = None, stored: Optional[str] = None) -> tuple[str, str]:
    """What --device and --dtype resolve to on this machine (for a checkpoint stored in `stored`, see
    resolve_dtype), as names. Imports torch; loads nothing."""
    import torch

    from .devices import resolve_device, resolve_dtype

    if device_map is not None:
        if device != "auto":
            raise OptionError(f"--device {device} and --device-map {device_map} exclude each other: the device map "
                              "places the model; leave out --device")
        on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return f"device map {device_map}", str(resolve_dtype(dtype, on, stored)).removeprefix("torch.")
    try:
        resolved = resolve_device(device)
    except LlamaError as exc:
        if device.startswith("cuda"):
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ResourceError(f"--device {device}: this machine has no CUDA GPU that torch can use (torch "
                              f"{torch.__version__}, {build}): use --device cpu, or auto") from exc
        raise OptionError(f"--device {device!r}: must be auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ResourceError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if resolved.type == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ResourceError(f"--dtype bfloat16: {torch.cuda.get_device_name(resolved)} does not support it: use "
                          "--dtype float16 (or auto, which picks it)")
    return str(resolved), str(resolve_dtype(dtype, resolved, stored)).removeprefix("torch.")


def check_quantize(quantize: str, device_map: Optional[str] = None) -> Optional[str]:
    """--quantize as the loader takes it: None for none."""
    if quantize not in QUANTIZE_CHOICES:  # argparse's choices refuse it first; this is for other callers
        raise OptionError(f"--quantize {quantize}: must be one of {', '.join(QUANTIZE_CHOICES)}")
    if quantize != "none" and device_map is not None:
        raise OptionError(f"--quantize {quantize} and --device-map {device_map} exclude each other: {quantize} "
                          "weights run on one device; leave out one of them")
    return None if quantize == "none" else quantize


def _count(n: int) -> str:
    """3.1 M, 6.74 B: a parameter count at a glance."""
    if n >= 10**9:
        return f"{n / 10**9:.2f} B"
    if n >= 10**6:
        return f"{n / 10**6:.1f} M"
    return f"{n:,}"


def after_rank_0() -> None:
    """Under torchrun, on a rank > 0 that refuses what rank 0 refuses and says: waits RANK_0_FIRST_SECONDS
    before it leaves, so that rank 0 has printed why (torchrun stops the others once one process ends)."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(RANK_0_FIRST_SECONDS)
