"""The small operations of a decoding layer in layer.c (see its header): float32 tensors on the CPU, with
the kernels loaded (panels.available()). The model calls them where its runner turned them on
(`Transformer.use_cpu_kernels`)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import panels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] * rsqrt(mean(x^2) + eps) * weight, as F.rms_norm."""
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    panels._KERNELS.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                             torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * hidden] (gate, then up) -> silu(gate) * up [..., hidden]."""
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    hidden = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], hidden)
    panels._KERNELS.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * hidden), hidden,
                             torch.get_num_threads())
    return out


def attend_new_tokens(qkv: torch.Tensor, rotation: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  rows: Optional[torch.Tensor | slice], positions: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """S new tokens in each of B rows (S = 1 when decoding): qkv [B * S, (heads + 2 * kv_heads) * head_dim] or
    [B, S, ...] (their queries, keys and values, as the stacked projection gives them), rotation with
    [head_dim / 2, 2] (cos, sin) per token, positions [B, S] (or [B]). Writes each token's rotated key and
    value at its position of its row's cache row (rows: [B], a slice, or None for 0..B-1) in k_cache and
    v_cache [slots, kv_heads, max_seq_len, head_dim], all before any attends, and returns each token's
    attention over positions 0..its own [B * S, heads * head_dim]."""
    slots, _, max_seq_len, head_dim = k_cache.shape
    batch = positions.shape[0]
    tokens_per_row = positions.numel() // batch
    if rows is None:
        rows = slice(0, batch)
    if isinstance(rows, slice):
        rows = _consecutive_rows(rows.start or 0, rows.stop if rows.stop is not None else batch)
    rows = rows.to(torch.int64)
    if tokens_per_row > 1:
        rows = rows.repeat_interleave(tokens_per_row)
    rows = rows.contiguous()
    positions = positions.reshape(-1).to(torch.int64).contiguous()
    qkv = qkv.reshape(positions.shape[0], -1)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    rotation = rotation.contiguous()
    count = positions.shape[0]
    out = torch.empty(count, heads * head_dim)
    status = panels._KERNELS.attend_new_tokens(
        qkv.data_ptr(), qkv.stride(0), rotation.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
        positions.data_ptr(), count, heads, kv_heads, head_dim, slots, max_seq_len, out.data_ptr(),
        torch.get_num_threads())
    if status == -1:
        raise IndexError(f"cache rows {rows.tolist()} or positions {positions.tolist()} outside a KV cache of "
                         f"{slots} rows and {max_seq_len} positions")
    if status:
        raise MemoryError("no memory for the attention's scores")
    torch.autograd.graph.increment_version(k_cache)  # the cache was written: its owners watch this counter
    return out


@functools.lru_cache(maxsize=256)
def _consecutive_rows(start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 as an index tensor, made once (every layer of every step asks; never written)."""
    return torch.arange(start, stop)
