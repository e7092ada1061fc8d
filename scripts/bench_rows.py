"""The projection products of a few blocks at the 7B's width (or 110m's), in llama_core's CPU kernels, for each
weight kind (bf16 panels, int8, int4) and row count: how a product's time grows with its rows (a decode step of
several sequences, or one with drafted tokens, is a product of a few rows; a prompt's prefill, of many).

    python scripts/bench_rows.py --threads 2 --rows 1,2,4,8,16,32 --kinds bf16,int8
    LLAMA_CORE_CPU_TARGET=haswell python scripts/bench_rows.py ...   # the kernels as built for AVX2

Each block gets its own random weights, so the products read memory as a real forward does. The kinds and
row counts take turns, --repeats times; the median is printed, in ms per forward of the blocks' products, with
one row's bandwidth and each row count's time as a multiple of one row's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core import cpu_kernels  # noqa: E402
from llama_core.int4 import Int4Linear, Int4PanelLinear  # noqa: E402
from llama_core.quantize import Int8Linear, Int8PanelLinear  # noqa: E402

SHAPES = {"7b": (4096, 11008), "110m": (768, 2048)}  # dim, hidden
BYTES_PER_WEIGHT = {"bf16": 2, "int8": 1, "int4": 0.5 + 4 / 32}  # int4: a float scale per 32 weights


def layer(weight: torch.Tensor, kind: str) -> torch.nn.Module:
    if kind == "bf16":
        return cpu_kernels.PanelLinear(weight.bfloat16())
    if kind == "int8":
        return Int8PanelLinear(Int8Linear(weight))
    return Int4PanelLinear(Int4Linear(weight))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--kinds", default="bf16,int8,int4")
    p.add_argument("--rows", default="1,2,3,4,6")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    if not cpu_kernels.available():
        sys.exit("llama_core's CPU kernels are not built here")
    if a.threads:
        torch.set_num_threads(a.threads)
    dim, hidden = SHAPES[a.shape]
    shapes = [(3 * dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)]  # wqkv, wo, w13, w2
    kinds, rows_list = a.kinds.split(","), [int(r) for r in a.rows.split(",")]
    layers = {kind: [layer(torch.randn(shape) * 0.02, kind) for _ in range(a.blocks) for shape in shapes]
              for kind in kinds}
    inputs = {rows: (torch.randn(rows, dim), torch.randn(rows, hidden)) for rows in rows_list}
    times: dict[tuple[str, int], list[float]] = {(kind, rows): [] for kind in kinds for rows in rows_list}
    with torch.inference_mode():
        for _ in range(a.repeats):
            for rows in rows_list:
                for kind in kinds:
                    x, h = inputs[rows]
                    started = time.perf_counter()
                    for projection in layers[kind]:
                        projection(h if projection.in_features == hidden else x)
                    times[kind, rows].append(time.perf_counter() - started)
    report = {"shape": a.shape, "blocks": a.blocks, "threads": torch.get_num_threads(),
              "kernels": cpu_kernels.build.describe(), "ms": {}}
    for kind in kinds:
        ms = {rows: statistics.median(times[kind, rows]) * 1e3 for rows in rows_list}
        report["ms"][kind] = ms
        one = ms[rows_list[0]]
        weight_bytes = a.blocks * sum(n * k for n, k in shapes) * BYTES_PER_WEIGHT[kind]
        print(f"{kind}: {rows_list[0]} row(s) {one:.2f} ms ({weight_bytes / one / 1e6:.1f} GB/s); "
              + ", ".join(f"{rows}: {ms[rows]:.2f} ms ({ms[rows] / one:.2f}x)" for rows in rows_list[1:]))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
