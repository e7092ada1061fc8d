"""Placing a model's layers over several devices with accelerate, for models larger than one GPU.

Whole transformer blocks are placed (never split), by accelerate's `infer_auto_device_map` from the
memory each device offers, or by an explicit map. accelerate's `dispatch_model` then hooks every block
so activations move to the next block's device; blocks mapped to "cpu" while GPUs are used are
offloaded: their weights stay in host memory and are copied to the main GPU for each forward. Each
layer's KV cache lives on the device the layer runs on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

import torch

from ..checkpoint import WeightsProgress, assign_weights, iter_rank_tensors, model_part
from ..checkpoint_files import stored_dtype
from ..config import ModelArgs
from ..devices import resolve_dtype
from ..errors import InvalidRequestError
from ..model import Transformer

Device = Union[int, str, torch.device]
DeviceMap = Union[str, dict[str, Device]]
MaxMemory = dict[Union[int, str], Union[int, str]]

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_BLOCK = "TransformerBlock"


def load_dispatched(
    ckpt_dir: Path,
    args: ModelArgs,
    dtype: str | torch.dtype,
    device_map: DeviceMap,
    max_memory: Optional[MaxMemory] = None,
    max_batch_size: int = 1,
    max_seq_len: int = 1,
    progress: bool = False,
    kv_cache_dtype: Optional[torch.dtype] = None,
) -> Transformer:
    """Loads a checkpoint with its layers placed by device_map, each tensor read straight to its device
    (with progress, a bar on stderr follows them).

    Args:
        dtype: a dtype, or a name as for `Llama.build` ("auto": bfloat16 where the map uses a GPU).
        device_map: "auto" / "balanced" (layers spread evenly over the GPUs), "balanced_low_0" (GPU 0
            kept light), "sequential" (fill GPU 0 first), or a dict from module names ("tok_embeddings",
            "layers", "layers.N", "norm", "output", or "" for everything) to a device: a CUDA index, "cuda:N"
            or "cpu". A dict must cover the whole model and map whole blocks.
        max_memory: for the strategies, the most each device may hold, e.g. {0: "20GiB", "cpu": "64GiB"};
            None lets accelerate use what is free. KV caches for max_batch_size x max_seq_len are counted,
            in kv_cache_dtype (None: the model's).

    Raises:
        InvalidRequestError: a bad device_map or max_memory, or the model does not fit in max_memory.
    """
    if isinstance(device_map, dict):
        uses_gpu = any(_normalize_device(device) != "cpu" for device in device_map.values())
    else:
        uses_gpu = torch.cuda.is_available()
    dtype = resolve_dtype(dtype, torch.device("cuda" if uses_gpu else "cpu"), stored_dtype(ckpt_dir))
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    placement = resolve_device_map(model, device_map, max_memory, max_batch_size, max_seq_len, kv_cache_dtype)

    # Whole tensors one at a time, each straight to its device: host memory holds only the offloaded part.
    with WeightsProgress(model, ckpt_dir, progress) as bar:
        assign_weights(model, iter_rank_tensors(ckpt_dir, args), ckpt_dir, lambda name, tensor: bar.placed(
            name, tensor.to(device=_storage_device(placement.get(model_part(name), "cpu")), dtype=dtype).contiguous()))
    model.requires_grad_(False).eval()
    model.fuse_projections()  # before dispatch, so offloaded layers keep their fused weights in accelerate's map
    return dispatch(model, placement)


def resolve_device_map(
    model: Transformer,
    device_map: DeviceMap,
    max_memory: Optional[MaxMemory] = None,
    max_batch_size: int = 1,
    max_seq_len: int = 1,
    kv_cache_dtype: Optional[torch.dtype] = None,
) -> dict[str, Union[int, str]]:
    """One device per top-level module ("tok_embeddings", "layers.N", "norm", "output") of a model on the
    meta device, in accelerate's notation: a CUDA index or "cpu"."""
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise InvalidRequestError(
                f"device_map must be one of {', '.join(STRATEGIES)} or a dict of module names to devices, got {device_map!r}"
            )
        placement = _infer(model, device_map, max_memory, max_batch_size, max_seq_len, kv_cache_dtype)
    elif isinstance(device_map, dict):
        if max_memory is not None:
            raise InvalidRequestError("max_memory applies to device_map strategies like 'auto', not to an explicit map")
        placement = _expand(device_map, model.args.n_layers)
    else:
        raise InvalidRequestError(f"device_map must be a strategy name or a dict, got {type(device_map).__name__}")
    return placement


def dispatch(model: Transformer, placement: dict[str, Union[int, str]]) -> Transformer:
    """Hooks model's blocks (weights already on their devices) so each runs where placement says."""
    from accelerate import dispatch_model

    gpus = [d for d in placement.values() if d != "cpu"]
    main_device = placement["tok_embeddings"] if placement["tok_embeddings"] != "cpu" else (min(gpus) if gpus else "cpu")
    # force_hooks: even on one device, so every placement runs the same code path.
    return dispatch_model(model, device_map=placement, main_device=main_device, force_hooks=True)


def parse_max_memory(text: str) -> MaxMemory:
    """Reads a command-line max_memory like "0=20GiB,1=20GiB,cpu=64GiB" (GPU index or cpu = size)."""
    result: MaxMemory = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, size = item.partition("=")
        if not sep or not size.strip():
            raise InvalidRequestError(f"max_memory entry {item!r} must look like 0=20GiB or cpu=64GiB")
        key = key.strip()
        result[int(key) if key.isdigit() else key] = size.strip()
    return _check_max_memory(result) or {}


# -- helpers --------------------------------------------------------------------------------------
def _infer(model, strategy, max_memory, max_batch_size, max_seq_len, kv_cache_dtype) -> dict[str, Union[int, str]]:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    budget = _check_max_memory(max_memory)
    # meta buffers: block sizes then include their KV cache
    model.setup_caches(max_batch_size, max_seq_len, kv_cache_dtype)
    try:
        if strategy != "sequential":
            budget = get_balanced_memory(
                model, max_memory=budget, no_split_module_classes=[_BLOCK], low_zero=strategy == "balanced_low_0"
            )
        inferred = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[_BLOCK])
    finally:
        model.remove_caches()
    if "disk" in inferred.values():
        spilled = [name for name, device in inferred.items() if device == "disk"]
        raise InvalidRequestError(
            f"the model does not fit in max_memory {max_memory or budget}: {', '.join(spilled)} would spill to disk, which "
            "is not supported; allow more GPU or cpu memory, or a smaller max_seq_len / max_batch_size"
        )
    return _expand(inferred, model.args.n_layers)


