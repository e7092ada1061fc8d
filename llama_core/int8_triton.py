"""int8 weight-only products for a few rows on CUDA, in a Triton kernel that reads each int8 weight once.

Decoding multiplies one row (or a few) of activations by every weight: the product is bound by how fast the
weights are read. torch has no CUDA kernel for an int8 weight with 16-bit activations, so the plain product
first writes the weight out in bfloat16 for cuBLAS (1 byte read, 2 written and 2 read again per weight:
slower than bfloat16 weights). This kernel converts each weight in registers as it is read:

* one row (``block_m == 1``): each program reduces ``block_n`` output rows over a slice of the inputs, the
  weight tile [block_n, block_k] read along its contiguous inputs;
* 2 to 64 rows: the same tiles, converted to the activations' dtype and multiplied on tensor cores
  (``tl.dot``), 16 rows a program (the rows padded to 16; past 16 rows each 16 read the weight again, still
  fewer bytes than converting it first).

Where there are too few output tiles to keep every SM reading, the inputs are split (``split_k``) and the
partial sums added afterwards in float32, in a fixed order (no atomics: the same inputs give the same bits).
The per-row scale is applied in the kernel.

The module imports triton: llama_core.quantize loads it only on a CUDA build of torch. Under torch.compile the
kernel is a ``torch.library.triton_op``, which inductor places in its own generated code (and CUDA graphs);
eager calls launch it directly. ``TRITON_INTERPRET=1`` runs it on CPU tensors (tests/test_quantize.py).
"""

from __future__ import annotations

import os
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
    """The tiling for rows x k times n x k on a device with sms multiprocessors: about 4 programs per SM
    (inputs split where the output rows alone give fewer), each slice at least two tiles deep. rows may be
    symbolic (a step compiled for any number of rows): only whether it is 1 is asked.
    LLAMA_CORE_INT8_TRITON_CONFIG="block_n,block_k,split_k,num_warps,num_stages" (split_k 0: this rule's)
    overrides it, for scripts/bench_int8_cuda.py's sweep."""
    block_m = 1 if rows == 1 else 16
    block_n, block_k, num_warps, num_stages = (8, 512, 4, 3) if block_m == 1 else (32, 128, 4, 3)
    split_k = 0
    override = os.environ.get("LLAMA_CORE_INT8_TRITON_CONFIG")
    if override:
        block_n, block_k, split_k, num_warps, num_stages = (int(v) for v in override.split(","))
    if split_k <= 0:
        tiles = triton.cdiv(n, block_n)
        split_k = max(1, min(triton.cdiv(4 * sms, tiles), k // (2 * block_k)))
    return KernelConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)


@triton.jit
def _int8_rows_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_om, stride_os,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & in_k[None, :], other=0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & in_k[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, launch, sms: int,
             config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [..., k] (16-bit) times int8 weight [n, k] scaled per row: [..., n] in x's dtype. launch wraps the
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
    launch(_int8_rows_kernel)[grid](
        rows, weight, scales, out, m, n, k, k_per_split, rows.stride(0), n, partial_stride,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        out = out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)


def _direct(kernel):
    return kernel


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
            config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [..., k] in bfloat16 or float16, at most MAX_ROWS rows, times weight [n, k] (int8, contiguous) scaled
    by scales [n]: x @ (weight * scales[:, None]).T in x's dtype, launched now (eager, or on CPU tensors
    under TRITON_INTERPRET=1)."""
    return _product(x, weight, scales, _direct, _multiprocessors(x.device), config)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.library.triton_op("llama_core::int8_rows_product", mutates_args=())
def rows_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """product() as an operator torch.compile traces into its graph (inductor emits the kernel in its own
    code, captured in CUDA graphs with the rest of the step)."""
    return _product(x, weight, scales, torch.library.wrap_triton, _multiprocessors(x.device))
