"""Micro-benchmark of int8 weight-only products on CPU against float32, at the projections of a model shape:
which int8 kernel to use, and from how many rows.

    python scripts/bench_int8.py --threads 2                       # 15m and 110m, 1, 8 and 32 rows
    python scripts/bench_int8.py --shapes 110m --rows 1 --kernels fp32,fbgemm
    python scripts/bench_int8.py --shapes "" --accuracy default --accuracy ../shared/models/stories260K

Each product runs over all of one forward's projections (every layer's fused q/k/v, output, fused
gate/up and down projection, then the vocabulary projection), each with its own random weights, so memory
is read as a real forward reads it. Kernels (weights quantized per output channel, as llama_core does):

    fp32         F.linear on the float32 weight stored column-major (llama_core's CPU float path without
                 its own kernels)
    fp32-panels  llama_core's float32 kernel (llama_core.cpu_kernels.PanelLinear), where it builds
    dequant      F.linear(x, w_int8.float()) * scales: a whole dequantized copy per product
    int8pack     torch.ops.aten._weight_int8pack_mm(x, w_int8, scales), float32 x
    int8pack-bf16  the same with x and scales in bfloat16 (the gpt-fast path), output back to float32
    fbgemm       torch.ops.quantized.linear_dynamic: x quantized to uint8 on the fly with one scale for
                 the whole input, int8 x int8 products (what torch.ao.nn.quantized.dynamic.Linear runs)
    fbgemm-rr    the same with reduce_range (7-bit activations, torch.ao's default on x86)
    llama_core   llama_core's Int8Linear: its own int8 kernel where it builds (llama_core.cpu_kernels: each row
                 of x rounded to 8 bits on its own scale, VNNI products), else fbgemm with each row scaled
                 to its own range (llama_core.quantize)
    compiled     torch.compile of the dequant product (inductor may fuse the dequantization)

The kernels take turns, --repeats times; the median is printed, in ms per forward, with each kernel's
ratio to fp32 and its largest error against the float64 product of the dequantized weight, relative to
that product's largest magnitude.

With --accuracy CKPT_DIR (repeatable; "default" is the embedded model) it also prints how far
`quantize="int8"` moves that model from float32: the largest |logprob difference| over the whole
vocabulary and over the chosen tokens, at every position of float32's greedy continuations of a few
prompts, and how often the two models' most likely tokens agree there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core import cpu_kernels  # noqa: E402
from llama_core.cpu_kernels import PanelLinear  # noqa: E402
from llama_core.quantize import Int8Linear  # noqa: E402

SHAPES = {"tiny": (192, 512, 6, 512), "15m": (288, 768, 6, 32000), "110m": (768, 2048, 12, 32000)}  # dim, hidden, layers, vocab


def projection_shapes(dim: int, hidden: int, n_layers: int, vocab: int) -> list[tuple[int, int]]:
    """[out, in] of every product in one forward, q/k/v and gate/up fused as llama_core runs them."""
    return [(3 * dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)] * n_layers + [(vocab, dim)]


def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _fbgemm(reduce_range: bool):
    def prepare(w):
        q, s = quantized(w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized tensors are deprecated, the kernel is not gone
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros_like(s, dtype=torch.long), 0)
        return (torch.ops.quantized.linear_prepack(qw, None),)

    return prepare, lambda x, packed: torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


def _dequant(x, q, s):
    return F.linear(x, q.to(x.dtype)) * s


def kernels() -> dict[str, tuple[Callable, Callable]]:
    """name: (prepare(float weight) -> tuple of tensors, run(x, *prepared) -> [rows, out] float32)."""
    torch._dynamo.config.recompile_limit = 64  # one compilation per weight shape and row count
    compiled = torch.compile(_dequant, dynamic=False)
    return {
        "fp32": (lambda w: (w.t().contiguous().t(),), F.linear),
        **({"fp32-panels": (lambda w: (PanelLinear(w),), lambda x, layer: layer(x))} if cpu_kernels.available() else {}),
        "dequant": (quantized, _dequant),
        "int8pack": (quantized, torch.ops.aten._weight_int8pack_mm),
        "int8pack-bf16": (lambda w: (quantized(w)[0], quantized(w)[1].bfloat16()),
                          lambda x, q, s: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s).float()),
        "fbgemm": _fbgemm(reduce_range=False),
        "fbgemm-rr": _fbgemm(reduce_range=True),
        "llama_core": (lambda w: (Int8Linear(w),), lambda x, layer: layer(x)),
        "compiled": (quantized, compiled),
    }


def max_relative_error(run, prepared, reference_weights, x) -> float:
    worst = 0.0
    for state, (q, s) in zip(prepared, reference_weights):
        ref = x.double() @ (q.double() * s.double()[:, None]).T
        worst = max(worst, float((run(x, *state).double() - ref).abs().max() / ref.abs().max()))
    return worst


def accuracy(ckpt_dir: Optional[str]) -> str:
    """One line: how far int8 weights move the model at ckpt_dir (None: the embedded one) from float32."""
    from llama_core import Llama

    options = dict(max_seq_len=256, max_batch_size=4, device="cpu", dtype="float32")
    reference, int8 = Llama.build(ckpt_dir, **options), Llama.build(ckpt_dir, **options, quantize="int8")
    if ckpt_dir is None:
        prompts = [reference.tokenizer.encode(t, bos=True, eos=False) for t in ("ROMEO:", "To be, or not", "The king")]
    else:  # token ids, so that a stand-in vocabulary (stories260K's) works too
        prompts = [[1], [1, 461, 461, 401, 401, 401], [1, 300, 301, 302, 13, 400, 77, 200, 150]]
    continuations, _ = reference.generate(prompts, 64, temperature=0)
    worst = worst_chosen = 0.0
    same = total = 0
    for prompt, continuation in zip(prompts, continuations):
        tokens = torch.tensor([prompt + continuation])
        with torch.inference_mode():
            ref, got = (torch.log_softmax(l.model(tokens, kv_len=tokens.shape[1])[0, len(prompt) - 1 : -1], -1)
                        for l in (reference, int8))
        chosen = torch.tensor(continuation)[:, None]
        worst = max(worst, float((got - ref).abs().max()))
        worst_chosen = max(worst_chosen, float((got.gather(1, chosen) - ref.gather(1, chosen)).abs().max()))
        same += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    return (f"{Path(ckpt_dir).name if ckpt_dir else 'embedded default'}: max |int8 - float32 logprob| "
            f"{worst:.3f} (vocabulary), {worst_chosen:.3f} (chosen tokens); top token agrees at {same}/{total} "
            f"positions ({100 * same / total:.0f} %)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="15m,110m", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,8,32", help="rows per product (decode batch, or prompt tokens)")
    p.add_argument("--kernels", default="all", help="comma-separated kernel names, or all")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--accuracy", action="append", default=[], metavar="CKPT_DIR",
                   help="also print int8's deviation from float32 on this checkpoint ('default': the embedded model)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    available = kernels()
    chosen = list(available) if a.kernels == "all" else a.kernels.split(",")
    unknown = [k for k in chosen if k not in available]
    if unknown:
        p.error(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(available)}")
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          "ms per forward's projections (ratio to fp32), max relative error")
    for shape in (s for s in a.shapes.split(",") if s):  # --shapes "": only --accuracy
        torch.manual_seed(0)
        weights = [torch.randn(shape_) * 0.02 for shape_ in projection_shapes(*SHAPES[shape])]
        reference = [quantized(w) for w in weights]
        prepared = {name: [available[name][0](w) for w in weights] for name in chosen}
        print(f"\n{shape}: dim {SHAPES[shape][0]}, hidden {SHAPES[shape][1]}, {SHAPES[shape][2]} layers, "
              f"vocab {SHAPES[shape][3]}")
        print(f"{'rows':>5}" + "".join(f"{name:>22}" for name in chosen))
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, SHAPES[shape][0])
            h = torch.randn(rows, SHAPES[shape][1])
            inputs = [h if w.shape[1] == h.shape[1] and w.shape[1] != x.shape[1] else x for w in weights]
            times = {name: [] for name in chosen}
            with torch.inference_mode():
                for name in chosen:  # warm-up (and compilation)
                    for state, xi in zip(prepared[name], inputs):
                        available[name][1](xi, *state)
                for _ in range(a.repeats):
                    for name in chosen:
                        run = available[name][1]
                        start = time.perf_counter()
                        for state, xi in zip(prepared[name], inputs):
                            run(xi, *state)
                        times[name].append((time.perf_counter() - start) * 1e3)
            medians = {name: statistics.median(t) for name, t in times.items()}
            base = medians.get("fp32")
            cells = [f"{m:.2f}" + (f" ({m / base:.2f}x)" if base else "") for m in medians.values()]
            print(f"{rows:>5}" + "".join(f"{c:>22}" for c in cells))
        with torch.inference_mode():
            x = torch.randn(8, SHAPES[shape][0])
            pick = [i for i, w in enumerate(weights) if w.shape[1] == x.shape[1]][-2:]  # w13 and the vocabulary
            errors = [max_relative_error(available[n][1], [prepared[n][i] for i in pick], [reference[i] for i in pick], x)
                      for n in chosen]
        print(f"{'err':>5}" + "".join(f"{e:>22.1e}" for e in errors))
    if a.accuracy:
        print()
    for ckpt_dir in a.accuracy:
        print(accuracy(None if ckpt_dir == "default" else ckpt_dir))


if __name__ == "__main__":
    main()
