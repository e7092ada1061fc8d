"""A decoding layer's small operations in llama_core's CPU kernels (llama_core.cpu_kernels.layer_ops), and
a whole block in one call of them: the same values as the torch operations they replace, the KV cache
written where torch writes it, and a model running them decodes as the torch path does."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from llama_core import cpu_kernels
from llama_core.cpu_kernels import PanelLinear, layer_ops
from llama_core.config import ModelArgs
from llama_core.kv_cache import KVCache
from llama_core.model import TransformerBlock, apply_rotary, rotary_angles
from llama_core.int4 import Int4PanelLinear, keep_int4_in_panels, quantize_int4
from llama_core.packed_linear import pack_linears
from llama_core.quantize import Int8PanelLinear, keep_int8_in_panels, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="llama_core's CPU kernels are not used here (no C compiler, or neither AVX-512 nor AVX2)")


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
    and an infinite gate and NaN come out as they do there. Five times over, so that each value is taken in
    a vector of every target's width, at several lanes, and in the scalar tail."""
    extremes = torch.tensor([-1e4, -200.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 200.0, 1e4,
                             float("inf"), float("nan")])
    gate = extremes.repeat(5)
    up = torch.linspace(-2, 2, gate.numel())
    expected = F.silu(gate) * up
    got = layer_ops.silu_mul(torch.cat([gate, up])[None])[0]
    finite, infinite = torch.isfinite(gate), torch.isinf(gate)
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[infinite], expected[infinite]) and expected[infinite].isinf().all()
    assert got[gate.isnan()].isnan().all()


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


