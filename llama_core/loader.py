"""From a checkpoint folder to a model ready to serve: Meta or Hugging Face layout, on one device, placed
over several by accelerate (device_map), or split over torchrun's processes (tensor parallel)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from . import cpu_kernels
from .checkpoint import load_model
from .checkpoint_files import check_vocabulary, checkpoint_layout, find_tokenizer, read_model_args, stored_dtype
from .config import ModelArgs, default_context
from .devices import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from .errors import CheckpointNotFoundError, InvalidRequestError
from .generation_config import GenerationConfig, read_generation_config
from .memory_plan import cpu_shortfall, shortfall
from .int4 import quantize_int4
from .quantize import QUANTIZATIONS, quantization_of, quantize_int8
from .resources import DEFAULT_CKPT_DIR
from .runner import ModelRunner, cpu_products_of, cpu_serving_layout, panel_storage_of
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """What a front end shows of a loaded model; plain values, so it travels between processes."""

    ckpt_dir: Optional[Path]
    tokenizer_path: Optional[Path]
    args: ModelArgs
    max_seq_len: int  # context allocated: prompt and reply together
    max_batch_size: int  # KV-cache slots: requests decoded together
    parameter_count: int
    dtype: str
    device: str
    load_seconds: float
    quantization: Optional[str] = None  # "int8" or "int4": the projections' weights (llama_core.quantize, .int4)
    # "bfloat16" / "float16": a float32 CPU model's projections kept in the 16 bits they were stored in
    projections_stored_in: Optional[str] = None
    weights_bytes: int = 0  # what the weights take on their devices (this rank's, under tensor parallelism)
    kv_cache_bytes: int = 0
    kv_cache_dtype: Optional[str] = None  # where it differs from dtype
    cpu_products: Optional[str] = None  # on the CPU: "llama_core's kernels (AVX2, built for native)" or "torch's own"
    # The checkpoint's generation_config.json: its sampling defaults (temperature, top_p; None where unstated),
    # a front end's defaults where its user gave none, and its end-of-sequence ids, where the engine ends a reply
    generation_config: GenerationConfig = GenerationConfig()

    @property
    def weights(self) -> str:
        """The weights' format in words: "float32", "float32, int8 weights" where quantized, or "float32,
        bfloat16 weights" where the projections are kept in the 16 bits they were stored in."""
        held = self.quantization or self.projections_stored_in
        return self.dtype + (f", {held} weights" if held else "")

    @property
    def name(self) -> str:
        """The checkpoint folder's name (what a user calls the model)."""
        return self.ckpt_dir.name if self.ckpt_dir is not None else "model"


@dataclass
class LoadedModel:
    """A model ready to serve: its runner (weights and KV cache on their devices), tokenizer and facts."""

    runner: ModelRunner
    tokenizer: Tokenizer
    info: ModelInfo

    @classmethod
    def from_runner(cls, runner: ModelRunner, tokenizer: Tokenizer, ckpt_dir: Optional[Path] = None,
                    load_seconds: float = 0.0) -> "LoadedModel":
        weights_bytes, kv_cache_bytes = runner.memory_bytes()
        info = ModelInfo(
            ckpt_dir=ckpt_dir, tokenizer_path=getattr(tokenizer, "model_path", None), args=runner.args,
            max_seq_len=runner.max_seq_len, max_batch_size=runner.max_batch_size,
            parameter_count=runner.parameter_count, dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device), load_seconds=load_seconds, quantization=quantization_of(runner.model),
            projections_stored_in=panel_storage_of(runner.model),
            cpu_products=cpu_products_of(runner.model, runner.device),
            weights_bytes=weights_bytes, kv_cache_bytes=kv_cache_bytes,
            kv_cache_dtype=(None if runner.kv_cache_dtype == runner.dtype
                            else str(runner.kv_cache_dtype).removeprefix("torch.")),
            generation_config=read_generation_config(ckpt_dir),
        )
        return cls(runner, tokenizer, info)


