"""The Llama-2 transformer.

References: Meta's llama/model.py (weight names, interleaved rotary pairs, SwiGLU sizing) and
gpt-fast's model.py (KV cache set up after construction, explicit per-token positions).
Parameter names follow Meta's checkpoints so their state dicts load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .cpu_kernels import layer_ops
from .devices import execution_device
from .kv_cache import KVCache
from .int4 import Int4Linear
from .quantize import Int8Linear


# Prompts up to this many tokens attend in llama_core.cpu_kernels (one token at a time, O(length) each);
# longer ones in torch's SDPA, whose blocked kernel wins at length.
C_ATTENTION_MAX_TOKENS = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    cpu_kernels = False  # set by Transformer.use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels and x.dtype == torch.float32 and not torch.compiler.is_compiling():
            return layer_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused kernel, the same values
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_angles(input_pos: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """cos and sin of pos * freq for positions input_pos [B, S]: [B, S, 1, head_dim // 2, 2] float32."""
    exponents = torch.arange(0, head_dim, 2, device=input_pos.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = input_pos.float()[..., None] * inv_freq
    return torch.stack((angles.cos(), angles.sin()), dim=-1)[:, :, None]


def apply_rotary(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive pairs (x[2i], x[2i+1]) of x [B, S, H, head_dim] (Meta's layout).

    Eager, one complex product (a few kernels where the real arithmetic below takes a dozen); under
    torch.compile, real arithmetic, which inductor fuses. Both give the same values."""
    if not torch.compiler.is_compiling():
        pairs = x.float().unflatten(-1, (-1, 2))
        if all(stride % 2 == 0 for stride in pairs.stride()[:-1]) and pairs.storage_offset() % 2 == 0:  # view_as_complex's terms
            rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rotation)
            return torch.view_as_real(rotated).flatten(-2).type_as(x)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = rotation[..., 0], rotation[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.wqkv: Optional[nn.Module] = None  # wq, wk, wv stacked; set by fuse_projections()
        self.kv_cache: Optional[KVCache] = None

    cpu_kernels = False  # set by Transformer.use_cpu_kernels

    def fuse_projections(self) -> None:
        """Replaces wq, wk, wv by one stacked projection: one matrix-vector product instead of three."""
        self.wqkv = _stacked_linear(self.wq, self.wk, self.wv)
        del self.wq, self.wk, self.wv

    def forward(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        input_pos: torch.Tensor,
        mask: Optional[torch.Tensor],
        cache_rows: Optional[torch.Tensor | slice],
        kv_len: Optional[int],
        spans: Optional[list["Span"]] = None,
        slots: Optional[layer_ops.TokenSlots] = None,
    ) -> torch.Tensor:
        """spans: x is one row holding several batches' tokens one after another (Transformer.forward_spans);
        mask is then a list of each span's mask, and each span has its own positions, cache rows and kv_len.
        slots: every token attends in llama_core.cpu_kernels, at these cache rows and positions."""
        batch, seq_len, _ = x.shape
        if slots is not None and self.wqkv is not None:
            cache = self.kv_cache
            out = layer_ops.attend(self.wqkv(x), slots, cache.k_cache, cache.v_cache, self.n_heads, self.n_kv_heads)
            return self.wo(out.view(batch, seq_len, -1))
        if (spans is not None and self.cpu_kernels and self.wqkv is not None and self.kv_cache is not None
                and x.dtype == torch.float32 and not torch.compiler.is_compiling()
                and any(span.seq_len <= C_ATTENTION_MAX_TOKENS for span in spans)):
            return self._spans_partly_in_cpu_kernels(x, rotation, mask, spans)
        kv_size = self.n_kv_heads * self.head_dim
        if self.wqkv is not None:  # queries and keys side by side: one rotation for both
            qk, v = _stacked_projection(self.wqkv, x, [self.n_heads * self.head_dim + kv_size, kv_size])
        else:
            qk, v = torch.cat([self.wq(x), self.wk(x)], dim=-1), self.wv(x)
        q, k, v = self._rotated_heads(qk, v, rotation)
        if spans is None:
            return self.wo(self._attend(q, k, v, input_pos, mask, cache_rows, kv_len))
        outputs, start = [], 0  # one row of all spans' tokens: each span attends over its own cache rows
        for span, span_mask in zip(spans, mask):
            count = span.batch * span.seq_len
            pieces = (t[0, start : start + count].view(span.batch, span.seq_len, *t.shape[2:]) for t in (q, k, v))
            outputs.append(self._attend(*pieces, span.input_pos, span_mask, span.cache_rows, span.kv_len).view(1, count, -1))
            start += count
        return self.wo(torch.cat(outputs, dim=1))

    def _spans_partly_in_cpu_kernels(self, x, rotation, mask, spans) -> torch.Tensor:
        """forward over spans of which some attend in layer.c's kernel (decoding rows, prompts of up to
        C_ATTENTION_MAX_TOKENS tokens), which also rotates their query and key and writes the cache, and the
        longer prompts in torch's attention. (Where every span fits, the Transformer passes slots instead.)"""
        qkv = self.wqkv(x)
        cache = self.kv_cache
        outputs, start = [], 0
        for span, span_mask in zip(spans, mask):
            count = span.batch * span.seq_len
            piece, angles = qkv[0, start : start + count], rotation[0, start : start + count]
            if span.seq_len <= C_ATTENTION_MAX_TOKENS:
                out = layer_ops.attend_new_tokens(piece, angles, cache.k_cache, cache.v_cache, span.cache_rows,
                                                  span.input_pos, self.n_heads, self.n_kv_heads)
            else:
                out = self._attend_projected(piece.view(span.batch, span.seq_len, -1),
                                             angles.view(span.batch, span.seq_len, *angles.shape[1:]),
                                             span.input_pos, span_mask, span.cache_rows, span.kv_len)
            outputs.append(out.view(1, count, -1))
            start += count
        return self.wo(torch.cat(outputs, dim=1))

    def _attend_projected(self, qkv, rotation, input_pos, mask, cache_rows, kv_len) -> torch.Tensor:
        """_attend from the stacked projection's output qkv [B, S, (heads + 2 * kv_heads) * head_dim]."""
        kv_size = self.n_kv_heads * self.head_dim
        qk, v = qkv.split([self.n_heads * self.head_dim + kv_size, kv_size], dim=-1)
        return self._attend(*self._rotated_heads(qk, v, rotation), input_pos, mask, cache_rows, kv_len)

    def _rotated_heads(self, qk, v, rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qk [B, S, (heads + kv_heads) * head_dim] and v [B, S, kv_heads * head_dim] as heads: q [B, S, heads,
        head_dim] and k rotated (one rotation for both), v [B, S, kv_heads, head_dim]."""
        batch, seq_len = qk.shape[:2]
        qk = apply_rotary(qk.reshape(batch, seq_len, self.n_heads + self.n_kv_heads, self.head_dim), rotation)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=2)
        return q, k, v.reshape(batch, seq_len, self.n_kv_heads, self.head_dim)

    def _attend(self, q, k, v, input_pos, mask, cache_rows, kv_len) -> torch.Tensor:
        """q [B, S, heads, head_dim], k and v [B, S, kv_heads, head_dim] -> [B, S, heads * head_dim]."""
        batch, seq_len = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, head_dim]
        gqa = self.n_kv_heads != self.n_heads
        if self.kv_cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            k, v = self.kv_cache.update(input_pos, k, v, cache_rows, kv_len)
            if gqa and q.device.type == "cuda":
                out = grouped_query_attention(q, k, v, mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(batch, seq_len, -1)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of q [B, heads, S, head_dim] over k, v [B, kv_heads, L, head_dim] with an additive mask [B, 1, S, L],
    query head h reading key/value head h // (heads // kv_heads) (as enable_gqa=True). Each key/value head's
    query heads are folded into its query sequence, so that CUDA's memory-efficient kernel, which takes a
    mask, reads the cache as it is: SDPA's own GQA runs only in its flash kernel (no mask) or its math one,
    over a copy of the cache repeated per query head."""
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    per_group = heads // kv_heads
    folded = q.reshape(batch, kv_heads, per_group * seq_len, head_dim)  # head g * per_group + r, row r * S + s
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(1, 1, per_group, 1))
    return out.reshape(batch, heads, seq_len, head_dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w13: Optional[nn.Module] = None  # w1 and w3 stacked; set by fuse_projections()

    def fuse_projections(self) -> None:
        self.w13 = _stacked_linear(self.w1, self.w3)
        del self.w1, self.w3

    cpu_kernels = False  # set by Transformer.use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels and self.w13 is not None and x.dtype == torch.float32 and not torch.compiler.is_compiling():
            return self.w2(layer_ops.silu_mul(self.w13(x)))
        if self.w13 is not None:
            gate, up = _stacked_projection(self.w13, x, 2)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rotation, input_pos, mask, cache_rows, kv_len, spans=None, slots=None) -> torch.Tensor:
        """slots (llama_core.cpu_kernels.layer_ops.TokenSlots): every token attends in the CPU kernels; with
        projections in panels of one kind the whole block then runs in one call of them."""
        if slots is not None and (projections := layer_ops.block_projections(self)) is not None:
            return layer_ops.decoder_block(x, slots, self, projections)
        h = x + self.attention(self.attention_norm(x), rotation, input_pos, mask, cache_rows, kv_len, spans, slots)
        return h + self.feed_forward(self.ffn_norm(h))

    @property
    def in_one_call(self) -> bool:
        """Whether llama_core.cpu_kernels can run this block in one call: fused projections all in panels of one
        kind (float32 ones of one panel dtype, int8 ones, or int4 ones)."""
        return layer_ops.block_projections(self) is not None


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size < 1:
            raise ValueError(f"vocab_size must be filled in before building the model, got {args.vocab_size}")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    # -- KV cache ownership -------------------------------------------------------------------
    def setup_caches(self, max_batch_size: int, max_seq_len: int, dtype: Optional[torch.dtype] = None) -> None:
        """Allocates one KV cache per layer, on the device that layer runs on, in `dtype` (None: the layer's)."""
        for layer in self.layers:
            attention = layer.attention
            attention.kv_cache = KVCache(
                max_batch_size, max_seq_len, attention.n_kv_heads, attention.head_dim,
                dtype or layer.attention_norm.weight.dtype, execution_device(layer)
            )

    def fuse_projections(self) -> None:
        """Stacks each layer's q/k/v and gate/up projections for inference (state dict names change)."""
        for layer in self.layers:
            layer.attention.fuse_projections()
            layer.feed_forward.fuse_projections()

    def use_cpu_kernels(self, enabled: bool = True) -> None:
        """Runs the small operations of each layer (norms, SiLU gating, a decoding token's attention) in
        llama_core.cpu_kernels, one call each, or (False) in torch. Only for float32 on the CPU, with the
        kernels loaded: the runner turns it on there."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, FeedForward)):
                module.cpu_kernels = enabled

    def use_column_major_weights(self) -> None:
        """Stores each projection's weight [out, in] column-major, i.e. its transpose contiguous. Shapes,
        values and names stay; only strides change. On CPU, BLAS multiplies one or a few rows by that layout
        much faster: decoding the 15m shape's 32000 x 288 output layer takes 1.3 ms instead of 4.0 on one
        core (MKL, AVX2), all of the embedded model's projections 1.03 ms instead of 1.34 per token, and
        prefill-sized products take about as long as before. Int8 layers (llama_core.quantize) are not
        nn.Linear and keep their own layout. (Large float32 weights are packed for oneDNN before this, by the
        ModelRunner: see llama_core.packed_linear.)"""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
                column_major = module.weight.detach().t().contiguous().t()
                module.weight = nn.Parameter(column_major, requires_grad=False)

    def copy_cache_prefix(self, src_row: int, dst_row: int, length: int) -> None:
        """Copies positions [0, length) of KV-cache row src_row into row dst_row in every layer, each layer's
        on the device its cache lives on."""
        for layer in self.layers:
            layer.attention.kv_cache.copy_prefix(src_row, dst_row, length)

    def caches_are_enabled(self) -> bool:
        return self.layers[0].attention.kv_cache is not None

    def remove_caches(self) -> None:
        for layer in self.layers:
            layer.attention.kv_cache = None

    # -- forward ------------------------------------------------------------------------------
    def _attends_in_cpu_kernels(self, h: torch.Tensor, seq_lens: list[int]) -> bool:
        """Whether every token of a forward over h, in batches of these lengths, attends in the CPU kernels."""
        first = self.layers[0].attention
        return (first.cpu_kernels and first.wqkv is not None and first.kv_cache is not None
                and h.dtype == torch.float32 and h.device.type == "cpu" and not torch.compiler.is_compiling()
                and all(length <= C_ATTENTION_MAX_TOKENS for length in seq_lens))

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
        cache_rows: Optional[torch.Tensor | slice] = None,
        kv_len: Optional[int] = None,
        logit_index: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Runs the model; returns float32 logits.

        Args:
            tokens: [B, S] token ids.
            input_pos: [B, S] position of each token in its own sequence; None means 0..S-1.
                With caches enabled each token attends to its row's cached positions <= its own.
            cache_rows: [B] KV-cache row of each batch row, or a slice of B consecutive rows (no gather);
                None means rows 0..B-1.
            kv_len: attend over cache positions [0, kv_len); must exceed every position in input_pos.
            logit_index: [B] one position per row to return logits for; None returns all positions.

        Returns:
            [B, S, vocab] logits, or [B, 1, vocab] with logit_index.
        """
        batch, seq_len = tokens.shape
        if input_pos is None:
            input_pos = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
        h = self.tok_embeddings(tokens)
        rotation = rotary_angles(input_pos, self.args.head_dim, self.args.rope_theta)
        mask, slots = None, None
        if self._attends_in_cpu_kernels(h, [seq_len]):
            slots = layer_ops.token_slots(layer_ops.token_rows(cache_rows, batch, seq_len), input_pos, rotation)
        elif self.caches_are_enabled():
            length = kv_len if kv_len is not None else self.layers[0].attention.kv_cache.max_seq_len
            mask = _causal_mask(input_pos, length, h.dtype)
        inputs = (rotation, input_pos, mask, cache_rows)
        for layer in self.layers:
            if inputs[0].device != h.device:  # layers placed on several devices
                inputs = tuple(t.to(h.device) if isinstance(t, torch.Tensor) else t for t in inputs)
            h = layer(h, *inputs, kv_len, slots=slots)
        if logit_index is not None:
            h = h[torch.arange(batch, device=h.device), logit_index.to(h.device)][:, None]
        return self.output(self.norm(h)).float()

    def forward_spans(self, spans: list["Span"]) -> list[torch.Tensor]:
        """Several cached batches in one forward, e.g. the rows being decoded and prompts being prefilled:
        every projection runs once over all their tokens, attention runs per span over its own cache rows.
        Returns each span's float32 logits [B, vocab] at its logit_index. Caches must be enabled, and the
        model on one device (no layer offloading, no tensor parallelism)."""
        h = torch.cat([self.tok_embeddings(span.tokens).flatten(0, 1) for span in spans])[None]  # [1, T, dim]
        positions = torch.cat([span.input_pos.reshape(-1) for span in spans])[None]
        rotation = rotary_angles(positions, self.args.head_dim, self.args.rope_theta)
        slots, masks = None, None
        if self._attends_in_cpu_kernels(h, [span.seq_len for span in spans]):
            rows = torch.cat([layer_ops.token_rows(span.cache_rows, span.batch, span.seq_len) for span in spans])
            slots = layer_ops.token_slots(rows, positions[0], rotation[0])
        else:
            masks = [span.mask(h.dtype) for span in spans]
        for layer in self.layers:
            h = layer(h, rotation, positions, masks, None, None, spans, slots=slots)
        picks, start = [], 0
        for span in spans:
            rows = torch.arange(span.batch, device=h.device)
            picks.append(start + rows * span.seq_len + span.logit_index.to(h.device))
            start += span.batch * span.seq_len
        logits = self.output(self.norm(h[0, torch.cat(picks)])).float()
        return list(logits.split([span.batch for span in spans]))


@dataclass
class Span:
    """One batch of `Transformer.forward_spans`: tokens [B, S] at positions input_pos [B, S] in KV-cache
    rows cache_rows ([B] or a slice), attending over cache positions [0, kv_len); logits are returned
    at logit_index [B]."""

    tokens: torch.Tensor
    input_pos: torch.Tensor
    cache_rows: torch.Tensor | slice
    kv_len: int
    logit_index: torch.Tensor

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        return _causal_mask(self.input_pos, self.kv_len, dtype)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


def _causal_mask(input_pos: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, S, kv_len], added to the attention scores: 0 where a token at input_pos [B, S] may attend to a
    cache position, -inf where it may not. Made once per forward in the model's dtype: given a boolean
    mask, SDPA on CPU builds this itself in every layer."""
    key_pos = torch.arange(kv_len, device=input_pos.device)
    hidden = (key_pos > input_pos[..., None])[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=input_pos.device).masked_fill_(hidden, float("-inf"))


# From this many rows on, separate products beat one stacked product on CPU (scripts/bench_gemm.py).
SEPARATE_PRODUCTS_FROM_ROWS = 16


def _stacked_projection(linear: nn.Module, x: torch.Tensor, sizes: list[int] | int) -> list[torch.Tensor]:
    """x [B, S, in] through a stacked projection, one output per stacked part (sizes: the parts' sizes, or
    how many equal parts). With many rows on CPU each part of a plain weight is its own product, over a
    view of the stacked weight: MKL runs those faster than one wide one. Not in a compiled step, whose row
    count is symbolic: a branch on it would limit the graph to the rows on one side of it."""
    many_rows = not torch.compiler.is_compiling() and x.shape[0] * x.shape[1] >= SEPARATE_PRODUCTS_FROM_ROWS
    # (An offloaded linear's weight sits on the meta device until its own forward hook loads it.)
    if many_rows and type(linear) is nn.Linear and x.device.type == "cpu" and linear.weight.device.type == "cpu":
        parts = linear.weight.split(sizes) if isinstance(sizes, list) else linear.weight.chunk(sizes)
        return [F.linear(x, part) for part in parts]
    out = linear(x)
    return out.split(sizes, dim=-1) if isinstance(sizes, list) else out.chunk(sizes, dim=-1)


def _stacked_linear(*linears: nn.Module) -> nn.Module:
    """One module computing cat([l(x) for l in linears], -1); int8 and int4 linears stay quantized."""
    if all(isinstance(l, Int8Linear) for l in linears):
        return Int8Linear.stacked(linears)
    if all(type(l) is Int4Linear for l in linears):
        return Int4Linear.stacked(linears)
    weight = torch.cat([l.weight for l in linears], dim=0)
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    return stacked
