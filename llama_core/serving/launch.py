"""Starting the engine a server runs on, from the options a command line gives: in a process of its own
(the default), in the server's process, or, under torchrun, tensor-parallel with rank 0 serving."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

from ..checkpoint_files import read_model_args
from ..config import default_context
from ..devices import resolve_device
from ..distributed.device_map import parse_max_memory
from ..distributed.parallel import launched_by_torchrun
from ..loader import compiling_notice, load
from ..resources import DEFAULT_CKPT_DIR
from .engine import Engine
from .engine_process import EngineProcess


def open_engine(
    ckpt_dir: Optional[Union[str, Path]] = None,
    tokenizer_path: Optional[Union[str, Path]] = None,
    max_seq_len: Optional[int] = None,
    max_batch_size: int = 8,
    device: str = "auto",
    dtype: str = "auto",
    device_map: Optional[str] = None,
    max_memory: Optional[str] = None,
    compile: bool = False,
    threads: Optional[int] = None,
    single_process: bool = False,
    seed: Optional[int] = None,
    progress: bool = False,
    prefix_caching: bool = True,
    max_waiting: int = 64,
    quantize: Optional[str] = None,
    kv_cache_dtype: str = "auto",
    prompt_lookup: Optional[int] = None,
    fixes_as: str = "arguments",
) -> Union[Engine, EngineProcess]:
    """Loads the model and starts the engine serving it; `shutdown()` it at the end.

    Args:
        max_seq_len: None is the model's own context, at most DEFAULT_MAX_SEQ_LEN.
        max_memory: with device_map, the most each device may hold, as "0=20GiB,1=20GiB,cpu=64GiB".
        threads: torch's CPU threads; None on CPU is one fewer than the cores, leaving one to the web server.
        single_process: run the model in this process (under torchrun it always runs in rank 0's).
        progress: show a bar on stderr while the weights load.
        prefix_caching: reuse the KV cache of earlier requests' prompt prefixes (see Engine).
        max_waiting: requests that may wait for a slot; beyond them, new ones are refused as busy at once.
        quantize: "int8" or "int4" for such weights, None for the dtype's; in the engine process, that process quantizes.
        kv_cache_dtype: "auto" (the model's dtype), "float32", "bfloat16" or "float16".
        prompt_lookup: the most tokens a decode step drafts from the text so far (see Engine); None: the
            device's default.
        fixes_as: a model that would not fit in its device's free memory is refused naming what would, as
            keyword arguments ("arguments") or as the command lines' flags ("flags").
        The others are those of `Llama.build`.

    Raises:
        LlamaError: what loading raised (a missing checkpoint, a bad option...).
        MemoryError, RuntimeError: the model does not fit on its device(s).
    """
    ckpt_dir = Path(ckpt_dir).expanduser() if ckpt_dir is not None else None
    if max_seq_len is None:
        folder = ckpt_dir or DEFAULT_CKPT_DIR
        # a missing folder is reported by loading
        max_seq_len = default_context(read_model_args(folder).max_seq_len if folder.is_dir() else None)
    threads = threads or default_threads(device, device_map)
    if threads:
        torch.set_num_threads(threads)
    build = dict(ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path, max_seq_len=max_seq_len,
                 max_batch_size=max_batch_size, device=device, dtype=dtype, device_map=device_map,
                 max_memory=parse_max_memory(max_memory) if max_memory else None, compile=compile, progress=progress,
                 quantize=quantize, kv_cache_dtype=kv_cache_dtype, fixes_as=fixes_as)
    if single_process or launched_by_torchrun():
        # Under `torchrun --nproc_per_node N`, ranks > 0 serve rank 0's steps inside load and exit. A compiled
        # step is compiled by the engine's thread as it starts, where its CUDA graphs will be replayed.
        engine = Engine(load(**build, tensor_parallel=launched_by_torchrun(), warm_up=False), seed=seed,
                        prefix_caching=prefix_caching, max_waiting=max_waiting, prompt_lookup=prompt_lookup)
        with compiling_notice(compile and progress):
            try:
                return engine.start()
            except BaseException:  # its step did not warm up, or Ctrl-C while it compiled
                engine.close()  # gives the KV cache back: no one else has the engine to close
                raise
    return EngineProcess(dict(build, seed=seed), threads=threads, prefix_caching=prefix_caching,
                         max_waiting=max_waiting, prompt_lookup=prompt_lookup).start()


def default_threads(device: str, device_map: Optional[str]) -> Optional[int]:
    """On CPU, torch's threads and the web server's share the cores: measured on 2 cores, the app with one
    torch thread served 8 clients through /v1 at 4,570 tok/s, first tokens in 11 ms, and with two at 4,320
    tok/s and 16 ms (docs/benchmarks.md, "Two compute threads"). Elsewhere None: torch's own choice."""
    on_cpu = device_map is None and resolve_device(device).type == "cpu"
    return max(1, (os.cpu_count() or 2) - 1) if on_cpu else None
