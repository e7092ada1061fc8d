"""What a model will take in memory, from its config and the size of its files alone: the loader and the
command lines compare it with the memory free on its device (the CPU's, or one GPU's) before any weight is
read, so that a model too big for it is refused with a message instead of swapping, being killed by the
system, or running out of GPU memory halfway through loading. The message names what would fit, in the
caller's terms (flags, or Llama.build's arguments)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checkpoint_files import weight_files
from .cpu_kernels import build as cpu_kernels_build
from .config import ModelArgs
from .devices import DTYPE_NAMES


@dataclass(frozen=True)
class MemoryPlan:
    """At least what a model holds: its weights, and its KV cache for every slot's whole context."""

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


def plan_memory(args: ModelArgs, ckpt_dir: Path, dtype: str, quantize: Optional[str], kv_cache_dtype: str,
                max_batch_size: int, positions: int, on_cpu: bool = True) -> MemoryPlan:
    """A model's floor: the embedding in dtype; the projections in int8 or int4 when quantized, else on the CPU
    in the 16 bits they are stored in when dtype is float32 and the CPU kernels are used (they keep them so),
    else in dtype; the KV cache in kv_cache_dtype ("auto": dtype) for max_batch_size slots of `positions`. Small
    things (norms, scales, panel padding, activations, the interpreter) come on top."""
    model_bytes = DTYPE_NAMES[dtype].itemsize
    embedding = args.vocab_size * args.dim
    projections = args.parameter_count - embedding - args.dim * (2 * args.n_layers + 1)
    if quantize == "int8":
        projection_bytes = projections
    elif quantize == "int4":  # 4 bits and a float32 scale per 32 weights; the output layer in int8
        output = args.vocab_size * args.dim
        projection_bytes = int((projections - output) * (0.5 + 4 / 32)) + output
    elif on_cpu and dtype == "float32" and stored_bytes_per_weight(ckpt_dir, args) < 3 and cpu_kernels_build.expected():
        projection_bytes = 2 * projections  # without the kernels (no compiler, no AVX2) float32 like the rest
    else:
        projection_bytes = model_bytes * projections
    kv_bytes = DTYPE_NAMES[dtype if kv_cache_dtype == "auto" else kv_cache_dtype].itemsize
    per_position = args.n_layers * 2 * (args.n_kv_heads or args.n_heads) * args.head_dim * kv_bytes
    return MemoryPlan(embedding * model_bytes + projection_bytes,
                      per_position * max_batch_size * positions, per_position)


@dataclass(frozen=True)
class Shortfall:
    """A model that does not fit: what it needs, what is free, and changes that would each make it fit."""

    name: str
    where: str  # "the CPU", "cuda:0 (NVIDIA ...)"
    need: MemoryPlan
    available: int
    max_batch_size: int
    max_seq_len: int
    kv_dtype: str
    fixes: tuple[tuple[dict[str, object], str], ...]  # (option values, what they then take)

    def describe(self, fixes_as: str = "arguments") -> str:
        """One line, naming the fixes as Llama.build's keyword arguments ("arguments") or as flags ("flags")."""
        option = as_flags if fixes_as == "flags" else as_arguments
        fixes = [option(values) + (f" ({detail})" if detail else "") for values, detail in self.fixes]
        advice = ", or ".join(fixes) if fixes else "use a machine with more memory, or a smaller model"
        return (f"{self.name} needs at least {gib(self.need.total_bytes)} of memory on {self.where} (weights "
                f"{gib(self.need.weights_bytes)}, KV cache {gib(self.need.kv_cache_bytes)}: {self.max_batch_size:,} "
                f"request{'' if self.max_batch_size == 1 else 's'} x {self.max_seq_len:,} tokens in "
                f"{self.kv_dtype}) and {gib(self.available)} is free: "
                f"{advice}")


def as_flags(values: dict[str, object]) -> str:
    """Option values as the flags that set them: "add --quantize int8", "pass --max-batch-size 5"."""
    verb = "pass" if all(isinstance(value, int) for value in values.values()) else "add"
    return verb + "".join(f" --{name.replace('_', '-')} {value}" for name, value in values.items())


def as_arguments(values: dict[str, object]) -> str:
    """Option values as keyword arguments: "quantize='int8'", "max_batch_size=5"."""
    return ", ".join(f"{option}={value!r}" for option, value in values.items())


