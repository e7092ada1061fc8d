"""int8 weight-only products on CUDA at the 7B's projections: llama_core's Triton kernel (llama_core.triton_products)
against bfloat16 weights through cuBLAS, the dequantized int8 product, and that product compiled by inductor
with coordinate-descent tuning (what the compiled decode step ran before the kernel); and the int4 kernel.

    python scripts/bench_int8_cuda.py --out report.json                 # rows 1, 8, 32
    python scripts/bench_int8_cuda.py --sweep --deadline 100            # then the kernel's tilings at 1 and 8 rows
    python scripts/bench_int8_cuda.py --dry-run --sweep                 # here, without a GPU: see below

Each product is timed over enough distinct weights (--weight-bytes, 1 GiB by default) that none is read from
L2, one CUDA graph replaying a product on each, so the time is the GPU's, without launches. Printed per
projection and row count: microseconds per product, the weights' bytes read per second and their share of
the device-to-device copy bandwidth measured first; then, per row count, a whole forward's products (32
layers' fused q/k/v, output, fused gate/up and down projections, and the vocabulary projection) and each
variant's ratio to bfloat16. int8_inductor is taken at one row only (with more, inductor leaves the product
to cuBLAS after converting the weight: int8_dequant). --sweep then times the kernel's tilings on each
projection (variant int8_triton[block_n,block_k,split_k,warps,stages]) at one row and at 8, until
--deadline. The JSON report (--out) is written after each projection.

--dry-run runs every variant once, at 1/64 of the 7B's widths, on CPU tensors through Triton's interpreter,
timing nothing that means anything: it checks the script itself before a device call is spent on it
(tests/test_bench.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIM, HIDDEN, LAYERS, VOCAB = 4096, 11008, 32, 32000
PROJECTIONS = {"wqkv": (3 * DIM, DIM, LAYERS), "wo": (DIM, DIM, LAYERS), "w13": (2 * HIDDEN, DIM, LAYERS),
               "w2": (DIM, HIDDEN, LAYERS), "output": (VOCAB, DIM, 1)}  # [out, in], times per forward


def graph_seconds(calls: list[Callable[[], torch.Tensor]], repeats: int = 5) -> float:
    """Seconds per call: one CUDA graph of every call in turn, replayed; the best of repeats (on the CPU, a
    dry run: each call once)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: Triton compiles, inductor tunes, cuBLAS picks its kernels
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / len(calls)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_seconds([lambda: dst.copy_(src)] * 4)
    return 2 * (1 << 30) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    parser.add_argument("--weight-bytes", type=float, default=float(1 << 30), help="int8 bytes per projection's weights")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tilings at one row and at 8 rows "
                        "(where --rows has them)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no new projection starts")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="each variant once on the CPU (see above)")
    a = parser.parse_args()
    started = time.perf_counter()
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_products defines its kernel
        for name, (n, k, count) in PROJECTIONS.items():
            PROJECTIONS[name] = (n // 64, k // 64, count)
        a.weight_bytes = 0
    elif not torch.cuda.is_available():
        sys.exit("bench_int8_cuda.py needs a CUDA GPU (--dry-run checks it on the CPU)")
    device = "cpu" if a.dry_run else "cuda"
    from llama_core import triton_products  # imports triton, which CUDA builds of torch bring
    from llama_core.triton_products import KernelConfig, config_for
    torch.manual_seed(0)
    bandwidth = 1.0 if a.dry_run else copy_bandwidth()
    if not a.dry_run:
        torch.cuda.empty_cache()  # the two GiB it copied
    sms = 4 if a.dry_run else torch.cuda.get_device_properties(0).multi_processor_count
    compiled = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
                             options={"coordinate_descent_tuning": True}, dynamic=False)
    report = {"device": "cpu (a dry run)" if a.dry_run else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "multiprocessors": sms, "copy_bandwidth_bytes_per_s": bandwidth, "results": [], "cut_short": False}
    print(f"{report['device']}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s")

    def save() -> None:
        if a.out:
            a.out.write_text(json.dumps(report, indent=1))

    def measure(name: str, rows_list: list[int], sweep: bool) -> None:
        n, k, _ = PROJECTIONS[name]
        copies = max(2, int(a.weight_bytes // (n * k)))
        weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device) for _ in range(copies)]
        scales = [torch.rand(n, device=device, dtype=torch.bfloat16) * 0.01 for _ in range(copies)]
        floats = [w.to(torch.bfloat16) for w in weights[: max(2, copies // 2)]]  # 2 bytes a weight: as many bytes
        # int4 (llama_core.int4's layout): two levels a byte and a float32 scale per 32, as many weights as int8's
        packed = [w.view(torch.uint8)[:, : k // 2].contiguous() for w in weights]
        group_scales = [torch.rand(n, -(-k // 32), device=device) * 0.01 for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            int8_calls = lambda product: [lambda w=w, s=s: product(x, w, s) for w, s in zip(weights, scales)]
            if sweep:  # one row: the reduction's tilings; more: the tensor-core path's (16 rows a program)
                rule = config_for(rows, n, k, sms)
                if rows == 1:  # taller and shorter tiles, then pipeline stages at the rule's tiling
                    configs = [KernelConfig(1, bn, bk, 1, warps, 3) for bn in (2, 4, 8, 16)
                               for bk in (512, 1024, 2048, 4096) for warps in (4, 8)]
                    configs += [KernelConfig(1, rule.block_n, rule.block_k, 1, warps, stages)
                                for warps in (4, 8) for stages in (2, 4, 5)]
                else:
                    configs = [KernelConfig(16, bn, bk, split, 4, 3) for bn in (16, 32, 64) for bk in (64, 128, 256)
                               for split in sorted({1, rule.split_k})]
                variants = {f"int8_triton[{c.block_n},{c.block_k},{c.split_k},{c.num_warps},{c.num_stages}]":
                            int8_calls(lambda x, w, s, c=c: triton_products.int8_product(x, w, s, c))
                            for c in configs}
            else:
                variants = {"bf16": [lambda w=w: F.linear(x, w) for w in floats],
                            "int8_dequant": int8_calls(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s),
                            "int8_triton": int8_calls(triton_products.int8_product),
                            "int4_triton": [lambda p=p, g=g: triton_products.int4_product(x, p, g)
                                            for p, g in zip(packed, group_scales)]}
                if rows == 1 and not a.dry_run:  # with more rows inductor leaves the product to cuBLAS: int8_dequant's
                    variants["int8_inductor"] = int8_calls(compiled)
            want = (x.float() @ weights[0].float().T) * scales[0].float()
            error = float((triton_products.int8_product(x, weights[0], scales[0]).float() - want).abs().max() / want.abs().max())
            for variant, calls in variants.items():
                try:
                    seconds = graph_seconds(calls)
                except Exception as exc:  # a tiling Triton cannot build: reported, the sweep goes on
                    print(f"{name} rows={rows} {variant}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                weight_bytes = {"bf16": 2 * n * k, "int4_triton": n * k // 2 + 4 * n * k // 32}.get(variant, n * k)
                result = {"projection": name, "n": n, "k": k, "rows": rows, "variant": variant,
                          "us": seconds * 1e6, "weight_bytes_per_s": weight_bytes / seconds,
                          "share_of_copy_bandwidth": weight_bytes / seconds / bandwidth}
                if variant == "int8_triton":
                    result["config"] = repr(config_for(rows, n, k, sms))
                    result["max_relative_error"] = error
                report["results"].append(result)
                print(f"{name:6s} {n:5d}x{k:5d} rows={rows:2d} {variant:30s} {seconds * 1e6:8.1f} us "
                      f"{result['weight_bytes_per_s'] / 1e9:7,.0f} GB/s {100 * result['share_of_copy_bandwidth']:5.1f} %")
            save()

    for name, sweep in [(name, False) for name in a.projections] + [(name, True) for name in a.projections if a.sweep]:
        if a.deadline and time.perf_counter() - started > a.deadline:
            report["cut_short"] = f"--deadline {a.deadline} s passed before {name}{' (sweep)' if sweep else ''}"
            print(report["cut_short"])
            break
        measure(name, [rows for rows in a.rows if rows <= 8] if sweep else a.rows, sweep)
        if not a.dry_run:
            torch.cuda.empty_cache()  # the projection's weights

    forward = {}
    for rows in a.rows:
        for variant in ("bf16", "int8_dequant", "int8_inductor", "int8_triton", "int4_triton"):
            times = {r["projection"]: r["us"] for r in report["results"] if r["rows"] == rows and r["variant"] == variant}
            if set(times) == set(PROJECTIONS):
                forward[f"{rows}:{variant}"] = sum(times[p] * PROJECTIONS[p][2] for p in PROJECTIONS)
        base = forward.get(f"{rows}:bf16")
        for variant in ("int8_dequant", "int8_inductor", "int8_triton", "int4_triton"):
            if base and f"{rows}:{variant}" in forward:
                us = forward[f"{rows}:{variant}"]
                print(f"a 7B forward's products, {rows} row(s): {variant} {us / 1e3:.2f} ms, "
                      f"bf16 {base / 1e3:.2f} ms: {base / us:.2f}x bf16's speed")
    report["forward_us"] = forward
    report["seconds"] = time.perf_counter() - started
    save()


if __name__ == "__main__":
    main()
