"""The KV cache: rows addressed by index tensor or by slice hold and return the same keys and values."""

from __future__ import annotations

import pytest
import torch

from llama_core.kv_cache import KVCache


def _filled(seed: int) -> tuple[KVCache, torch.Generator]:
    cache = KVCache(max_batch_size=5, max_seq_len=16, n_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))
    return cache, gen


def test_slice_rows_write_and_read_like_index_rows():
    by_index, gen = _filled(0)
    by_slice, _ = _filled(0)
    positions = torch.tensor([[3, 4], [7, 8]])  # two rows, two new tokens each, at different positions
    k = torch.randn(2, 2, 2, 4, generator=gen)
    v = torch.randn(2, 2, 2, 4, generator=gen)
    k1, v1 = by_index.update(positions, k, v, torch.tensor([2, 3]), kv_len=9)
    k2, v2 = by_slice.update(positions, k, v, slice(2, 4), kv_len=9)
    assert k1.shape == k2.shape == (2, 2, 9, 4)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(by_index.k_cache, by_slice.k_cache) and torch.equal(by_index.v_cache, by_slice.v_cache)
    # The new entries landed in rows 2 and 3 at their own positions; nothing else changed.
    assert torch.equal(by_slice.k_cache[3, :, 7:9], k[1])
    untouched, _ = _filled(0)
    changed = (by_slice.k_cache != untouched.k_cache).any(dim=(1, 3))
    expected = torch.zeros(5, 16, dtype=torch.bool)
    expected[2, 3:5] = expected[3, 7:9] = True
    assert torch.equal(changed, expected)


def test_no_rows_means_the_first_rows():
    cache, gen = _filled(1)
    other, _ = _filled(1)
    positions = torch.tensor([[5], [6]])
    k, v = torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen)
    got = cache.update(positions, k, v)
    want = other.update(positions, k, v, torch.tensor([0, 1]))
    assert got[0].shape == (2, 2, 16, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_16_bit_cache_rounds_what_it_is_given_and_returns_it_in_the_callers_dtype():
    for dtype in (torch.float16, torch.bfloat16):
        cache = KVCache(max_batch_size=2, max_seq_len=8, n_kv_heads=2, head_dim=4, dtype=dtype, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        k, v = torch.randn(2, 2, 3, 4, generator=gen), torch.randn(2, 2, 3, 4, generator=gen)
        positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
        for rows in (None, torch.tensor([0, 1])):
            keys, values = cache.update(positions, k, v, rows, kv_len=7)
            assert cache.k_cache.dtype == dtype and keys.dtype == values.dtype == torch.float32
            assert torch.equal(keys[1, :, 4:7], k[1].to(dtype).float()) and torch.equal(values[0, :, :3], v[0].to(dtype).float())
            assert not torch.equal(keys[1, :, 4:7], k[1])  # rounded, not kept in float32


def test_a_16_bit_cache_holds_half_the_bytes_and_stays_close_to_float32(meta_ckpt_dir, tokenizer):
    from conftest import build_llama

    from llama_core.errors import InvalidRequestError

    wide, narrow = build_llama(meta_ckpt_dir), build_llama(meta_ckpt_dir, kv_cache_dtype="float16")
    assert narrow.loaded.info.kv_cache_dtype == "float16" and wide.loaded.info.kv_cache_dtype is None
    assert narrow.loaded.info.kv_cache_bytes * 2 == wide.loaded.info.kv_cache_bytes
    prompt = [tokenizer.encode("The king and the queen", bos=True, eos=False)]
    tokens, logprobs = wide.generate(prompt, 24, temperature=0, logprobs=True)
    narrow_tokens, narrow_logprobs = narrow.generate(prompt, 24, temperature=0, logprobs=True)
    assert narrow_tokens == tokens
    assert max(abs(a - b) for a, b in zip(logprobs[0], narrow_logprobs[0])) < 0.02
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'int8'"):
        build_llama(meta_ckpt_dir, kv_cache_dtype="int8")
