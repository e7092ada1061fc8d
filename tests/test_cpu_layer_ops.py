"""A decoding layer's small operations in llama_core's CPU kernels (llama_core.cpu_kernels.layer_ops), and
a whole block in one call of them: the same values as the torch operations they replace, the KV cache
written where torch writes it, and a model running them decodes as the torch path does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llama_core import cpu_kernels
from llama_core.cpu_kernels import PanelLinear, layer_ops
from llama_core.config import ModelArgs
from llama_core.kv_cache import KVCache
from llama_core.model import TransformerBlock, apply_rotary, rotary_angles
from llama_core.packed_linear import pack_linears

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here to build llama_core's CPU kernels")


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 288), (700, 100)], ids=str)
def test_rms_norm_equals_torch(shape):
    torch.manual_seed(0)
    x, weight = torch.randn(shape) * 3, torch.rand(shape[-1]) + 0.5
    torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (shape[-1],), weight, 1e-5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 768), (4, 3, 2 * 100), (600, 2 * 200)], ids=str)
def test_silu_gating_equals_torch(shape):
    torch.manual_seed(0)
    gate_up = torch.randn(shape) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_silu_gating_at_extreme_gates_equals_torch():
    """The kernel's own exp clamps its argument to [-87, 88]: gates far outside still gate as torch's do,
    and an infinite gate and NaN come out as they do there."""
    gate = torch.tensor([-1e4, -200.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 200.0, 1e4,
                         float("inf"), float("nan")])
    up = torch.linspace(-2, 2, gate.numel())
    expected = F.silu(gate) * up
    got = layer_ops.silu_mul(torch.cat([gate, up])[None])[0]
    torch.testing.assert_close(got[:-2], expected[:-2], atol=1e-6, rtol=1e-6)
    assert got[-2] == expected[-2] == float("inf") and got[-1].isnan() and expected[-1].isnan()


def _torch_decode(qkv, rotation, cache: KVCache, rows, positions, heads, kv_heads):
    """What the model's torch path does for one token per row: rotary, cache write, SDPA under the causal mask."""
    batch, head_dim = qkv.shape[0], cache.k_cache.shape[-1]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.reshape(batch, 1, heads, head_dim), rotation)
    k = apply_rotary(k.reshape(batch, 1, kv_heads, head_dim), rotation)
    v = v.reshape(batch, 1, kv_heads, head_dim)
    kv_len = int(positions.max()) + 1
    keys, values = cache.update(positions[:, None], k.transpose(1, 2), v.transpose(1, 2), rows, kv_len)
    hidden = (torch.arange(kv_len) > positions[:, None, None])[:, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(batch, heads * head_dim)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (8, 1, 64), (3, 1, 24)])
@pytest.mark.parametrize("rows", [None, slice(1, 4), torch.tensor([4, 0, 2])], ids=["none", "slice", "tensor"])
def test_decode_attention_equals_the_torch_path_and_writes_the_same_cache(heads, kv_heads, head_dim, rows):
    torch.manual_seed(0)
    batch, slots, max_seq_len = 3, 5, 40
    ours, theirs = (KVCache(slots, max_seq_len, kv_heads, head_dim, torch.float32, torch.device("cpu")) for _ in range(2))
    for cache in (ours, theirs):  # earlier positions already cached, the same in both
        torch.manual_seed(1)
        cache.k_cache.copy_(torch.randn_like(cache.k_cache))
        cache.v_cache.copy_(torch.randn_like(cache.v_cache))
    positions = torch.tensor([7, 0, 31])
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim)
    rotation = rotary_angles(positions[:, None], head_dim, 10000.0)
    version = ours.k_cache._version
    got = layer_ops.attend_new_tokens(qkv, rotation, ours.k_cache, ours.v_cache, rows, positions, heads, kv_heads)
    expected = _torch_decode(qkv, rotation, theirs, rows, positions, heads, kv_heads)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.k_cache, theirs.k_cache, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours.v_cache, theirs.v_cache)
    assert ours.k_cache._version > version  # the cache's owners see it was written


