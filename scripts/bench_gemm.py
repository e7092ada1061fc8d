"""Micro-benchmark of one forward's projection products at a model shape, in the weight layouts
llama_core could use: q/k/v and gate/up fused or separate; weights row-major ([out, in] contiguous, as
checkpoints store them), column-major (the transpose contiguous), reordered once by oneDNN into its
own blocked layout and multiplied by its kernel (`llama_core.packed_linear`), or in llama_core's own
panels and kernel (`llama_core.cpu_kernels`, where it builds).

    python scripts/bench_gemm.py --shape 110m --rows 1,8,32,128

Each layer gets its own random weights, so the products read memory as a real forward does rather than
a cached matrix. The layouts take turns, --repeats times; the median is printed, in ms per forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core import cpu_kernels  # noqa: E402
from llama_core.packed_linear import packing_available  # noqa: E402

SHAPES = {"tiny": (192, 512, 6), "15m": (288, 768, 6), "110m": (768, 2048, 12)}  # dim, hidden, layers


LAYOUTS = ("row", "column") + (("onednn",) if packing_available() else ()) + (("panels",) if cpu_kernels.available() else ())


def layer_weights(dim: int, hidden: int, fused: bool, layout: str) -> list[torch.Tensor]:
    if fused:
        shapes = [(3 * dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)]
    else:
        shapes = [(dim, dim)] * 4 + [(hidden, dim)] * 2 + [(dim, hidden)]
    weights = [torch.randn(shape) for shape in shapes]
    if layout == "column":
        return [w.t().contiguous().t() for w in weights]
    if layout == "onednn":
        return [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w)) for w in weights]
    if layout == "panels":
        return [cpu_kernels.PanelLinear(w) for w in weights]
    return weights


def forward_products(layers: list[list], x: torch.Tensor, h: torch.Tensor) -> None:
    for weights in layers:
        for w in weights:
            if isinstance(w, cpu_kernels.PanelLinear):
                w(h if w.in_features == h.shape[1] else x)
            elif isinstance(w, tuple):
                in_features, packed = w
                torch.ops.mkldnn._linear_pointwise(h if in_features == h.shape[1] else x, packed, None, "none", [], "")
            else:
                F.linear(h if w.shape[1] == h.shape[1] else x, w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    p.add_argument("--rows", default="1,8,32,128", help="rows per product (decode batch, or prompt tokens)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dim, hidden, n_layers = SHAPES[a.shape]
    torch.manual_seed(0)
    layouts = {
        (fused, layout): [layer_weights(dim, hidden, fused, layout) for _ in range(n_layers)]
        for fused in (False, True)
        for layout in LAYOUTS
    }
    print(f"{a.shape}: dim {dim}, hidden {hidden}, {n_layers} layers, {torch.get_num_threads()} threads; ms per forward")
    print(f"{'rows':>6}" + "".join(f"{('fused' if f else 'separate') + ', ' + layout:>18}" for f, layout in layouts))
    for rows in (int(r) for r in a.rows.split(",")):
        x, h = torch.randn(rows, dim), torch.randn(rows, hidden)
        times = {key: [] for key in layouts}
        for _ in range(a.repeats):
            for key, layers in layouts.items():
                start = time.perf_counter()
                forward_products(layers, x, h)
                times[key].append((time.perf_counter() - start) * 1e3)
        print(f"{rows:>6}" + "".join(f"{statistics.median(t):>18.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
