"""One decode step, one new token for each of a set of KV-cache rows, in two shapes.

Dynamic (the default): only the given rows, attending over the longest row's positions: the least work,
which is what a CPU wants. Static (`compile=True`): always every row of the cache over all max_seq_len
positions, so shapes never change and torch.compile can capture the step once (on CUDA as a CUDA graph,
mode "reduce-overhead"); rows not asked for compute a throw-away token at the last position of their own
row, which no prompt reaches (a prompt is at most max_seq_len - 1 tokens, so a row being prefilled in
chunks keeps what it wrote) and which a row's own decoding writes before it ever attends to it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .model import Transformer


class DecodeStep:
    def __init__(self, model: Transformer, max_batch_size: int, compile: bool = False, static: bool = False) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = model.layers[0].attention.kv_cache.max_seq_len
        self.static = static or compile
        self._step = self._all_rows
        if compile:
            on_cuda = next(model.parameters()).device.type == "cuda"
            self._step = torch.compile(
                self._all_rows, mode="reduce-overhead" if on_cuda else None, fullgraph=True, dynamic=False
            )

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: Optional[torch.Tensor | slice] = None,
        kv_len: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] for tokens [B] at positions [B] in cache rows [B] (a slice: consecutive rows;
        None: rows 0..B-1).

        kv_len: a bound the caller knows on the host (> every position; extra positions are masked), so
        the dynamic step needs no device-to-host read; None reads it from positions."""
        if not self.static:
            if kv_len is None:
                kv_len = int(positions.max()) + 1
            return self.model(tokens[:, None], positions[:, None], cache_rows=rows, kv_len=kv_len)[:, 0]
        if rows is None:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
        all_tokens = torch.zeros(self.max_batch_size, dtype=tokens.dtype, device=tokens.device)
        all_positions = torch.full((self.max_batch_size,), self.max_seq_len - 1, dtype=positions.dtype, device=positions.device)
        all_tokens[rows] = tokens
        all_positions[rows] = positions
        logits = self._step(all_tokens, all_positions)[rows]
        # Copy out of the step's output, which the next CUDA graph replay overwrites (a slice is a view).
        return logits.clone() if isinstance(rows, slice) else logits

    def _all_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None], positions[:, None])[:, 0]


def right_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Prompts as one prefill batch: tokens [B, longest] padded on the right, positions [B, longest]
    (0, 1, ... in every row) and lengths [B]. A row never attends to the padding after its own prompt,
    and decoding overwrites the padding's cache entries before they are ever read."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    longest = int(lengths.max())
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    positions = torch.arange(longest, device=device).expand(len(prompts), longest)
    return tokens.to(device), positions, lengths