def load(
    ckpt_dir: Optional[str | Path] = None,
    tokenizer_path: Optional[str | Path] = None,
    max_seq_len: Optional[int] = None,
    max_batch_size: int = 4,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    device_map: Optional[str | dict] = None,
    max_memory: Optional[dict] = None,
    tensor_parallel: bool = False,
    compile: bool = False,
    progress: bool = False,
    quantize: Optional[str] = None,
    kv_cache_dtype: str | torch.dtype = "auto",
    fixes_as: str = "arguments",
    warm_up: bool = True,
) -> LoadedModel:
    """Loads a checkpoint in Meta or Hugging Face layout; the arguments are those of `Llama.build`, and
    progress shows a bar on stderr while the weights load (on rank 0 only under tensor parallelism).
    max_seq_len: the context to allocate; None, as in `Llama.build`: the one the model was trained for, at most
    DEFAULT_MAX_SEQ_LEN (2048), and 2048 where its config does not say. One past the trained context is taken
    as given (the warning about it is `Llama.build`'s).
    quantize="int8" stores the projections' weights as int8 once loaded (see llama_core.quantize); "int4" as
    4-bit groups, the output layer's as int8 (llama_core.int4).
    kv_cache_dtype: "auto" (the model's dtype), "float32", "bfloat16" or "float16".
    fixes_as: how a model that would not fit in its device's free memory is told what would: as these
    keyword arguments ("arguments"), or as the command lines' flags ("flags").
    warm_up: compile a compiled decode step here, in this thread; False where another thread will run the steps
    (a serving engine's `start()` compiles it there: see ModelRunner.warm_up).

    Under tensor parallelism, ranks > 0 serve rank 0's forwards inside this call and then exit the process.

    Raises:
        CheckpointNotFoundError, CheckpointError, InvalidRequestError: as `Llama.build`.
    """
    start = time.perf_counter()
    for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if name == "max_seq_len" and value is None:  # the trained context: known once the config is read
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
    ckpt_dir = Path(ckpt_dir).expanduser() if ckpt_dir is not None else DEFAULT_CKPT_DIR
    if ckpt_dir.is_file():
        raise CheckpointNotFoundError(f"checkpoint directory {ckpt_dir} is a file, not a directory: pass the folder "
                                      "holding params.json (Meta layout) or config.json (Hugging Face layout) and "
                                      f"the weights, e.g. {ckpt_dir.parent}")
    if not ckpt_dir.is_dir():
        hint = " (the embedded default model; see llama_core/models/README.md)" if ckpt_dir == DEFAULT_CKPT_DIR else ""
        raise CheckpointNotFoundError(f"checkpoint directory not found: {ckpt_dir}{hint}")
    checkpoint_layout(ckpt_dir)  # a folder of no checkpoint says so before its tokenizer is looked for
    tokenizer = Tokenizer(find_tokenizer(ckpt_dir, tokenizer_path))
    args = read_model_args(ckpt_dir)
    if args.vocab_size == -1:
        args.vocab_size = tokenizer.n_words
    check_vocabulary(tokenizer, args, ckpt_dir)
    if max_seq_len is None:
        max_seq_len = default_context(args.max_seq_len)
    check_quantize(quantize, device_map, tensor_parallel)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype)  # None: the model's
    stored = stored_dtype(ckpt_dir)
    # Neither rank 0's broadcast of each forward nor accelerate's hooks that move a layer's inputs and
    # weights can be traced into the compiled step.
    for name, used in (("tensor_parallel", tensor_parallel), ("device_map", device_map is not None)):
        if compile and used:
            raise InvalidRequestError(f"compile and {name} exclude each other: choose one")
    if max_memory is not None and not isinstance(device_map, str):
        raise InvalidRequestError("max_memory goes with a device_map strategy such as device_map='auto'")
    if tensor_parallel:
        from .distributed import parallel

        if device_map is not None:
            raise InvalidRequestError("device_map and tensor_parallel exclude each other: choose one")
        torch_device = parallel.init_distributed(device, args)
        model = parallel.load_model_shard(ckpt_dir, args, torch_device, resolve_dtype(dtype, torch_device, stored),
                                          progress)
    elif device_map is not None:
        from .distributed.device_map import load_dispatched

        if str(device) != "auto":
            raise InvalidRequestError(f"device_map places the model: leave device as 'auto', got {device!r}")
        model = load_dispatched(ckpt_dir, args, dtype, device_map, max_memory, max_batch_size, max_seq_len, progress,
                                kv_dtype)
    else:
        torch_device = resolve_device(device)
        cpu_eager = torch_device.type == "cpu" and not compile
        model_dtype = resolve_dtype(dtype, torch_device, stored)
        _check_memory(args, ckpt_dir, torch_device, str(device), model_dtype, quantize, kv_dtype, max_batch_size,
                      max_seq_len, compile, fixes_as)
        # The CPU kernels keep 16-bit projections as stored: casting them to float32 first only costs time.
        as_stored = cpu_eager and quantize is None and model_dtype == torch.float32 and cpu_kernels.available()
        model = load_model(ckpt_dir, args, torch_device, model_dtype, progress,
                           assigned=_prepare_part(quantize, cpu_eager, model_dtype == torch.float32),
                           projections_as_stored=as_stored)
    with compiling_notice(compile and warm_up and progress):
        runner = ModelRunner(model, max_batch_size, max_seq_len, compile, tensor_parallel=tensor_parallel,
                             kv_cache_dtype=kv_dtype, warm_up=warm_up)
    if tensor_parallel:
        parallel.lead_or_serve(runner.model, runner.device)  # returns on rank 0 only
    return LoadedModel.from_runner(runner, tokenizer, ckpt_dir, time.perf_counter() - start)


