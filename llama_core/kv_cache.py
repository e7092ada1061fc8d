"""The key/value cache of one attention layer: fixed buffers written in place, one row per sequence slot."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of past positions for `max_batch_size` sequence slots.

    Buffers are [max_batch_size, n_kv_heads, max_seq_len, head_dim] and never change shape, so a
    compiled decode step can be replayed for every position. Each row is a slot: a sequence that
    owns it writes its own positions, which may differ from row to row.

    `dtype` may be narrower than the model's (a float32 model with a float16 cache holds twice the
    context in the same memory): keys and values are rounded to it when written and widened back to
    the model's dtype when read.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()

    def copy_prefix(self, src_row: int, dst_row: int, length: int) -> None:
        """Copies the keys and values of positions [0, length) from one row to another, on this cache's device."""
        self.k_cache[dst_row, :, :length] = self.k_cache[src_row, :, :length]
        self.v_cache[dst_row, :, :length] = self.v_cache[src_row, :, :length]

    def update(
        self,
        input_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache_rows: Optional[torch.Tensor | slice] = None,
        kv_len: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v at their positions and returns the cached keys and values to attend over.

        Args:
            input_pos: [B, S] position of each new token in its own sequence.
            k, v: [B, n_kv_heads, S, head_dim] new keys and values.
            cache_rows: [B] cache row of each batch row, or a slice of B consecutive rows; None means
                rows 0..B-1.
            kv_len: how many leading positions to return; None returns all max_seq_len.

        Returns:
            Keys and values, each [B, n_kv_heads, kv_len, head_dim], in k's dtype.
        """
        batch, dtype = k.shape[0], k.dtype
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        if cache_rows is None:
            cache_rows = slice(0, batch)
        length = self.max_seq_len if kv_len is None else kv_len
        if isinstance(cache_rows, slice):  # consecutive rows: write into and attend over views, no gather
            k_rows, v_rows = self.k_cache[cache_rows], self.v_cache[cache_rows]
            batch_rows = torch.arange(batch, device=k.device)[:, None]
            k_rows[batch_rows, :, input_pos] = k.transpose(1, 2)
            v_rows[batch_rows, :, input_pos] = v.transpose(1, 2)
            return k_rows[:, :, :length].to(dtype), v_rows[:, :, :length].to(dtype)
        # Advanced indices separated by a slice put their broadcast shape [B, S] first.
        self.k_cache[cache_rows[:, None], :, input_pos] = k.transpose(1, 2)
        self.v_cache[cache_rows[:, None], :, input_pos] = v.transpose(1, 2)
        return self.k_cache[cache_rows, :, :length].to(dtype), self.v_cache[cache_rows, :, :length].to(dtype)
