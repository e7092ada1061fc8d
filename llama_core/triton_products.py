"""Weight-only int8 and int4 products for a few rows on CUDA, in Triton kernels that read each weight once.

Decoding multiplies one row (or a few) of activations by every weight: the product is bound by how fast the
weights are read. torch has no CUDA kernel for an int8 or int4 weight with 16-bit activations, so the plain
product first writes the weight out in 16 bits for cuBLAS (int8: 1 byte read, 2 written and 2 read again per
weight; slower than 16-bit weights). These kernels convert each weight in registers as they read it:

* one row (``block_m == 1``): each program reduces ``block_n`` output rows over a slice of the inputs, the
  weight tile [block_n, block_k] read along its contiguous inputs;
* 2 to 64 rows: the same tiles, converted to the activations' dtype and multiplied on tensor cores
  (``tl.dot``), 16 rows a program (the rows padded to 16; past 16 rows each 16 read the weight again, still
  fewer bytes than converting it first).

int8 (llama_core.quantize): weight [n, k] int8, one scale per output row, applied to the sums. int4
(llama_core.int4): two levels a byte [n, k / 2] (input 2i low, 2i + 1 high), level q standing for (q - 8)
times its group's scale, one float32 scale per row and group of 32 inputs.

Where there are too few output tiles to keep every SM reading, the inputs are split (``split_k``) and the
partial sums added afterwards in float32, in a fixed order (no atomics: the same inputs give the same bits).

The module imports triton: llama_core.quantize loads it only on a CUDA build of torch. Under torch.compile the
kernels are ``torch.library.triton_op``s, which inductor places in its own generated code (and CUDA graphs);
eager calls launch them directly. ``TRITON_INTERPRET=1`` runs them on CPU tensors (tests/test_quantize.py).
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # more rows than this (a prompt) are compute-bound: the dequantized weight through cuBLAS


@dataclass(frozen=True)
class KernelConfig:
    """One launch's tiling: rows per program (1: the reduction path), output rows and inputs per tile, how
    many slices the inputs are split in, and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def config_for(rows: int, n: int, k: int, sms: int) -> KernelConfig:
    """The tiling for rows x k times n x k on a device with sms multiprocessors. One row: 8 output rows by 1,024
    inputs a program (the fastest one-row tiling on an H100 for every 7B projection, or within 7 % of it:
    scripts/bench_int8_cuda.py --sweep, docs/benchmarks.md "GPU"), the inputs split only where the output rows
    give fewer programs than SMs (split 2 was slower at 4 programs an SM). More rows: 32 by 128, split to
    about 4 programs per SM (not yet swept). rows may be symbolic (a step compiled for any number of rows):
    only whether it is 1 is asked."""
    if rows == 1:
        block_m, block_n, block_k, programs = 1, 8, min(1024, max(64, triton.next_power_of_2(k))), sms
    else:
        block_m, block_n, block_k, programs = 16, 32, 128, 4 * sms
    split_k = max(1, min(triton.cdiv(programs, triton.cdiv(n, block_n)), k // (2 * block_k)))
    return KernelConfig(block_m, block_n, block_k, split_k)


# int4's layout (llama_core.int4), passed to the kernel as constexpr arguments: a Triton kernel may read no
# module global that is not a tl.constexpr object (NameError at compile time, on the device only).
GROUP = 32  # inputs per scale
ZERO_LEVEL = 8  # the level standing for 0


@triton.jit
def _rows_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_sn, stride_om,
                 stride_os, INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, ZERO_LEVEL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_n = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & in_k[None, :], other=0.0)
        if INT4:  # two levels a byte, then each group of 32 on its scale (inputs past K: x is 0 there)
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :],
                             mask=in_n[:, None] & (offs_b[None, :] < (K + 1) // 2), other=ZERO_LEVEL * 17)
            levels = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scales = tl.load(scale_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                             mask=in_n[:, None] & (offs_g[None, :] < tl.cdiv(K, GROUP)), other=0.0)
            w = ((levels.to(tl.float32) - ZERO_LEVEL).reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
                 * scales[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=in_n[:, None] & in_k[None, :], other=0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if not INT4:
        acc = acc * tl.load(scale_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & in_n[None, :])


def _product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, int4: bool, launch, sms: int,
             config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [..., k] (16-bit) times the int8 or int4 weight of n rows: [..., n] in x's dtype. launch wraps the
    kernel (itself, or torch's wrap_triton for the traced op)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    config = config or config_for(m, n, k, sms)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        partial_stride = 0
    else:
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        partial_stride = m * n
    grid = (triton.cdiv(n, config.block_n), splits, triton.cdiv(m, config.block_m))
    with launch_device(x, launch):
        launch(_rows_kernel)[grid](
            rows, weight, scales, out, m, n, k, k_per_split, rows.stride(0), weight.stride(0),
            scales.stride(0) if int4 else 1, n, partial_stride, INT4=int4,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP=GROUP,
            ZERO_LEVEL=ZERO_LEVEL, num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        out = out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)


def _direct(kernel):
    return kernel


def launch_device(x: torch.Tensor, launch) -> contextlib.AbstractContextManager:
    """Where a kernel launched now (launch _direct) runs on x's GPU: Triton launches on the current device and its
    stream, not the tensors' (a model on cuda:1 would be read from cuda:0). Inductor's code, where the traced
    operator lands, guards its device itself."""
    if launch is _direct and x.device.type == "cuda":
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def int8_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [..., k] in bfloat16 or float16, at most MAX_ROWS rows, times weight [n, k] (int8, contiguous) scaled
    by scales [n]: x @ (weight * scales[:, None]).T in x's dtype, launched now (eager, or on CPU tensors
    under TRITON_INTERPRET=1)."""
    return _product(x, weight, scales, False, _direct, _multiprocessors(x.device), config)


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [..., k] in bfloat16 or float16, at most MAX_ROWS rows, times the int4 weight packed [n, >= k / 2]
    (uint8, two levels a byte) with scales [n, >= k / 32] (float32, one per row and group): in x's dtype,
    launched now. config.block_k must be a multiple of 32."""
    return _product(x, packed, scales, True, _direct, _multiprocessors(x.device), config)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.library.triton_op("llama_core::int8_rows_product", mutates_args=())
def int8_rows_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_product() as an operator torch.compile traces into its graph (inductor emits the kernel in its
    own code, captured in CUDA graphs with the rest of the step)."""
    return _product(x, weight, scales, False, torch.library.wrap_triton, _multiprocessors(x.device))


@torch.library.triton_op("llama_core::int4_rows_product", mutates_args=())
def int4_rows_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int4_product() as an operator torch.compile traces into its graph."""
    return _product(x, packed, scales, True, torch.library.wrap_triton, _multiprocessors(x.device))