@contextlib.contextmanager
def compiling_notice(shown: bool) -> Iterator[None]:
    """Where shown, says on stderr that the decode step compiles (after the weights' bar, a while with nothing
    else to show), and then how long it took."""
    if not shown:
        yield
        return
    print("Compiling the decode step (torch.compile; on the first start of a large model this takes minutes, "
          "inductor caches it for the next)...", file=sys.stderr, flush=True)
    compiling = time.perf_counter()
    yield
    print(f"Compiled the decode step in {time.perf_counter() - compiling:.1f} s", file=sys.stderr, flush=True)


def _check_memory(args: ModelArgs, ckpt_dir: Path, device: torch.device, device_option: str, dtype: torch.dtype,
                  quantize: Optional[str], kv_dtype: Optional[torch.dtype], max_batch_size: int, max_seq_len: int,
                  compile: bool, fixes_as: str) -> None:
    """InvalidRequestError, naming what would fit (fixes_as: "arguments" or "flags"), where the weights and the
    KV cache would not fit in the memory free now on the model's one device: on the CPU loading would swap, or
    the system would kill the process partway; on a GPU it would run out of memory partway."""
    def name(value: Optional[torch.dtype]) -> str:
        return "auto" if value is None else str(value).removeprefix("torch.")

    plan = (args, ckpt_dir, name(dtype), quantize, name(kv_dtype), max_batch_size, max_seq_len, compile)
    if device.type == "cpu":
        found = cpu_shortfall(*plan)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"{device} ({torch.cuda.get_device_name(device)})"
        found = shortfall(*plan, free, where, on_cpu=False, device=device_option)
    else:
        found = None
    if found is not None:
        raise InvalidRequestError(found.describe(fixes_as))


def _prepare_part(quantize: Optional[str], cpu_eager: bool, float32_model: bool):
    """What the loader does to each part of a one-device model as soon as its weights are in (quantizing it,
    and on the CPU putting it in the eager runner's layout), so the model never exists whole in full
    precision or float32; None where nothing is to be done."""
    if quantize is None and not cpu_eager:
        return None

    def prepare(part: torch.nn.Module) -> torch.nn.Module:
        if quantize == "int8":
            part = quantize_int8(part)
        elif quantize == "int4":
            part = quantize_int4(part)
        return cpu_serving_layout(part, float32_model) if cpu_eager else part

    return prepare


def check_quantize(quantize: Optional[str], device_map=None, tensor_parallel: bool = False) -> None:
    """Raises InvalidRequestError for a quantize value other than None, "int8" or "int4", or either where layers
    are placed by accelerate or split over processes (not supported)."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise InvalidRequestError(f"quantize must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, got {quantize!r}")
    if quantize is not None and (device_map is not None or tensor_parallel):
        raise InvalidRequestError(f"quantize={quantize!r} works on one device: it does not go with "
                                  f"{'device_map' if device_map is not None else 'tensor_parallel'}")
