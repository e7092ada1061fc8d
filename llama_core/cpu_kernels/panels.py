"""Projections whose weights are stored in panels for the kernels of linear.c (see its header).

A float32 weight W [out, in] becomes panels [ceil(out / 32), in, 32]: each group of 32 rows of W transposed,
so one panel is one contiguous stream (int8: [ceil(out / 32), ceil(in / 4), 32, 4], four inputs per output
side by side for VNNI). A PanelLinear keeps its panels in bfloat16 or float16 where W comes in that dtype (a
projection loaded as stored, as Llama-2's are) or every value of it is one of that dtype's: the products are
the float32 panels' bit for bit, from half the memory. Where the OS allows it the panels sit in 2 MiB pages
(transparent huge pages, asked for with madvise): streaming the weight then costs far fewer page walks,
which on the 110m shape is the difference between reading at ~25 and ~33 GB/s with 2 threads
(docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import build

PANEL = 32
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


_KERNELS: Optional[ctypes.CDLL] = None  # the library, once loaded: products then skip build.load's checks


def kernel_for(layer: nn.Module) -> str:
    """"panels" where the kernels are built (and not turned off) when a quantized layer first runs on the CPU,
    else "torch"; kept on the layer, so that it never changes kernel between calls."""
    kernel = layer.__dict__.get("_kernel")
    if kernel is None:
        kernel = layer._kernel = "panels" if available() else "torch"
    return kernel


def available() -> bool:
    """Whether the panel kernels are built and loaded, and not turned off (see build.load)."""
    global _KERNELS
    library = build.load()
    if library is not None:
        _KERNELS = library
    return library is not None


def rows_read_as_one(kind: str = "float") -> int:
    """The rows a product of the kernels reads its weight for once, at about one row's cost: a tile's ("float":
    over 16-bit panels, 8 with AVX-512 and 3 with AVX2; "int8" and "int4": 8 with AVX-512 and VNNI, else 2).
    0 without the kernels."""
    if not available():
        return 0
    library = build.load()
    return library.tile_rows() if kind == "float" else library.int_tile_rows()


# The panel dtypes linear.c multiplies, and block.c's number for each.
PANEL_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PRODUCTS = {torch.float32: "panel_linear_f32", torch.bfloat16: "panel_linear_bf16", torch.float16: "panel_linear_f16"}


def exact_storage(weight: torch.Tensor) -> torch.dtype:
    """The narrowest of bfloat16, float16 and float32 that holds every value of a float32 weight exactly."""
    chunks = weight.reshape(-1).split(1 << 20)  # round trips in cache-sized pieces, stopping at the first miss
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(chunk.to(dtype).to(chunk.dtype), chunk) for chunk in chunks):
            return dtype
    return weight.dtype


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] as panels [ceil(out / PANEL), in, PANEL] of its dtype, rows past out zero. bfloat16
    panels hold each row's columns j and 16 + j side by side, so that linear.c widens a 32-bit lane of them
    with a shift (column j) and a mask (column 16 + j)."""
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    panels = huge_page_empty((count, in_features, PANEL), weight.dtype)
    rows = _padded(weight, count * PANEL, in_features)
    if weight.dtype == torch.bfloat16:  # [panel, half, j, k] -> [panel, k, j, half]
        panels.view(count, in_features, PANEL // 2, 2).copy_(rows.view(count, 2, PANEL // 2, in_features).permute(0, 3, 2, 1))
    else:
        panels.copy_(rows.view(count, PANEL, in_features).transpose(1, 2))
    return panels


def from_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [out, in] that to_panels made panels from (a copy)."""
    count, in_features, _ = panels.shape
    if panels.dtype == torch.bfloat16:
        rows = panels.view(count, in_features, PANEL // 2, 2).permute(0, 3, 2, 1)
    else:
        rows = panels.transpose(1, 2)
    return rows.reshape(count * PANEL, in_features)[:out_features].clone()


def to_int8_panels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight [out, in] as panels [ceil(out / PANEL), ceil(in / 4), PANEL, 4] (zeros past out and
    in), and each padded row's sum [ceil(out / PANEL) * PANEL] in int32, which the kernel needs."""
    out_features, in_features = weight.shape
    count, groups = -(-out_features // PANEL), -(-in_features // 4)
    padded = _padded(weight, count * PANEL, groups * 4)
    panels = huge_page_empty((count, groups, PANEL, 4), torch.int8)
    panels.copy_(padded.view(count, PANEL, groups, 4).transpose(1, 2))
    return panels, _row_sums(padded)


def _row_sums(weight: torch.Tensor) -> torch.Tensor:
    """Each row's sum of an int8 weight, in int32. Summed in float32, a few rows at a time (exact: every partial
    sum is an integer below 2**24 for rows up to 132,000 long), which is several times faster than torch's
    int8 sum into int32."""
    step = max(1, (1 << 21) // (4 * weight.shape[1]))
    buffer = torch.empty(min(step, weight.shape[0]), weight.shape[1])
    sums = torch.empty(weight.shape[0])
    for start in range(0, weight.shape[0], step):
        chunk = weight[start:start + step]
        torch.sum(buffer[:chunk.shape[0]].copy_(chunk), dim=1, out=sums[start:start + step])
    return sums.to(torch.int32)


def from_int8_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 weight [out, in] that to_int8_panels made panels from (a copy)."""
    count, groups = panels.shape[:2]
    return panels.transpose(1, 2).reshape(count * PANEL, groups * 4)[:out_features, :in_features].clone()


def panel_product(x: torch.Tensor, panels: torch.Tensor, out_features: int, in_features: int,
                  scales: Optional[torch.Tensor] = None, weight_sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] (float32, CPU) @ W.T for W in panels: float32, bfloat16 or float16 (to_panels), int8
    (to_int8_panels) with float32 scales and int32 row sums, both [count * PANEL], or int4 (uint8 panels,
    llama_core.int4.to_int4_panels) with their scales. Raises RuntimeError where the kernels are not built (see
    available)."""
    library = _KERNELS or build.load()
    if library is None:
        raise RuntimeError("llama_core's CPU kernels are not built here (see llama_core.cpu_kernels.build)")
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(*x.shape[:-1], out_features)
    rows = x.numel() // in_features
    if scales is None:
        getattr(library, _PRODUCTS[panels.dtype])(x.data_ptr(), panels.data_ptr(), None, out.data_ptr(), rows,
                                                  out_features, in_features, torch.get_num_threads())
    elif panels.dtype == torch.uint8:
        if library.panel_linear_i4(x.data_ptr(), panels.data_ptr(), scales.data_ptr(), out.data_ptr(), rows,
                                   out_features, in_features, torch.get_num_threads()):
            raise MemoryError(f"no memory for {rows} rows of int8 activations")
    elif library.panel_linear_i8(x.data_ptr(), panels.data_ptr(), scales.data_ptr(), weight_sums.data_ptr(),
                                 out.data_ptr(), rows, out_features, in_features, torch.get_num_threads()):
        raise MemoryError(f"no memory for {rows} rows of int8 activations")
    return out


class PanelLinear(nn.Module):
    """y = x @ W.T for float32 x and a CPU weight W [out, in] (no bias), in panels for linear.c's kernel: a
    bfloat16 or float16 W in panels of its dtype; a float32 one in bfloat16 or float16 panels where they hold
    it exactly (`exact_storage`), else float32.

    `weight` gives the plain float32 [out, in] values back (a copy), e.g. to quantize or to compile."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in PANEL_KINDS or weight.dim() != 2:
            raise ValueError(f"PanelLinear takes a 2-D float32, bfloat16 or float16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        stored = exact_storage(weight) if weight.dtype == torch.float32 else weight.dtype
        self.register_buffer("panels", to_panels(weight.to(stored)), persistent=False)
        available()  # loads the kernels for forward, where they build

    @property
    def weight(self) -> torch.Tensor:
        return from_panels(self.panels, self.out_features).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or _KERNELS is None:
            return F.linear(x, self.weight.to(x.dtype))  # outside what the kernel covers: correct, not fast
        return panel_product(x, self.panels, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels of {str(self.panels.dtype).removeprefix('torch.')}"


def _padded(weight: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    if tuple(weight.shape) == (rows, columns):
        return weight
    padded = weight.new_zeros(rows, columns)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return padded


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, in fresh memory advised into 2 MiB pages where it is big enough for them
    (on Linux); elsewhere torch.empty."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    length = nbytes + _HUGE_PAGE
    memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = (-raw.data_ptr()) % _HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length - start), _MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)
