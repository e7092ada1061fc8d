"""Projections for the CPU whose weights oneDNN has reordered once, at load, into its own blocked layout.

MKL's products of a few rows by a plain [out, in] weight cost several times a one-row product (each row
streams the weight again); oneDNN's kernel on its blocked layout reads the weight about once whatever the
rows, which is what batched decoding needs. `scripts/bench_gemm.py` measures it: on the 110m shape with
2 threads one forward's projections take 14.6 ms at 1 row and 15.6 at 8 (column-major MKL: 18.7 and 42.4).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .cpu_kernels import PanelLinear, available as panels_available


def packing_available() -> bool:
    """Whether this torch build has oneDNN (x86 and ARM CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x @ W.T for a float32 weight W [out, in] held in oneDNN's layout (no bias).

    The packed weight is an opaque tensor: `weight` gives the plain [out, in] values back (a copy) for
    whoever needs them, e.g. to quantize."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PackedLinear takes a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN layout"


# A oneDNN call costs ~15 us more than MKL's: below this many weights (1 MiB of float32) MKL's product on
# a column-major weight is the faster one (on the embedded model, only its output layer is larger).
MIN_PACKED_WEIGHTS = 1 << 18


def pack_linears(model: nn.Module, min_weights: Optional[int] = None, float32_model: bool = False) -> int:
    """Replaces each bias-free float32 nn.Linear on the CPU in model by a projection in a layout made for
    it, in place; returns how many it replaced. In a float32_model, bfloat16 and float16 ones too (weights
    loaded as stored, see checkpoint.load_model), into PanelLinears of their dtype, where those are built.

    Where llama_core's own kernels are built (llama_core.cpu_kernels) every such linear becomes a
    PanelLinear, which beats torch's products at every row count and size measured; otherwise those with at
    least min_weights weights (default MIN_PACKED_WEIGHTS) become oneDNN PackedLinears (none where this
    torch has no oneDNN)."""
    if panels_available():
        layout, min_weights = PanelLinear, 0 if min_weights is None else min_weights
        dtypes = (torch.float32, torch.bfloat16, torch.float16) if float32_model else (torch.float32,)
    elif packing_available():
        layout, min_weights, dtypes = PackedLinear, MIN_PACKED_WEIGHTS if min_weights is None else min_weights, (torch.float32,)
    else:
        return 0
    return _replace_linears(model, layout, min_weights, dtypes)


def _replace_linears(model: nn.Module, layout: type, min_weights: int, dtypes: tuple[torch.dtype, ...]) -> int:
    replaced = 0
    for name, child in list(model.named_children()):
        # The type first: a packed projection's `weight` is a copy made on demand.
        if (type(child) is nn.Linear and child.bias is None and child.weight.device.type == "cpu"
                and child.weight.dtype in dtypes and child.weight.numel() >= min_weights):
            setattr(model, name, layout(child.weight))
            replaced += 1
        else:
            replaced += _replace_linears(child, layout, min_weights, dtypes)
    return replaced


def unpack_linears(model: nn.Module) -> int:
    """Puts a plain nn.Linear back for each PackedLinear or PanelLinear in model, in place (torch.compile
    traces plain products: it cannot take oneDNN's packed weight or a ctypes call as an input); returns how
    many."""
    replaced = 0
    for name, child in list(model.named_children()):
        if isinstance(child, (PackedLinear, PanelLinear)):
            linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(child.weight, requires_grad=False)
            setattr(model, name, linear)
            replaced += 1
        else:
            replaced += unpack_linears(child)
    return replaced