def _expand(device_map: dict, n_layers: int) -> dict[str, Union[int, str]]:
    """An explicit map checked and spelled out per top-level module, in accelerate's device notation."""
    modules = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    placement: dict[str, Union[int, str]] = {}
    for key, device in device_map.items():
        if not isinstance(key, str):
            raise InvalidRequestError(f"device_map keys must be module names, got {key!r}")
        if key == "":
            covered = modules
        elif key == "layers":
            covered = [m for m in modules if m.startswith("layers.")]
        elif key in modules:
            covered = [key]
        elif re.match(r"layers\.\d+\.", key):
            block = ".".join(key.split(".")[:2])
            raise InvalidRequestError(
                f"device_map key {key!r} splits a transformer block: map whole blocks, e.g. {block!r}"
            )
        else:
            raise InvalidRequestError(
                f"device_map key {key!r} is not a module of this model: expected tok_embeddings, layers, "
                f"layers.0 .. layers.{n_layers - 1}, norm or output"
            )
        target = _normalize_device(device)
        for module in covered:
            if module in placement:
                raise InvalidRequestError(f"device_map places {module!r} twice (key {key!r} overlaps another)")
            placement[module] = target
    missing = [m for m in modules if m not in placement]
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise InvalidRequestError(f"device_map leaves {shown} without a device: every module needs one")
    return {m: placement[m] for m in modules}


def _normalize_device(device: Device) -> Union[int, str]:
    if isinstance(device, bool):
        raise InvalidRequestError(f"device_map device must be a CUDA index, 'cuda:N' or 'cpu', got {device!r}")
    if device == "disk":
        raise InvalidRequestError("device_map device 'disk' is not supported: offload to 'cpu' instead")
    if isinstance(device, int):  # read here: torch.device(0) raises on a machine without an accelerator (torch 2.13)
        if device < 0:
            raise InvalidRequestError(f"device_map device must be a CUDA index, 'cuda:N' or 'cpu', got {device!r}")
        index = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidRequestError(
                f"device_map device must be a CUDA index, 'cuda:N' or 'cpu', got {device!r}") from exc
        if parsed.type == "cpu":
            return "cpu"
        if parsed.type != "cuda":
            raise InvalidRequestError(f"device_map device must be a CUDA index, 'cuda:N' or 'cpu', got {device!r}")
        index = parsed.index if parsed.index is not None else 0
    if index >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"device_map device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return index


def _check_max_memory(max_memory: Optional[MaxMemory]) -> Optional[MaxMemory]:
    if max_memory is None:
        return None
    from accelerate.utils import convert_file_size_to_int

    if not isinstance(max_memory, dict) or not max_memory:
        raise InvalidRequestError(f"max_memory must be a dict like {{0: '20GiB', 'cpu': '64GiB'}}, got {max_memory!r}")
    checked: MaxMemory = {}
    for key, size in max_memory.items():
        device = "cpu" if key == "cpu" else _normalize_device(key)
        try:
            checked[device] = convert_file_size_to_int(size)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"max_memory for {key!r} must be a size like '20GiB' or bytes, got {size!r}") from exc
    return checked


def _storage_device(device: Union[int, str]) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device("cuda", device)