def _block(seed: int, quantize: Optional[str] = None) -> TransformerBlock:
    torch.manual_seed(seed)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=16)
    block = TransformerBlock(args)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    block.attention.kv_cache = KVCache(3, 32, args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    if quantize is not None:  # as the loader quantizes a block, and the runner lays it out
        {"int8": quantize_int8, "int4": quantize_int4}[quantize](block)
    block.attention.fuse_projections()
    block.feed_forward.fuse_projections()
    pack_linears(block)
    keep_int8_in_panels(block)
    keep_int4_in_panels(block)
    for module in block.modules():  # as Transformer.use_cpu_kernels turns them on
        if hasattr(module, "cpu_kernels"):
            module.cpu_kernels = True
    return block


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_block_in_one_call_gives_what_its_modules_give_one_by_one(quantize):
    # Two rows of three new tokens each after cached positions of their own, as a prompt riding a decode step.
    one_call, by_module = _block(0, quantize), _block(0, quantize)
    assert one_call.in_one_call
    if quantize is not None:
        assert type(one_call.attention.wqkv) is {"int8": Int8PanelLinear, "int4": Int4PanelLinear}[quantize]
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
    if quantize is not None:  # kinds mixed: module by module
        one_call.feed_forward.w2 = PanelLinear(one_call.feed_forward.w2.dequantized().float())
        assert not one_call.in_one_call


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


# -- 16-bit KV caches ----------------------------------------------------------------------------------------
SIXTEEN_BITS = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (8, 2, 128), (3, 1, 24)])
def test_a_16_bit_cache_attends_as_a_float32_cache_holding_the_same_values(dtype, heads, kv_heads, head_dim):
    """The kernels widen a 16-bit cache exactly and then run float32's arithmetic in float32's order, so
    attending over it gives, bit for bit, what a float32 cache of the same (rounded) values gives. The new
    tokens' queries, keys and values are 16-bit values and their rotation is the identity, so both caches
    receive them unrounded."""
    torch.manual_seed(0)
    slots, max_seq_len = 3, 300
    narrow = KVCache(slots, max_seq_len, kv_heads, head_dim, dtype, torch.device("cpu"))
    wide = KVCache(slots, max_seq_len, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    narrow.k_cache.copy_(torch.randn(narrow.k_cache.shape) * 3)
    narrow.v_cache.copy_(torch.randn(narrow.v_cache.shape))
    wide.k_cache.copy_(narrow.k_cache)
    wide.v_cache.copy_(narrow.v_cache)
    positions = torch.tensor([299, 0, 130])
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim).to(dtype).float()
    identity = torch.stack([torch.ones(head_dim // 2), torch.zeros(head_dim // 2)], dim=-1).expand(3, -1, -1)
    got = layer_ops.attend_new_tokens(qkv, identity, narrow.k_cache, narrow.v_cache, None, positions, heads, kv_heads)
    expected = layer_ops.attend_new_tokens(qkv, identity, wide.k_cache, wide.v_cache, None, positions, heads, kv_heads)
    assert torch.equal(got, expected)
    assert torch.equal(narrow.k_cache.float(), wide.k_cache) and torch.equal(narrow.v_cache.float(), wide.v_cache)


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=str)
def test_a_16_bit_cache_is_written_as_torch_rounds_and_attends_as_torch_does(dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, slots, max_seq_len = 6, 2, 32, 4, 40
    ours, theirs = (KVCache(slots, max_seq_len, kv_heads, head_dim, dtype, torch.device("cpu")) for _ in range(2))
    for cache in (ours, theirs):
        torch.manual_seed(1)
        cache.k_cache.copy_(torch.randn(cache.k_cache.shape))
        cache.v_cache.copy_(torch.randn(cache.v_cache.shape))
    positions, rows = torch.tensor([7, 0, 39]), torch.tensor([3, 0, 2])
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim) * 5
    rotation = rotary_angles(positions[:, None], head_dim, 10000.0)
    got = layer_ops.attend_new_tokens(qkv, rotation, ours.k_cache, ours.v_cache, rows, positions, heads, kv_heads)
    expected = _torch_decode(qkv, rotation, theirs, rows, positions, heads, kv_heads)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.v_cache, theirs.v_cache)  # values are written unchanged, then rounded: as torch rounds
    # keys are rotated first (in C and torch, a rounding apart in float32), then rounded to 16 bits
    assert (ours.k_cache.float() - theirs.k_cache.float()).abs().max() <= theirs.k_cache.float().abs().max() * 2**-7


@pytest.mark.skipif(cpu_kernels.build.shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.skipif(cpu_kernels.build.platform.machine() not in ("x86_64", "AMD64"), reason="F16C and AVX-512 are x86 flags")
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=str)
def test_16_bit_cache_writes_round_as_torch_does_without_f16c(tmp_path, dtype):
    """Where the CPU has no F16C, widen.h rounds to float16 in C (and bfloat16 always): every kind of float32
    value, ties, subnormals, overflow and infinities included, lands in the cache as torch rounds it, and NaN
    stays NaN."""
    import ctypes

    from llama_core.cpu_kernels import build

    library_path = tmp_path / "layer.so"
    layer_c = next(path for path in build.SOURCES if path.name == "layer.c")
    result = build.subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-mno-f16c", "-mno-avx512f", str(layer_c),
                                   "-o", str(library_path), "-lm"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    library = ctypes.CDLL(str(library_path))
    size, pointer = ctypes.c_int64, ctypes.c_void_p
    library.attend_new_tokens.argtypes = [pointer, size, pointer, ctypes.c_int, pointer, pointer, pointer, pointer,
                                          size, size, size, size, size, size, pointer, ctypes.c_int]
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64, generator=generator).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, float("inf"), -float("inf"), float("nan"),
                             2**-24, 2**-25, 3 * 2**-26, 2**-14 - 2**-25, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8,
                             1 + 3 * 2**-8, 3.0e38, 1e-45])
    values = torch.cat([bits.view(torch.float32), specials, -specials])
    head_dim = 16
    values = torch.cat([values, torch.zeros(-values.numel() % head_dim)]).view(-1, head_dim)
    count = values.shape[0]
    qkv = torch.cat([torch.zeros(count, head_dim), torch.zeros(count, head_dim), values], dim=1)  # q, k, v
    rotation = torch.stack([torch.ones(head_dim // 2), torch.zeros(head_dim // 2)], dim=-1).expand(count, -1, -1).contiguous()
    k_cache, v_cache = (torch.zeros(1, 1, count, head_dim, dtype=dtype) for _ in range(2))
    rows, positions = torch.zeros(count, dtype=torch.int64), torch.arange(count)
    out = torch.empty(count, head_dim)
    kind = layer_ops.cache_kind(k_cache, v_cache)
    status = library.attend_new_tokens(qkv.data_ptr(), qkv.stride(0), rotation.data_ptr(), kind, k_cache.data_ptr(),
                                       v_cache.data_ptr(), rows.data_ptr(), positions.data_ptr(), count, 1, 1,
                                       head_dim, 1, count, out.data_ptr(), 1)
    assert status == 0
    expected, nan = values.to(dtype), values.isnan()
    assert torch.equal(v_cache[0, 0][~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert v_cache[0, 0][nan].isnan().all()  # torch's own NaN bits differ between its scalar and vector paths


def test_a_model_with_a_16_bit_cache_decodes_the_same_in_c_and_in_torch(meta_ckpt_dir, tokenizer):
    """Prompts longer than the C kernels' attention take (written into the cache by torch), decoding in C: the
    tokens and log-probabilities of the torch path over the same float16 cache."""
    from conftest import build_llama

    from llama_core.model import C_ATTENTION_MAX_TOKENS

    llama = build_llama(meta_ckpt_dir, max_batch_size=3, kv_cache_dtype="float16")
    torch_path = build_llama(meta_ckpt_dir, max_batch_size=3, kv_cache_dtype="float16")
    torch_path.model.use_cpu_kernels(False)
    assert llama.model.layers[0].attention.kv_cache.k_cache.dtype == torch.float16
    long = tokenizer.encode("Once upon a time there was a king", bos=True, eos=False) * 12
    long = long[: C_ATTENTION_MAX_TOKENS + 20]
    assert len(long) > C_ATTENTION_MAX_TOKENS
    prompts = [long, tokenizer.encode("The king", bos=True, eos=False)]
    tokens, logprobs = llama.generate(prompts, 12, temperature=0, logprobs=True)
    expected_tokens, expected_logprobs = torch_path.generate(prompts, 12, temperature=0, logprobs=True)
    assert tokens == expected_tokens
    # C and torch rotate a key a float32 rounding apart, which now and then rounds to neighbouring 16-bit values
    for ours, theirs in zip(logprobs, expected_logprobs):
        assert ours == pytest.approx(theirs, abs=1e-3)

