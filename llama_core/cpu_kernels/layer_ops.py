"""The small operations of a decoding layer in layer.c (see its header), and a whole block in block.c:
float32 tensors on the CPU, with the kernels loaded (panels.available()). The model calls them where its
runner turned them on (`Transformer.use_cpu_kernels`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for float32 logits [B, V]: the same indices (the first of equal maxima, the
    first NaN), in one pass of 16 lanes."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    panels._KERNELS.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


@dataclass(frozen=True)
class TokenSlots:
    """Where each of a forward's new tokens goes, as the kernels take it: its KV-cache row and position
    (int64 [count]) and its rotation ([count, head_dim / 2, 2] cos, sin), made once per forward for all its
    layers."""

    rows: torch.Tensor
    positions: torch.Tensor
    rotation: torch.Tensor

    @property
    def count(self) -> int:
        return self.positions.shape[0]


def token_slots(rows: torch.Tensor, positions: torch.Tensor, rotation: torch.Tensor) -> TokenSlots:
    """New tokens at their cache rows (one per token, as token_rows gives them) and positions (any shape, one
    per token), with rotation [head_dim / 2, 2] per token."""
    count = positions.numel()
    return TokenSlots(rows.contiguous(), positions.reshape(-1).to(torch.int64).contiguous(),
                      rotation.reshape(count, -1).contiguous())


def token_rows(rows: Optional[torch.Tensor | slice], batch: int, tokens_per_row: int) -> torch.Tensor:
    """Each token's cache row (int64), for `batch` rows of `tokens_per_row` tokens in rows ([batch], a slice,
    or None for 0..batch-1)."""
    if rows is None:
        rows = slice(0, batch)
    if isinstance(rows, slice):
        rows = _consecutive_rows(rows.start or 0, rows.stop if rows.stop is not None else batch)
    rows = rows.to(torch.int64)
    return rows.repeat_interleave(tokens_per_row) if tokens_per_row > 1 else rows


def attend_new_tokens(qkv: torch.Tensor, rotation: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: Optional[torch.Tensor | slice], positions: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """S new tokens in each of B rows (S = 1 when decoding): qkv [B * S, (heads + 2 * kv_heads) * head_dim] or
    [B, S, ...] (their queries, keys and values, as the stacked projection gives them), rotation with
    [head_dim / 2, 2] (cos, sin) per token, positions [B, S] (or [B]). Writes each token's rotated key and
    value at its position of its row's cache row (rows: [B], a slice, or None for 0..B-1) in k_cache and
    v_cache [slots, kv_heads, max_seq_len, head_dim] (float32, or bfloat16 or float16, rounded to it), all before
    any attends, and returns each token's attention over positions 0..its own [B * S, heads * head_dim]."""
    batch = positions.shape[0]
    slots = token_slots(token_rows(rows, batch, positions.numel() // batch), positions, rotation)
    return attend(qkv, slots, k_cache, v_cache, heads, kv_heads)


def attend(qkv: torch.Tensor, slots: TokenSlots, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
           kv_heads: int) -> torch.Tensor:
    """attend_new_tokens for tokens whose slots are made already."""
    cache_rows, max_seq_len, head_dim = k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]
    qkv = qkv.reshape(slots.count, -1)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(slots.count, heads * head_dim)
    status = panels._KERNELS.attend_new_tokens(
        qkv.data_ptr(), qkv.stride(0), slots.rotation.data_ptr(), cache_kind(k_cache, v_cache), k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.rows.data_ptr(), slots.positions.data_ptr(), slots.count, heads, kv_heads, head_dim, cache_rows,
        max_seq_len, out.data_ptr(), torch.get_num_threads())
    _check(status, slots, k_cache)
    return out


def decoder_block(x: torch.Tensor, slots: TokenSlots, block,
                  projections: tuple[int, int, Optional[int], Optional[int]]) -> torch.Tensor:
    """A whole TransformerBlock (llama_core.model) in one call of block.c, for x [..., dim] holding the tokens
    of slots in order; the block's projections must be in panels of one kind (see `block_projections`, which
    gives `projections`) and its attention cached. The same values as its modules give one by one."""
    attention, feed_forward = block.attention, block.feed_forward
    cache = attention.kv_cache
    kind, weights, scales, sums = projections
    out = x.contiguous().clone()
    status = panels._KERNELS.decoder_block(
        out.data_ptr(), slots.count, out.shape[-1], block.attention_norm.eps, block.attention_norm.weight.data_ptr(),
        kind, weights, scales, sums, block.ffn_norm.weight.data_ptr(), feed_forward.w2.in_features,
        slots.rotation.data_ptr(), cache_kind(cache.k_cache, cache.v_cache), cache.k_cache.data_ptr(),
        cache.v_cache.data_ptr(), slots.rows.data_ptr(),
        slots.positions.data_ptr(), attention.n_heads, attention.n_kv_heads, attention.head_dim,
        cache.k_cache.shape[0], cache.k_cache.shape[2], torch.get_num_threads())
    _check(status, slots, cache.k_cache)
    return out


INT8, INT4 = 3, 4  # block.c's kinds for int8 and int4 panels, after PANEL_KINDS' float ones


def block_projections(block) -> Optional[tuple[int, int, Optional[int], Optional[int]]]:
    """Whether a block runs in one call of block.c, and how: None where its four projections (wqkv, wo, w13, w2)
    are not all in panels of one kind (float32 panels of one dtype, int8 or int4); else block.c's kind and the
    addresses of three C arrays of their panels', scales' and row sums' addresses (None where the kind has
    none). Worked out once per set of projections and kept on the block (its arrays are int64 tensors, so a
    copy of the block works them out again); every decode step asks, so this reads the modules' dicts directly."""
    attention, feed_forward = block._modules["attention"], block._modules["feed_forward"]
    projections = (attention._modules.get("wqkv"), attention._modules.get("wo"), feed_forward._modules.get("w13"),
                   feed_forward._modules.get("w2"))
    held = [None if p is None else p._buffers.get("panels") for p in projections]
    key = tuple((id(p), None if t is None else t.data_ptr()) for p, t in zip(projections, held))
    kept = block.__dict__.get("_block_projections")
    if kept is None or kept[0] != key:
        kept = block._block_projections = (key, *_one_call(projections, held))
    _, kind, arrays = kept
    if kind is None:
        return None
    return (kind, *(None if array is None else array.data_ptr() for array in arrays))


def _one_call(projections, held) -> tuple[Optional[int], list]:
    if any(t is None for t in held) or len({type(p) for p in projections}) != 1:
        return None, []
    quantization = getattr(projections[0], "quantization", None)
    if quantization == "int8":
        kind, scales, sums = INT8, [p.padded_scales for p in projections], [p.weight_sums for p in projections]
    elif quantization == "int4":
        kind, scales, sums = INT4, [p.panel_scales for p in projections], None
    elif isinstance(projections[0], panels.PanelLinear) and len({t.dtype for t in held}) == 1:
        kind, scales, sums = panels.PANEL_KINDS[held[0].dtype], None, None
    else:
        return None, []
    arrays = [None if tensors is None else torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
              for tensors in (held, scales, sums)]  # they live as long as the addresses they give out
    return kind, arrays


def cache_kind(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernels' number for a KV cache's dtype (float32, bfloat16 or float16, as panels.PANEL_KINDS)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in panels.PANEL_KINDS:
        raise ValueError(f"the CPU kernels take a KV cache of float32, bfloat16 or float16, keys and values alike; "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    return panels.PANEL_KINDS[k_cache.dtype]


def _check(status: int, slots: TokenSlots, k_cache: torch.Tensor) -> None:
    if status == -1:
        raise IndexError(f"cache rows {slots.rows.tolist()} or positions {slots.positions.tolist()} outside a KV "
                         f"cache of {k_cache.shape[0]} rows and {k_cache.shape[2]} positions")
    if status:
        raise MemoryError("no memory for the layer's working buffers")
    torch.autograd.graph.increment_version(k_cache)  # the cache was written: its owners watch this counter


@functools.lru_cache(maxsize=256)
def _consecutive_rows(start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 as an index tensor, made once (every layer of every step asks; never written)."""
    return torch.arange(start, stop)
