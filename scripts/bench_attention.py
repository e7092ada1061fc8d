"""The CPU kernels' decode attention alone (llama_core/cpu_kernels/layer.c): one new token attending over a
long context, for each KV-cache dtype, with a separate cache per layer so that every read comes from memory
as in a model. Prints ms per layer and the cache bytes read per second.

    python scripts/bench_attention.py --threads 2 --length 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core import cpu_kernels  # noqa: E402
from llama_core.cpu_kernels import layer_ops  # noqa: E402
from llama_core.kv_cache import KVCache  # noqa: E402

SHAPES = {"110m": (12, 12, 64, 12), "7b": (32, 32, 128, 4), "70b": (64, 8, 128, 4)}  # heads, kv heads, head_dim, layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--length", type=int, default=4096, help="positions attended over")
    p.add_argument("--shapes", default="110m,7b,70b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_kernels.available():
        raise SystemExit("error: the CPU kernels are not built here (no C compiler, or LLAMA_CORE_CPU_KERNELS=0)")
    print(f"{torch.get_num_threads()} threads, {a.length} positions")
    for shape in a.shapes.split(","):
        heads, kv_heads, head_dim, layers = SHAPES[shape]
        for name in a.dtypes.split(","):
            dtype = getattr(torch, name)
            caches = [KVCache(1, a.length, kv_heads, head_dim, dtype, torch.device("cpu")) for _ in range(layers)]
            for cache in caches:
                cache.k_cache.copy_(torch.randn(cache.k_cache.shape))
                cache.v_cache.copy_(torch.randn(cache.v_cache.shape))
            qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim)
            rotation = torch.randn(1, head_dim // 2, 2)
            position = torch.tensor([[a.length - 1]])

            def all_layers():
                for cache in caches:
                    layer_ops.attend_new_tokens(qkv, rotation, cache.k_cache, cache.v_cache, None, position, heads,
                                                kv_heads)

            all_layers()
            best = float("inf")
            for _ in range(a.repeats):
                start = time.perf_counter()
                all_layers()
                best = min(best, (time.perf_counter() - start) / layers)
            read = caches[0].k_cache.nbytes * 2
            print(f"{shape:5s} heads {heads}/{kv_heads} head_dim {head_dim}  {name:9s} {best * 1e3:6.2f} ms a layer  "
                  f"{read / best / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