def test_decode_attention_refuses_a_position_outside_the_cache():
    cache = KVCache(2, 8, 2, 16, torch.float32, torch.device("cpu"))
    qkv, positions = torch.randn(1, 6 * 16), torch.tensor([8])
    before = cache.k_cache.clone()
    with pytest.raises(IndexError, match="outside a KV cache of 2 rows and 8 positions"):
        layer_ops.attend_new_tokens(qkv, rotary_angles(positions[:, None], 16, 1e4), cache.k_cache, cache.v_cache,
                                torch.tensor([1]), positions, 2, 2)
    assert torch.equal(cache.k_cache, before)


def test_a_model_decodes_the_same_with_its_small_operations_in_c_or_in_torch(meta_ckpt_dir, tokenizer):
    from conftest import build_llama

    llama = build_llama(meta_ckpt_dir, max_batch_size=4)
    assert llama.model.layers[0].attention.cpu_kernels  # on by default on a float32 CPU model
    assert all(layer.in_one_call for layer in llama.model.layers)  # each block in one call of them
    torch_path = build_llama(meta_ckpt_dir, max_batch_size=4)
    torch_path.model.use_cpu_kernels(False)
    prompts = [tokenizer.encode(t, bos=True, eos=False) for t in ("Once upon a time", "The king", "A")]
    tokens, logprobs = llama.generate(prompts, 12, temperature=0, logprobs=True)
    expected_tokens, expected_logprobs = torch_path.generate(prompts, 12, temperature=0, logprobs=True)
    assert tokens == expected_tokens
    for ours, theirs in zip(logprobs, expected_logprobs):
        assert ours == pytest.approx(theirs, abs=1e-4)
        assert all(math.isfinite(v) for v in ours)


def test_several_new_tokens_per_row_attend_causally_as_torch_does():
    # A short prompt's tokens (after a cached prefix of its own length in each row) in one call: each token
    # sees the cache up to its own position, including the tokens of this call before it.
    torch.manual_seed(0)
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 5
    ours, theirs = (KVCache(3, 64, kv_heads, head_dim, torch.float32, torch.device("cpu")) for _ in range(2))
    prefix = torch.randn(3, kv_heads, 64, head_dim)
    for cache in (ours, theirs):
        cache.k_cache.copy_(prefix)
        cache.v_cache.copy_(prefix.flip(-1))
    starts = torch.tensor([0, 7, 30])
    positions = starts[:, None] + torch.arange(tokens)
    qkv = torch.randn(3, tokens, (heads + 2 * kv_heads) * head_dim)
    rotation = rotary_angles(positions, head_dim, 10000.0)
    got = layer_ops.attend_new_tokens(qkv, rotation, ours.k_cache, ours.v_cache, None, positions, heads, kv_heads)

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.reshape(3, tokens, heads, head_dim), rotation).transpose(1, 2)
    k = apply_rotary(k.reshape(3, tokens, kv_heads, head_dim), rotation).transpose(1, 2)
    kv_len = int(positions.max()) + 1
    keys, values = theirs.update(positions, k, v.reshape(3, tokens, kv_heads, head_dim).transpose(1, 2), None, kv_len)
    hidden = (torch.arange(kv_len) > positions[..., None])[:, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(3 * tokens, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.k_cache, theirs.k_cache, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours.v_cache, theirs.v_cache)


def _block(seed: int) -> TransformerBlock:
    torch.manual_seed(seed)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=16)
    block = TransformerBlock(args)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    block.attention.kv_cache = KVCache(3, 32, args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    block.attention.fuse_projections()
    block.feed_forward.fuse_projections()
    pack_linears(block)
    for module in block.modules():  # as Transformer.use_cpu_kernels turns them on
        if hasattr(module, "cpu_kernels"):
            module.cpu_kernels = True
    return block


def test_a_block_in_one_call_gives_what_its_modules_give_one_by_one():
    # Two rows of three new tokens each after cached positions of their own, as a prompt riding a decode step.
    one_call, by_module = _block(0), _block(0)
    assert one_call.in_one_call
    for block in (one_call, by_module):
        torch.manual_seed(1)
        block.attention.kv_cache.k_cache.normal_()
        block.attention.kv_cache.v_cache.normal_()
    positions = torch.tensor([[4, 5, 6], [0, 1, 2]])
    rows = torch.tensor([2, 0])
    rotation = rotary_angles(positions, 16, 10000.0)
    slots = layer_ops.token_slots(layer_ops.token_rows(rows, 2, 3), positions, rotation)
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():  # as the model runs
        got = one_call(x, rotation, positions, None, rows, 7, slots=slots)
        h = x + by_module.attention(by_module.attention_norm(x), rotation, positions, None, rows, 7, slots=slots)
        expected = h + by_module.feed_forward(by_module.ffn_norm(h))
    assert torch.equal(got, expected)
    assert torch.equal(one_call.attention.kv_cache.k_cache, by_module.attention.kv_cache.k_cache)
    assert torch.equal(one_call.attention.kv_cache.v_cache, by_module.attention.kv_cache.v_cache)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=str)
