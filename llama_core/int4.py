"""int4 weights (`quantize="int4"`): each projection's weight in groups of 32 inputs per output row, each group
stored as 4-bit levels with one float scale (llama.cpp's q4_0 rounding: the group's value of largest
magnitude is level -8 exactly). 5 bits a weight with the scales: a Llama-2 7B's block projections take 3.8 GiB
instead of 12.1 in 16 bits. The output layer, which the logits hang on directly, is kept in int8
(llama_core.quantize), as llama.cpp keeps it wider than its 4-bit blocks.

On the CPU (float32) the product runs in llama_core's own kernel (linear.c's panel_linear_i4): the activations
are rounded to int8 on a scale per row and group of 32 and multiplied with the 4-bit levels in integer
arithmetic (VNNI, else AVX2), reading the weight once per tile of rows. Under torch.compile the same rounding
runs in float, so compiled and eager steps agree. On a CPU where those kernels are not used (neither AVX-512
nor AVX2, or no compiler), torch's own int4 CPU kernel multiplies bfloat16 activations (a compiled step there
multiplies the dequantized weight).
On CUDA, up to 64 rows of 16-bit activations (decoding) are multiplied in llama_core.triton_products' kernel,
which unpacks and scales each weight as it reads it. Elsewhere (a prompt's many rows, other dtypes, CUDA
without triton) the product is the dequantized weight's: correct everywhere, and fused into the product only
where torch.compile does so.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .cpu_kernels.panels import PANEL, huge_page_empty, kernel_for, panel_product
from .quantize import (DEVICE_ROUNDING_CHUNK_BYTES, ROUNDING_CHUNK_BYTES, Int8Linear, fits_triton, quantizable,
                       replace_children, triton_product, triton_rows)

GROUP = 32  # inputs sharing a scale; linear.c's GROUP
# torch's int4 CPU kernel (packing, product), where this torch has it: the product where llama_core's are not built
_TORCH_INT4 = ((torch.ops.aten._convert_weight_to_int4pack_for_cpu, torch.ops.aten._weight_int4pack_mm_for_cpu)
               if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else None)
ZERO_LEVEL = 8  # the level standing for 0: level q is (q - 8) * scale


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] as levels [out, in rounded up to GROUP] (uint8, 0..15; padding at level 8, zero) and
    float32 scales [out, groups]: each group's value of largest magnitude is level 0 (-8 * scale) exactly, the
    others the nearest level. A few rows at a time through one float32 buffer, as int8's rounding."""
    rows, columns = weight.shape
    groups = -(-columns // GROUP)
    chunk_bytes = ROUNDING_CHUNK_BYTES if weight.device.type == "cpu" else DEVICE_ROUNDING_CHUNK_BYTES
    step = max(1, chunk_bytes // (4 * groups * GROUP))
    levels = torch.empty(rows, groups * GROUP, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=weight.device)
    buffer = torch.zeros(min(step, rows), groups * GROUP, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, step):
        chunk = weight[start:start + step]
        w = buffer[:chunk.shape[0]]
        w[:, :columns] = chunk
        grouped = w.view(-1, groups, GROUP)
        largest, smallest = grouped.amax(dim=2, keepdim=True), grouped.amin(dim=2, keepdim=True)
        extreme = torch.where(largest >= -smallest, largest, smallest)  # signed, as q4_0 takes it
        scale = extreme / -ZERO_LEVEL
        inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        levels[start:start + step] = (grouped * inverse).round_().add_(ZERO_LEVEL).clamp_(0, 15).view(-1, groups * GROUP)
        scales[start:start + step] = scale[..., 0]
    return levels, scales


def dequantize(levels: torch.Tensor, scales: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] that levels and scales stand for, in dtype."""
    rows = levels.shape[0]
    grouped = levels.view(rows, -1, GROUP).to(dtype).sub_(ZERO_LEVEL) * scales.to(dtype)[..., None]
    return grouped.view(rows, -1)[:, :in_features]


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """Levels [out, K] (K even) as bytes [out, K / 2]: input 2i in the low nibble, 2i + 1 in the high one."""
    pairs = levels.view(levels.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_levels(packed: torch.Tensor) -> torch.Tensor:
    """The levels [out, K] that pack_levels packed (a copy)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)


def group_rounding(x: torch.Tensor) -> torch.Tensor:
    """The activations linear.c's int4 product multiplies: each row's groups of GROUP inputs rounded to the
    nearest of 255 levels over [-m, m], m the group's largest magnitude."""
    columns = x.shape[-1]
    groups = -(-columns // GROUP)
    padded = F.pad(x, (0, groups * GROUP - columns)).view(*x.shape[:-1], groups, GROUP)
    largest = padded.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
    return ((padded * (1.0 / scale)).round() * scale).view(*x.shape[:-1], groups * GROUP)[..., :columns]


def to_int4_panels(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed levels [out, K / 2] (pack_levels) and scales [out, K / GROUP] as linear.c's int4 panels
    [ceil(out / PANEL), K / GROUP, GROUP / 4, 16, 4] bytes (lane j's bytes: row j's levels low, row 16 + j's
    high) and scales [ceil(out / PANEL), K / GROUP, PANEL]; rows past out are zero. A few panels at a time, so
    that no temporary is as large as the weight."""
    rows, groups = scales.shape
    count = -(-rows // PANEL)
    panels = huge_page_empty((count, groups, GROUP // 4, 16, 4), torch.uint8)
    step = max(1, PANELS_AT_A_TIME_BYTES // (PANEL * groups * GROUP))
    for first in range(0, count, step):
        last = min(first + step, count)
        levels = unpack_levels(packed[first * PANEL:last * PANEL])
        if levels.shape[0] < (last - first) * PANEL:  # the last panel's rows past out stand for zero
            padding = levels.new_full(((last - first) * PANEL - levels.shape[0], levels.shape[1]), ZERO_LEVEL)
            levels = torch.cat([levels, padding])
        # (panel, half, lane, group, quad, byte) -> (panel, group, quad, lane, byte, half)
        halves = levels.view(last - first, 2, 16, groups, GROUP // 4, 4).permute(0, 3, 4, 2, 5, 1)
        torch.bitwise_or(halves[..., 0], halves[..., 1] << 4, out=panels[first:last])
    padded_scales = scales.new_zeros(count * PANEL, groups)
    padded_scales[:rows] = scales
    return panels, padded_scales.view(count, PANEL, groups).transpose(1, 2).contiguous()


PANELS_AT_A_TIME_BYTES = 1 << 21  # levels to_int4_panels lays out at a time


def from_int4_panels(panels: torch.Tensor, panel_scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels and scales to_int4_panels made panels from (copies)."""
    count, groups = panels.shape[:2]
    halves = torch.stack([panels & 0x0F, panels >> 4], dim=-1)  # (panel, group, quad, lane, byte, half)
    levels = halves.permute(0, 5, 3, 1, 2, 4).reshape(count * PANEL, groups * GROUP)
    scales = panel_scales.transpose(1, 2).reshape(count * PANEL, groups)
    return levels[:rows].clone(), scales[:rows].clone()


class Int4Linear(nn.Module):
    """y = x @ W.T for W [out, in] held as 4-bit levels in groups of GROUP inputs with a float32 scale each
    (`quantize_groups`): `packed` [out, K / 2] bytes, two levels each, and `scales` [out, K / GROUP], K being in
    rounded up to GROUP."""

    quantization = "int4"  # what llama_core.quantize.quantization_of reports

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        weight = weight.detach()
        rows, columns = weight.shape
        groups = -(-columns // GROUP)
        packed = torch.empty(rows, groups * GROUP // 2, dtype=torch.uint8, device=weight.device)
        scales = torch.empty(rows, groups, dtype=torch.float32, device=weight.device)
        chunk_bytes = ROUNDING_CHUNK_BYTES if weight.device.type == "cpu" else DEVICE_ROUNDING_CHUNK_BYTES
        step = max(1, chunk_bytes // (4 * groups * GROUP))
        for start in range(0, rows, step):  # no temporary as large as the weight: see quantize_groups
            levels, scales[start:start + step] = quantize_groups(weight[start:start + step])
            packed[start:start + step] = pack_levels(levels)
        self._set(packed, scales, columns)

    def _set(self, packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> None:
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.in_features, self.out_features = in_features, packed.shape[0]
        triton_rows()  # imported now, never while torch.compile traces forward

    @classmethod
    def stacked(cls, linears: Iterable["Int4Linear"]) -> "Int4Linear":
        """Rows of several int4 linears of the same input width stacked into one (scales are per row, so they
        stack too)."""
        linears = list(linears)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._set(torch.cat([l.packed for l in linears]), torch.cat([l.scales for l in linears]), linears[0].in_features)
        return fused

    def levels_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_levels(self.packed), self.scales

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] this layer stands for."""
        levels, scales = self.levels_and_scales()
        return dequantize(levels, scales, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and kernel_for(self) == "panels":
            if torch.compiler.is_compiling():  # the kernel's rounding, the sums in float
                return F.linear(group_rounding(x), self.dequantized(x.dtype))
            panels, panel_scales = self._panels_for_cpu()
            return panel_product(x, panels, self.out_features, self.in_features, panel_scales)
        if x.device.type == "cpu" and not torch.compiler.is_compiling() and _TORCH_INT4 is not None:
            return self._torch_product(x)
        if fits_triton(x, self.packed) and self.scales.is_contiguous():
            out = triton_product(x, self.packed, self.scales, int4=True)
            if out is not None:
                return out
        return F.linear(x, self.dequantized(x.dtype))

    def _torch_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product in torch's own int4 CPU kernel (bfloat16 activations), where llama_core's are not built:
        its packed copy of the weight is made on first use (on top of this layer's: 1 byte a weight in all)."""
        key = self.packed.data_ptr()
        if getattr(self, "_torch_key", None) != key:
            levels, scales = self.levels_and_scales()
            rows = -(-self.out_features // 16) * 16  # torch's packing takes whole groups of 16 rows
            padded = levels.new_full((rows, levels.shape[1]), ZERO_LEVEL)
            padded[:self.out_features] = levels
            padded_scales = scales.new_zeros(rows, scales.shape[1])
            padded_scales[:self.out_features] = scales
            # torch's levels stand for (q - 8) * scale + zero: zero is 0 here
            scales_and_zeros = torch.stack([padded_scales.t(), torch.zeros_like(padded_scales.t())], dim=-1)
            self._torch_packed = (_TORCH_INT4[0](padded.to(torch.int32), 1), scales_and_zeros.bfloat16().contiguous())
            self._torch_key = key
        packed, scales_and_zeros = self._torch_packed
        rows = x.reshape(-1, x.shape[-1])
        columns = packed.shape[1] * 2
        if rows.shape[1] != columns:
            rows = F.pad(rows, (0, columns - rows.shape[1]))
        out = _TORCH_INT4[1](rows.bfloat16(), packed, GROUP, scales_and_zeros)[:, :self.out_features]
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _panels_for_cpu(self) -> tuple[torch.Tensor, torch.Tensor]:
        """linear.c's panels and their scales, made on first use (see Int4PanelLinear for a layer holding only
        those)."""
        key = self.packed.data_ptr()
        if getattr(self, "_panels_key", None) != key:
            self._panels, self._panels_key = to_int4_panels(self.packed, self.scales), key
        return self._panels

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)  # copies into the buffers in place: make the panels again
        self._panels_key = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups of {GROUP}"


class Int4PanelLinear(Int4Linear):
    """An Int4Linear whose weight lives only in linear.c's int4 panels, as the runner keeps a float32 model's
    int4 projections on the CPU where the kernels are built (one copy of the weight, not two). `packed` and
    `scales` give the row-major values back (copies); like PanelLinear's, the panels are not in the state dict."""

    def __init__(self, linear: Int4Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        panels, panel_scales = linear._panels_for_cpu()
        self.register_buffer("panels", panels, persistent=False)
        self.register_buffer("panel_scales", panel_scales, persistent=False)
        self._kernel = "panels"

    def levels_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return from_int4_panels(self.panels, self.panel_scales, self.out_features)

    @property
    def packed(self) -> torch.Tensor:
        return pack_levels(self.levels_and_scales()[0])

    @property
    def scales(self) -> torch.Tensor:
        return self.levels_and_scales()[1]

    def _panels_for_cpu(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.panels, self.panel_scales


def keep_int4_in_panels(model: nn.Module) -> int:
    """Replaces each Int4Linear on the CPU in model by an Int4PanelLinear, in place, where llama_core's CPU
    kernels are built; returns how many."""
    if not cpu_kernels.available():
        return 0
    return replace_children(model, lambda child: Int4PanelLinear(child) if type(child) is Int4Linear
                            and child.packed.device.type == "cpu" else None)


def quantize_int4(model: nn.Module) -> nn.Module:
    """Replaces every bias-free nn.Linear (and packed projection) in model with an Int4Linear, in place, except
    a Transformer's `output`, which becomes an Int8Linear; returns model, or what replaces it where model is
    itself a projection: an Int8Linear, since the loader hands the output layer over on its own, and every
    other projection inside its block."""
    if quantizable(model):
        return Int8Linear(model.weight)
    for name, child in list(model.named_children()):
        if quantizable(child):
            setattr(model, name, Int8Linear(child.weight) if name == "output" else Int4Linear(child.weight))
        else:
            quantize_int4(child)
    return model
