"""oneDNN-packed projections on the CPU: the same products as F.linear, whatever the rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llama_core import packed_linear
from llama_core.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not packed_linear.packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("shape", [(1, 96), (8, 96), (33, 96), (1, 1, 96), (4, 7, 96)])
def test_product_equals_f_linear(shape):
    torch.manual_seed(0)
    weight = torch.randn(200, 96)
    x = torch.randn(*shape)
    torch.testing.assert_close(PackedLinear(weight)(x), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_a_row_gets_the_same_result_alone_and_in_a_batch():
    torch.manual_seed(0)
    layer = PackedLinear(torch.randn(512, 256))
    rows = torch.randn(16, 256)
    together = layer(rows)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(16)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_weight_gives_the_plain_values_back():
    weight = torch.randn(64, 32)
    layer = PackedLinear(weight)
    assert torch.equal(layer.weight, weight)
    assert (layer.out_features, layer.in_features) == (64, 32)


def test_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(torch.randn(4, 4, dtype=torch.float64))


def test_pack_linears_replaces_large_float32_bias_free_linears_only(monkeypatch):
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")  # oneDNN's layout is what pack_linears falls back to
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=True),
                          nn.Linear(4, 4, bias=False), nn.Linear(64, 64, bias=False).double())
    assert pack_linears(model, min_weights=1000) == 1
    assert isinstance(model[0], PackedLinear)
    assert [type(m) for m in model[1:]] == [nn.Linear] * 3


def test_packed_projections_quantize_to_int8_like_plain_ones():
    from llama_core.quantize import Int8Linear, quantize_int8

    torch.manual_seed(0)
    weight = torch.randn(300, 1000)
    packed, plain = nn.Sequential(PackedLinear(weight)), nn.Sequential(nn.Linear(1000, 300, bias=False))
    plain[0].weight.data.copy_(weight)
    quantize_int8(packed), quantize_int8(plain)
    assert isinstance(packed[0], Int8Linear)
    assert torch.equal(packed[0].weight, plain[0].weight) and torch.equal(packed[0].scales, plain[0].scales)


def test_unpacking_gives_plain_linears_with_the_same_weights():
    from llama_core.packed_linear import unpack_linears

    weight = torch.randn(400, 1000)
    model = nn.Sequential(PackedLinear(weight))
    assert unpack_linears(model) == 1
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, weight)


def test_a_compiled_decode_step_unpacks_a_packed_model(meta_ckpt_dir, tokenizer, monkeypatch):
    import shutil

    from conftest import build_llama
    from llama_core.runner import DecodeStep

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHTS", 0)
    llama = build_llama(meta_ckpt_dir, max_batch_size=3)
    prompts = [tokenizer.encode(t, bos=True, eos=False) for t in ("Once upon a time", "The king")]
    expected = llama.generate(prompts, 8, temperature=0)[0]
    llama.runner.decode_step = DecodeStep(llama.model, 3, compile=True, static=True)
    from llama_core.cpu_kernels import PanelLinear

    assert not any(isinstance(m, (PackedLinear, PanelLinear)) for m in llama.model.modules())
    assert llama.generate(prompts, 8, temperature=0)[0] == expected