def test_a_block_of_16_bit_panels_in_one_call_gives_its_float32_panels_values(stored):
    from llama_core.cpu_kernels import to_panels

    narrow, wide = _block(0), _block(0)
    for block in (narrow, wide):
        for module in block.modules():
            if isinstance(module, PanelLinear):  # weights a checkpoint stored in 16 bits holds
                module.panels = to_panels(module.weight.to(stored))
    for module in wide.modules():
        if isinstance(module, PanelLinear):
            module.panels = to_panels(module.weight)
    assert narrow.in_one_call and narrow.attention.wqkv.panels.dtype == stored
    assert wide.in_one_call and wide.attention.wqkv.panels.dtype == torch.float32
    positions, rows = torch.tensor([[3], [9]]), torch.tensor([1, 2])
    rotation = rotary_angles(positions, 16, 10000.0)
    slots = layer_ops.token_slots(layer_ops.token_rows(rows, 2, 1), positions, rotation)
    x = torch.randn(2, 1, 64)
    with torch.inference_mode():
        assert torch.equal(narrow(x, rotation, positions, None, rows, 10, slots=slots),
                           wide(x, rotation, positions, None, rows, 10, slots=slots))
    assert torch.equal(narrow.attention.kv_cache.k_cache, wide.attention.kv_cache.k_cache)
    narrow.feed_forward.w2.panels = to_panels(narrow.feed_forward.w2.weight)  # one float32 projection among them
    assert not narrow.in_one_call


def test_a_block_in_one_call_refuses_a_position_outside_the_cache_and_leaves_its_input():
    block = _block(0)
    positions = torch.tensor([[32]])
    rotation = rotary_angles(positions, 16, 10000.0)
    x = torch.randn(1, 1, 64)
    before, cache = x.clone(), block.attention.kv_cache.k_cache.clone()
    with pytest.raises(IndexError, match="outside a KV cache of 3 rows and 32 positions"), torch.inference_mode():
        block(x, rotation, positions, None, torch.tensor([1]), 33, slots=layer_ops.token_slots(layer_ops.token_rows(torch.tensor([1]), 1, 1), positions, rotation))
    assert torch.equal(x, before) and torch.equal(block.attention.kv_cache.k_cache, cache)


def test_argmax_gives_torchs_indices_ties_infinities_and_nans_included():
    torch.manual_seed(0)
    rows = [torch.randn(32000), torch.randn(2048), torch.randn(37), torch.randn(1),
            torch.tensor([1.0, 3.0, 3.0, 2.0] * 9),  # equal maxima: the first
            torch.full((40,), float("-inf")), torch.full((5,), float("inf")),
            torch.tensor([-0.0, 0.0, -1.0]), torch.tensor([0.0] * 20 + [float("nan")] + [5.0] * 30),
            torch.tensor([9.0] * 3 + [float("nan")] * 2), torch.tensor([float("nan")] * 17)]
    for row in rows:
        for batch in (row[None], torch.stack([row, row.flip(0)])):
            assert torch.equal(layer_ops.argmax(batch), torch.argmax(batch, dim=-1)), batch
    strided = torch.randn(64, 6)[:, ::2].t()  # not contiguous
    assert torch.equal(layer_ops.argmax(strided), torch.argmax(strided, dim=-1))
