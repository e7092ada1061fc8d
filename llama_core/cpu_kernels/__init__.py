"""Hand-written CPU kernels, compiled for the machine on first use (build.py).

`PanelLinear` runs a float32 projection (its weight kept in bfloat16 or float16 where it was stored so), and
`Int8Linear` (llama_core.quantize) and `Int4Linear` (llama_core.int4) quantized ones, through linear.c's panel
kernels: a one-row product at the memory's speed and a few rows at about the same cost, where torch's products
read the weight at about two thirds of it (docs/benchmarks.md, "CPU kernels").
`layer_ops` runs a decoding layer's small operations (RMSNorm, SiLU gating, attention with its rotary
embedding and KV-cache write) in one call each. `threads` ends a thread's OpenMP workers when another
thread takes over the model's work (threads.c says why that matters).
"""

from . import layer_ops, threads
from .build import enabled, load
from .panels import (PANEL, PanelLinear, available, exact_storage, from_int8_panels, from_panels, kernel_for,
                     panel_product, rows_read_as_one, to_int8_panels, to_panels)

__all__ = ["layer_ops", "threads", "PANEL", "PanelLinear", "available", "enabled", "exact_storage", "from_int8_panels",
           "from_panels", "kernel_for", "load", "panel_product", "rows_read_as_one", "to_int8_panels", "to_panels"]