def cpu_shortfall(args: ModelArgs, ckpt_dir: Path, dtype: str, quantize: Optional[str], kv_cache_dtype: str,
                  max_batch_size: int, max_seq_len: int, compile: bool = False) -> Optional[Shortfall]:
    """None where the CPU model fits in the memory free now (or that cannot be told); else a Shortfall."""
    available = available_memory()
    if available is None:
        return None
    return shortfall(args, ckpt_dir, dtype, quantize, kv_cache_dtype, max_batch_size, max_seq_len, compile,
                     available, "the CPU")


def shortfall(args: ModelArgs, ckpt_dir: Path, dtype: str, quantize: Optional[str], kv_cache_dtype: str,
              max_batch_size: int, max_seq_len: int, compile: bool, available: int, where: str,
              on_cpu: bool = True, device: str = "auto") -> Optional[Shortfall]:
    """None where the model fits in `available` bytes on `where`; else what it lacks and what would fit: a
    float16 KV cache (where it is float32), fewer slots, a shorter context, int8 or else int4 weights (with a
    float16 cache where needed), or on a GPU the blocks that do not fit kept in CPU memory (device_map="auto";
    `device` is the device asked for, which a device map needs to be "auto"), each alone enough."""
    positions = max_seq_len + (1 if compile else 0)  # a compiled step's spare position
    need = plan_memory(args, ckpt_dir, dtype, quantize, kv_cache_dtype, max_batch_size, positions, on_cpu)
    if need.total_bytes <= available:
        return None
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    fixes: list[tuple[dict[str, object], str]] = []
    room = available - need.weights_bytes
    if room > 0:
        if kv_dtype == "float32" and need.weights_bytes + need.kv_cache_bytes // 2 <= available:
            fixes.append(({"kv_cache_dtype": "float16"}, f"KV cache {gib(need.kv_cache_bytes // 2)}"))
        slots = room // (need.kv_bytes_per_position * positions)
        if slots >= 1:
            fixes.append(({"max_batch_size": slots}, ""))
        context = room // (need.kv_bytes_per_position * max_batch_size)
        if context >= 64:
            fixes.append(({"max_seq_len": context - (1 if compile else 0)}, ""))
    narrower = {None: ("int8", "int4"), "int8": ("int4",)}.get(quantize, ())
    for values in [{"quantize": q, **cache} for q in narrower for cache in ({}, {"kv_cache_dtype": "float16"})]:
        quantized = plan_memory(args, ckpt_dir, dtype, values["quantize"],
                                str(values.get("kv_cache_dtype", kv_cache_dtype)), max_batch_size, positions, on_cpu)
        if quantized.total_bytes <= available:
            fixes.append((values, f"weights {gib(quantized.weights_bytes)}, KV cache {gib(quantized.kv_cache_bytes)}"))
            break
    if not on_cpu and not compile:  # accelerate's hooks cannot be traced into a compiled step
        values: dict[str, object] = {"device_map": "auto"} if device == "auto" else {"device": "auto", "device_map": "auto"}
        fixes.append((values, "the blocks that do not fit wait in CPU memory: slower"))
    return Shortfall(ckpt_dir.name, where, need, available, max_batch_size, max_seq_len, kv_dtype, tuple(fixes))


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def available_memory() -> Optional[int]:
    """Bytes this process can still take without swapping: the system's available memory (psutil's), or less
    where a memory cgroup limits the process (a container's limit, which the system's figure does not see);
    None where psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    room = cgroup_room()
    available = int(psutil.virtual_memory().available)
    return available if room is None else min(available, room)


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_room(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> Optional[int]:
    """The memory left under this process's cgroup limit (limit - usage; the tightest where several are
    readable), in cgroup v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes, memory.usage_in_bytes);
    None where no limit is set or none can be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    folders = [root, root / "memory"]  # a container sees its own cgroup at the mount's top
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folders.append(root / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            folders.append(root / "memory" / path.lstrip("/"))
    rooms = []
    for folder in folders:
        for limit_name, usage_name in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                limit = (folder / limit_name).read_text().strip()
                usage = int((folder / usage_name).read_text().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < UNLIMITED:
                rooms.append(max(int(limit) - usage, 0))
    return min(rooms) if rooms else None
