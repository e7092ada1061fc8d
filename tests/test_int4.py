"""int4 weights (llama_core.int4, `quantize="int4"`): q4_0's rounding in groups of 32, the CPU kernel equal to
the exact sum of its rounded operands (with VNNI and without), the layouts round-tripping, the option through
Llama.build, the engine and a compiled step, and int4 decoding close to float32 on the embedded model."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llama_core import DEFAULT_CKPT_DIR, Llama, Tokenizer, cpu_kernels, int4
from llama_core.cpu_kernels import build
from llama_core.int4 import (GROUP, Int4Linear, Int4PanelLinear, dequantize, from_int4_panels, group_rounding,
                             pack_levels, quantize_groups, quantize_int4, to_int4_panels, unpack_levels)
from llama_core.quantize import Int8Linear, quantization_of

from conftest import build_llama, greedy_concurrently
from test_quantize import deviation

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="llama_core's CPU kernels are not used here "
                                   "(no C compiler, or neither AVX-512 nor AVX2)")
SHAPES = [(96, 64), (100, 7), (31, 34), (2304, 768)]  # whole panels and groups, and ragged ones of each
# Largest |int4 logprob - float32 logprob| over the vocabulary at every position of the embedded model's greedy
# continuations, and the share of positions where the argmax agrees (measured 1.20 and 92 %; int8: 0.34, 97 %).
EMBEDDED_MAX_DEVIATION = 1.6
EMBEDDED_ARGMAX_AGREEMENT = 0.88


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_group_is_rounded_as_q4_0_rounds_it(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-4, 2, shape[0])[:, None]
    weight[0, :5] = 0  # part of a group of zeros
    levels, scales = quantize_groups(weight)
    groups = -(-shape[1] // GROUP)
    assert levels.shape == (shape[0], groups * GROUP) and scales.shape == (shape[0], groups)
    assert levels.dtype == torch.uint8 and int(levels.max()) <= 15
    assert torch.all(levels[:, shape[1]:] == 8)  # the padding stands for zero
    restored = dequantize(levels, scales, shape[1], torch.float64)
    padded = torch.nn.functional.pad(weight.double(), (0, groups * GROUP - shape[1]))
    extreme = padded.view(shape[0], groups, GROUP).abs().amax(-1)
    # The value of largest magnitude is level 0 exactly; every other within half a step, but the far end's
    # values, which level 15 (7 steps) holds within a step.
    step = (extreme / 8).repeat_interleave(GROUP, dim=1)[:, : shape[1]]
    error = (restored - weight.double()).abs()
    assert torch.all(error <= step * 1.0001)
    assert torch.all((error <= step / 2 * 1.0001) | (restored.abs() >= 7 * step * 0.9999))
    assert torch.equal(restored.abs().view(-1).max(), weight.double().abs().max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_layouts_round_trip(shape, monkeypatch):
    weight = torch.randn(shape)
    levels, scales = quantize_groups(weight)
    assert torch.equal(unpack_levels(pack_levels(levels)), levels)
    panels, panel_scales = to_int4_panels(pack_levels(levels), scales)
    assert panels.shape == (-(-shape[0] // 32), levels.shape[1] // GROUP, GROUP // 4, 16, 4)
    back_levels, back_scales = from_int4_panels(panels, panel_scales, shape[0])
    assert torch.equal(back_levels, levels) and torch.equal(back_scales, scales)
    layer = Int4Linear(weight)
    assert torch.equal(layer.packed, pack_levels(levels)) and torch.equal(layer.scales, scales)
    in_panels = Int4PanelLinear(layer)
    assert torch.equal(in_panels.packed, layer.packed) and torch.equal(in_panels.scales, layer.scales)
    assert not dict(in_panels.state_dict())  # like PanelLinear's, the panels are not in the state dict
    # A few rows, and a few panels, at a time (as a 7B's weights are) give the same bytes.
    monkeypatch.setattr(int4, "ROUNDING_CHUNK_BYTES", 4 * 96 * 3)
    monkeypatch.setattr(int4, "PANELS_AT_A_TIME_BYTES", 1)
    in_pieces = Int4Linear(weight)
    assert torch.equal(in_pieces.packed, layer.packed) and torch.equal(in_pieces.scales, layer.scales)
    assert torch.equal(to_int4_panels(in_pieces.packed, scales)[0], panels)


def _exact(x: torch.Tensor, layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float64: each row's groups rounded to int8 levels (in float32, as linear.c
    rounds them), times the dequantized weight."""
    columns = x.shape[-1]
    groups = -(-columns // GROUP)
    padded = torch.nn.functional.pad(x, (0, groups * GROUP - columns)).view(x.shape[0], groups, GROUP)
    largest = padded.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
    levels = (padded * (1.0 / scale)).round()
    assert levels.abs().max() <= 127
    rounded = (levels.double() * scale.double()).view(x.shape[0], -1)[:, :columns]
    torch.testing.assert_close(rounded.float(), group_rounding(x))  # what the compiled step multiplies
    weight = layer.dequantized(torch.float64)
    return rounded @ weight.T, rounded.abs() @ weight.abs().T


def assert_float32_sum_of(got: torch.Tensor, exact_and_magnitude: tuple[torch.Tensor, torch.Tensor]) -> None:
    """got is the exact sum up to float32 rounding: off by at most a few float32 steps of its terms' magnitude."""
    exact, magnitude = exact_and_magnitude
    excess = (got.double() - exact).abs() - (1e-6 * magnitude + 1e-12)
    assert excess.max() <= 0, f"off by {float(excess.max()):.3g} more than float32 summation explains"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_cpu_int4_product_is_the_exact_sum_of_its_rounded_operands(rows, shape):
    torch.manual_seed(rows)
    layer = Int4Linear(torch.randn(shape))
    x = torch.randn(rows, shape[1]) * torch.logspace(-3, 3, rows)[:, None]
    got = layer(x)
    assert_float32_sum_of(got, _exact(x, layer))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(got, alone)  # a row's result never depends on the others in its forward
    assert torch.equal(Int4PanelLinear(layer)(x), got)
    assert torch.equal(layer(torch.zeros(2, shape[1])), torch.zeros(2, shape[0]))
    assert torch.equal(layer(x.view(1, rows, -1)), got.view(1, rows, -1))


@pytest.mark.skipif(build.shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.skipif(build.platform.machine() not in ("x86_64", "AMD64"), reason="an x86 build")
def test_the_int4_product_in_plain_c_is_the_same_sum(tmp_path):
    # Built for x86-64's baseline (cc's default: neither AVX2 nor VNNI), linear.c sums in plain C; the AVX2 and
    # AVX-VNNI sums are test_cpu_targets'.
    library_path = tmp_path / "linear.so"
    result = build.subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-mno-avx512vnni", str(build.SOURCES[0]), "-o",
                                   str(library_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    library = ctypes.CDLL(str(library_path))
    library.panel_linear_i4.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    torch.manual_seed(0)
    for shape in SHAPES:
        layer = Int4Linear(torch.randn(shape))
        panels, panel_scales = layer._panels_for_cpu()
        for rows in (1, 9):
            x = torch.randn(rows, shape[1])
            out = torch.empty(rows, shape[0])
            assert library.panel_linear_i4(x.data_ptr(), panels.data_ptr(), panel_scales.data_ptr(), out.data_ptr(),
                                           rows, shape[0], shape[1], 1) == 0
            assert_float32_sum_of(out, _exact(x, layer))


@pytest.mark.skipif(int4._TORCH_INT4 is None, reason="this torch has no int4 CPU kernel")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_without_llama_cores_kernels_the_cpu_product_is_torchs_int4_one(shape):
    layer = Int4Linear(torch.randn(shape))
    layer._kernel = "torch"  # what a layer settles on where the kernels are not built
    x = torch.randn(5, shape[1])
    exact = x.double() @ layer.dequantized(torch.float64).T
    got = layer(x)  # torch's kernel multiplies bfloat16 activations
    assert got.dtype == torch.float32 and float((got - exact).abs().max() / exact.abs().max()) < 1e-2
    assert layer._torch_packed[0].dtype == torch.uint8  # its own packed copy was made and used


def test_without_any_int4_kernel_the_product_is_the_dequantized_one(monkeypatch):
    monkeypatch.setattr(int4, "_TORCH_INT4", None)
    layer = Int4Linear(torch.randn(96, 70))
    layer._kernel = "torch"
    x = torch.randn(5, 70)
    torch.testing.assert_close(layer(x).double(), x.double() @ layer.dequantized(torch.float64).T, atol=1e-5, rtol=1e-5)
    # Any other dtype (a GPU's bfloat16) multiplies the dequantized weight in that dtype.
    torch.testing.assert_close(layer(x.bfloat16()), x.bfloat16() @ layer.dequantized(torch.bfloat16).T)


def test_a_model_without_llama_cores_kernels_serves_int4_close_to_one_with_them(monkeypatch, meta_ckpt_dir,
                                                                                 tokenizer):
    # Each rounds the activations its own way (int8 per group of 32, or bfloat16): each as close to float32's.
    prompt = tokenizer.encode("def forward(self, x):", bos=True, eos=False)
    float32, with_kernels = build_llama(meta_ckpt_dir), build_llama(meta_ckpt_dir, quantize="int4")
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
    without = build_llama(meta_ckpt_dir, quantize="int4")
    assert without.loaded.info.quantization == "int4"
    assert not any(type(m) is Int4PanelLinear for m in without.model.modules())
    with torch.inference_mode():
        reference, ours, theirs = (torch.log_softmax(llama.model(torch.tensor([prompt]), kv_len=len(prompt))[0], -1)
                                   for llama in (float32, with_kernels, without))

    def deviation(scores):  # the expected |logprob difference| under float32's distribution, at the worst position
        return float((reference.exp() * (scores - reference).abs()).sum(-1).max())

    assert 0 < deviation(theirs) < 1.5 * deviation(ours)
    assert len(without.generate([prompt], 8, temperature=0)[0][0]) == 8


@needs_kernels
def test_stacked_layers_compute_each_ones_rows():
    parts = [Int4Linear(torch.randn(rows, 64)) for rows in (40, 24, 24)]
    x = torch.randn(3, 64)
    assert torch.equal(Int4Linear.stacked(parts)(x), torch.cat([p(x) for p in parts], dim=-1))


@needs_kernels
def test_a_state_dict_loaded_into_an_int4_layer_is_what_it_computes_with():
    first, second = Int4Linear(torch.randn(64, 64)), Int4Linear(torch.randn(64, 64))
    x = torch.randn(2, 64)
    first(x)  # panels made from its own weight
    first.load_state_dict(second.state_dict())
    assert torch.equal(first(x), second(x))


def test_quantize_int4_keeps_the_output_layer_in_int8():
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 8, bias=True))
    model.output = nn.Linear(64, 100, bias=False)
    quantize_int4(model)
    assert type(model.block[0]) is Int4Linear and type(model.output) is Int8Linear
    assert isinstance(model.block[1], nn.Linear)  # a bias stays float
    assert quantization_of(model) == "int4"
    assert type(quantize_int4(nn.Linear(64, 100, bias=False))) is Int8Linear  # the loader's output part, alone


def test_the_quantize_option_builds_int4_blocks_and_says_so(meta_ckpt_dir, tokenizer):
    llama = build_llama(meta_ckpt_dir, quantize="int4")
    info = llama.loaded.info
    assert info.quantization == "int4" and info.weights == "float32, int4 weights"
    assert not any(type(m) is nn.Linear for m in llama.model.modules())
    blocks = [m for m in llama.model.layers.modules() if isinstance(m, Int4Linear)]
    assert len(blocks) == 4 * llama.args.n_layers  # wqkv, wo, w13, w2
    if cpu_kernels.available():  # the CPU runner keeps them only in panels
        assert all(type(m) is Int4PanelLinear for m in blocks)
    assert type(llama.model.output) is not Int4Linear
    float_llama = build_llama(meta_ckpt_dir)
    assert info.parameter_count == float_llama.loaded.info.parameter_count
    assert info.weights_bytes < float_llama.loaded.info.weights_bytes


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_int4_requests_batched_in_the_engine_get_what_they_get_alone(meta_ckpt_dir, tokenizer, compile):
    llama = build_llama(meta_ckpt_dir, quantize="int4", compile=compile)
    prompts = [tokenizer.encode(text, bos=True, eos=False) for text in ("hello world", "def forward(self, x):", "a b c")]
    alone = [llama.generate([p], 10, temperature=0)[0][0] for p in prompts]
    with llama.serve() as engine:
        assert greedy_concurrently(engine, prompts, 10) == alone
    if compile and cpu_kernels.available():  # the compiled step rounds as our kernel does: the eager greedy tokens
        eager = build_llama(meta_ckpt_dir, quantize="int4")
        assert [eager.generate([p], 10, temperature=0)[0][0] for p in prompts] == alone


@pytest.mark.skipif(not (DEFAULT_CKPT_DIR / "consolidated.00.pth").is_file(), reason="the embedded model is absent")
def test_int4_stays_close_to_float32_on_the_embedded_model():
    vocab = Tokenizer(DEFAULT_CKPT_DIR / "tokenizer.model")
    prompts = [vocab.encode(text, bos=True, eos=False) for text in ("ROMEO:", "To be, or not", "The king")]
    worst, agreement = deviation(None, prompts, "int4")
    int8_worst, _ = deviation(None, prompts, "int8")
    assert int8_worst < worst < EMBEDDED_MAX_DEVIATION  # coarser than int8, and still close
    assert agreement >= EMBEDDED_ARGMAX_AGREEMENT


def test_int4_weights_take_what_the_memory_plan_says():
    llama = Llama.build(None, max_seq_len=128, max_batch_size=1, device="cpu", quantize="int4")
    layers = [m for m in llama.model.modules() if isinstance(m, Int4Linear)]
    held = sum(t.nbytes for m in layers for t in m.buffers())
    weights = sum(m.in_features * m.out_features for m in layers)
    assert held <= 1.15 * weights * (0.5 + 4 / GROUP)  # 4 bits and a float32 scale per 32 weights, panels padded


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(out_features=st.integers(1, 80), in_features=st.integers(1, 200), rows=st.integers(1, 19),
       seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_any_shape_gives_the_exact_sum_of_its_rounded_operands(out_features, in_features, rows, seed, spread):
    # Ragged groups, panels and row tiles in every combination.
    torch.manual_seed(seed)
    layer = Int4Linear(torch.randn(out_features, in_features) * spread)
    x = torch.randn(rows, in_features) / spread
    assert_float32_sum_of(layer(x), _exact(x, layer))
    assert torch.equal(layer(x[-1:]), layer(x)[-1:])
