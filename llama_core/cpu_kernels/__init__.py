"""Hand-written CPU kernels for the projections, compiled for the machine on first use (build.py).

`PanelLinear` runs a float32 projection, and `Int8Linear` (llama_core.quantize) an int8 one, through
linear.c's panel kernel: a one-row product at the memory's speed and a few rows at about the same cost,
where torch's products read the weight at about two thirds of it (docs/benchmarks.md, "CPU kernels").
"""

from .build import enabled, load
from .panels import (PANEL, PanelLinear, available, from_int8_panels, from_panels, panel_product, to_int8_panels,
                     to_panels)

__all__ = ["PANEL", "PanelLinear", "available", "enabled", "from_int8_panels", "from_panels", "load", "panel_product",
           "to_int8_panels", "to_panels"]
