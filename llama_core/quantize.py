"""Weight-only int8 quantization: per-output-channel scales, activations stay in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """y = (x @ dequant(W).T), with W stored as int8 [out, in] and one scale per output row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        # Row-major whatever the float weight's layout: compiled, the product is an int8 kernel needing it.
        quantized = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.register_buffer("weight", quantized)
        self.register_buffer("scales", scales.to(weight.dtype))

    @classmethod
    def stacked(cls, linears) -> "Int8Linear":
        """Rows of several quantized linears stacked into one (scales are per row, so they stack too)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.register_buffer("weight", torch.cat([l.weight for l in linears]))
        fused.register_buffer("scales", torch.cat([l.scales for l in linears]))
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype)) * self.scales


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replaces every nn.Linear in model with an Int8Linear, in place; returns model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            setattr(model, name, Int8Linear(child.weight))
        else:
            quantize_int8(child)
    return model
