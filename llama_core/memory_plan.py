"""What a model will take in memory, from its config and the size of its files alone: the command lines
compare it with the CPU's free memory before any weight is read, so that a model too big for the machine is
refused with a message instead of swapping, or being killed by the system halfway through loading."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checkpoint_files import weight_files
from .config import ModelArgs

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    """At least what a CPU model holds: its weights, and its KV cache for every slot's whole context."""

    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_position: int  # one slot's keys and values for one position, over all layers

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def stored_bytes_per_weight(ckpt_dir: Path, args: ModelArgs) -> float:
    """The checkpoint files' bytes per weight: about 2 for 16-bit checkpoints (Llama-2's), 4 for float32."""
    size = sum(path.stat().st_size for path in weight_files(ckpt_dir))
    return size / max(args.parameter_count, 1)


def plan_cpu_memory(args: ModelArgs, ckpt_dir: Path, dtype: str, quantize: Optional[str], kv_cache_dtype: str,
                    max_batch_size: int, positions: int) -> MemoryPlan:
    """A CPU model's floor: the embedding in dtype; the projections in int8 when quantized, else in the 16 bits
    they are stored in when dtype is float32 (the CPU kernels keep them so), else in dtype; the KV cache in
    kv_cache_dtype ("auto": dtype) for max_batch_size slots of `positions`. Small things (norms, scales,
    panel padding, the interpreter) come on top."""
    model_bytes = BYTES[dtype]
    embedding = args.vocab_size * args.dim
    projections = args.parameter_count - embedding - args.dim * (2 * args.n_layers + 1)
    if quantize == "int8":
        per_projection_weight = 1
    elif dtype == "float32" and stored_bytes_per_weight(ckpt_dir, args) < 3:
        per_projection_weight = 2
    else:
        per_projection_weight = model_bytes
    kv_bytes = BYTES[dtype if kv_cache_dtype == "auto" else kv_cache_dtype]
    per_position = args.n_layers * 2 * (args.n_kv_heads or args.n_heads) * args.head_dim * kv_bytes
    return MemoryPlan(embedding * model_bytes + projections * per_projection_weight,
                      per_position * max_batch_size * positions, per_position)


def available_memory() -> Optional[int]:
    """Bytes the system can give without swapping (psutil's `available`), or None where psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
