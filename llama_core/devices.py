"""Which device and dtype a model runs in, from the names users give ("auto", "cuda:1", "bfloat16"), and
host values moved onto a device without waiting for it."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .errors import InvalidRequestError

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_device(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on device, without making the host wait for the
    device: on CUDA through pinned memory and an asynchronous copy (torch.tensor(values, device="cuda")
    synchronises the stream after its copy, which would stall the host once per decode step)."""
    if device.type != "cuda":
        return values.to(device) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, device=device)
    host = values.pin_memory() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda[:N]" as a torch.device.

    Raises:
        InvalidRequestError: an unknown name, or CUDA asked for on a machine without it.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r} (llama_core runs "
                                  "on CUDA devices and CPUs)")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} asked for, but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, stored: Optional[str] = None) -> torch.dtype:
    """A floating-point dtype from a name; "auto" is, on CUDA, the 16-bit dtype the checkpoint is stored in
    (`stored`, "float16" or "bfloat16": Hugging Face's Llama-2 are float16, and running them in bfloat16 would
    round every weight), else bfloat16 (float16 on GPUs before Ampere, which only emulate bfloat16); on CPU float32 (where the CPU
    kernels keep 16-bit weights as they were stored).

    Raises:
        InvalidRequestError: an unknown name or a non-floating dtype.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidRequestError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            if stored == "float16" or not native_bfloat16(device):
                return torch.float16
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPE_NAMES:
        raise InvalidRequestError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return DTYPE_NAMES[dtype]


def native_bfloat16(device: torch.device) -> bool:
    """Whether the CUDA device computes in bfloat16 natively (compute capability 8.0 and later: A100, H100,
    RTX 30xx...). torch.cuda.is_bf16_supported() also says yes where it is only emulated (V100, T4), much
    slower than float16 there."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_kv_cache_dtype(kv_cache_dtype: Optional[str | torch.dtype]) -> Optional[torch.dtype]:
    """The KV cache's dtype from a name; None for "auto" (or None): the model's. float16 or bfloat16 in a
    float32 model holds twice the context in the same memory, and on the CPU a long context decodes faster.

    Raises:
        InvalidRequestError: a name or dtype other than auto, float32, bfloat16 and float16.
    """
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return None
    if isinstance(kv_cache_dtype, torch.dtype) and kv_cache_dtype in DTYPE_NAMES.values():
        return kv_cache_dtype
    if kv_cache_dtype not in DTYPE_NAMES:
        raise InvalidRequestError(
            f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {kv_cache_dtype!r}")
    return DTYPE_NAMES[kv_cache_dtype]


def execution_device(module: nn.Module) -> torch.device:
    """The device module computes on: its weights' device or, where accelerate's dispatch offloads the
    weights (left on the meta device between calls), the device its hook runs it on."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)
    return next(module.parameters()).device


def on_one_device(module: nn.Module) -> bool:
    """Whether every weight and buffer of module sits on one real (not meta) device."""
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    return len(devices) == 1 and next(iter(devices)).type != "meta"
