"""llama_core's own CPU kernels (llama_core.cpu_kernels): built on first use, the same products as F.linear
in float32 and int8 at every row count and odd shape, the panel layout round-trips, and without a compiler
everything falls back to torch's products with one warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llama_core import cpu_kernels
from llama_core.cpu_kernels import (PANEL, PanelLinear, build, exact_storage, from_int8_panels, from_panels,
                                    panel_product, to_int8_panels, to_panels)
from llama_core.packed_linear import pack_linears

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="llama_core's CPU kernels are not used here (no C compiler, or neither AVX-512 nor AVX2)")


@pytest.fixture
def kernels_turned_on(monkeypatch):
    """The build tests run as on a machine where nobody turned the kernels off (LLAMA_CORE_CPU_KERNELS)."""
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)


@pytest.mark.parametrize("shape", [(64, 32), (100, 7), (33, 1), (1, 40), (2048, 192)], ids=str)
def test_panels_round_trip_the_weight(shape):
    weight = torch.randn(shape)
    panels = to_panels(weight)
    assert panels.shape == (-(-shape[0] // PANEL), shape[1], PANEL)
    assert torch.equal(from_panels(panels, shape[0]), weight)
    assert (panels.transpose(1, 2).reshape(-1, shape[1])[shape[0]:] == 0).all()  # padding rows are zero


@pytest.mark.parametrize("shape", [(64, 32), (100, 7), (33, 1), (1, 42)], ids=str)
def test_int8_panels_round_trip_the_weight_and_sum_its_rows(shape):
    weight = torch.randint(-127, 128, shape, dtype=torch.int8)
    panels, sums = to_int8_panels(weight)
    assert panels.shape == (-(-shape[0] // PANEL), -(-shape[1] // 4), PANEL, 4) and panels.dtype == torch.int8
    assert torch.equal(from_int8_panels(panels, *shape), weight)
    assert sums.dtype == torch.int32 and sums.shape == (panels.shape[0] * PANEL,)
    assert torch.equal(sums[:shape[0]], weight.sum(dim=1, dtype=torch.int32)) and not sums[shape[0]:].any()


def test_a_large_weight_is_copied_exactly_into_huge_page_memory():
    weight = torch.randn(1100, 1000)  # > 2 MiB: its panels are an mmap advised into huge pages
    assert torch.equal(PanelLinear(weight).weight, weight)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 33, 128])
@pytest.mark.parametrize("shape", [(96, 64), (100, 7), (31, 33), (2304, 768)], ids=str)
def test_float32_product_equals_f_linear(rows, shape):
    torch.manual_seed(rows)
    weight = torch.randn(shape)
    x = torch.randn(rows, shape[1])
    got = PanelLinear(weight)(x)
    assert got.shape == (rows, shape[0]) and got.is_contiguous()
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), atol=1e-4, rtol=1e-4)


def test_exact_storage_is_the_narrowest_dtype_holding_every_value():
    torch.manual_seed(0)
    weight = torch.randn(64, 48)
    assert exact_storage(weight) == torch.float32
    assert exact_storage(weight.bfloat16().float()) == torch.bfloat16  # Meta's checkpoints
    assert exact_storage(weight.half().float()) == torch.float16  # Hugging Face's: more mantissa than bfloat16
    wide = (weight * 1e6).bfloat16().float()  # beyond float16's range
    assert exact_storage(wide) == torch.bfloat16
    assert exact_storage(torch.cat([weight.half().float(), wide])) == torch.float32  # neither holds both


@needs_kernels
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33])
@pytest.mark.parametrize("shape", [(96, 64), (100, 7), (31, 33), (2304, 768)], ids=str)
def test_16_bit_panels_give_the_float32_panels_products_bit_for_bit(stored, rows, shape):
    torch.manual_seed(rows)
    weight = torch.randn(shape).to(stored).float()
    if stored == torch.float16:
        weight[0, :3] = torch.tensor([6e-8, -3e-5, 0.0]).half().float()  # subnormal float16 values widen exactly too
    layer = PanelLinear(weight)
    assert layer.panels.dtype == stored and torch.equal(layer.weight, weight)
    x = torch.randn(rows, shape[1])
    expected = panel_product(x, to_panels(weight), *shape)  # the same values in float32 panels
    assert torch.equal(layer(x), expected)
    assert layer.panels.nbytes * 2 == to_panels(weight).nbytes


@pytest.mark.skipif(build.shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.skipif(build.platform.machine() not in ("x86_64", "AMD64"), reason="F16C and AVX-512 are x86 flags")
def test_float16_panels_widen_exactly_without_f16c(tmp_path):
    # -march=native on a CPU with F16C or AVX-512 converts in hardware; elsewhere linear.c widens in C.
    import ctypes

    library_path = tmp_path / "linear.so"
    result = build.subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-mno-f16c", "-mno-avx512f",
                                   str(build.SOURCES[0]), "-o", str(library_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    library = ctypes.CDLL(str(library_path))
    library.panel_linear_f16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = halves[torch.isfinite(halves)]  # every finite float16 (63,488): normal, subnormal, both zeros
    weight = finite.view(-1, 32).T.contiguous()  # [32, 1984]: one panel
    panels, x, out = to_panels(weight), torch.zeros(1, weight.shape[1]), torch.empty(1, 32)
    for k in range(weight.shape[1]):  # a one-hot row reads column k back through the widening
        x.zero_()
        x[0, k] = 1.0
        library.panel_linear_f16(x.data_ptr(), panels.data_ptr(), None, out.data_ptr(), 1, 32, weight.shape[1], 1)
        assert torch.equal(out[0], weight[:, k].float()), k


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 33])
@pytest.mark.parametrize("shape", [(96, 64), (100, 7), (31, 34), (2304, 768)], ids=str)
def test_int8_product_is_the_exact_sum_of_each_row_rounded_on_its_own_scale(rows, shape):
    torch.manual_seed(rows)
    weight = torch.randint(-127, 128, shape, dtype=torch.int8)
    scales = torch.rand(shape[0]) * 0.01
    x = torch.randn(rows, shape[1]) * torch.logspace(-3, 3, rows)[:, None]
    panels, sums = to_int8_panels(weight)
    padded_scales = torch.zeros(sums.shape[0])
    padded_scales[:shape[0]] = scales
    got = panel_product(x, panels, shape[0], shape[1], padded_scales, sums)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    levels = torch.round(x / step)
    assert levels.abs().max() <= 127
    expected = (levels.double() @ weight.double().T) * step.double() * scales.double()
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=1e-5)
    alone = torch.cat([panel_product(x[i : i + 1], panels, shape[0], shape[1], padded_scales, sums) for i in range(rows)])
    assert torch.equal(got, alone)
    zeros = panel_product(torch.zeros(2, shape[1]), panels, shape[0], shape[1], padded_scales, sums)
    assert torch.equal(zeros, torch.zeros(2, shape[0]))


@needs_kernels
def test_batched_and_strided_inputs():
    torch.manual_seed(0)
    weight = torch.randn(200, 96)
    layer = PanelLinear(weight)
    x = torch.randn(3, 5, 96)
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-4, rtol=1e-4)
    strided = torch.randn(96, 6).t()  # not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight), atol=1e-4, rtol=1e-4)


@needs_kernels
def test_a_row_gets_the_same_result_alone_and_in_a_batch():
    # Each row's sums run in the same order whatever tile it falls in: batching changes no output.
    torch.manual_seed(0)
    layer = PanelLinear(torch.randn(512, 256))
    rows = torch.randn(19, 256)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(19)])
    assert torch.equal(layer(rows), alone)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_product(threads):
    torch.manual_seed(0)
    layer, x = PanelLinear(torch.randn(300, 128)), torch.randn(5, 128)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), one)  # panels are split between threads, never the sums
    finally:
        torch.set_num_threads(previous)


def test_inputs_the_kernel_does_not_take_still_get_the_right_product():
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    layer = PanelLinear(weight)
    x = torch.randn(3, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.double()))
    wanting_grad = torch.randn(3, 24, requires_grad=True)
    layer(wanting_grad).sum().backward()
    torch.testing.assert_close(wanting_grad.grad, weight.sum(0).expand(3, 24))


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 CPU weight, got torch.float64"):
        PanelLinear(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        PanelLinear(torch.randn(4))


@needs_kernels
def test_pack_linears_puts_every_float32_bias_free_linear_in_panels():
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=True),
                          nn.Linear(4, 4, bias=False), nn.Linear(64, 64, bias=False).double(),
                          nn.Linear(64, 64, bias=False).bfloat16())  # a projection loaded as stored
    stored = model[4].weight.detach().clone()
    assert pack_linears(model) == 2 and type(model[4]) is nn.Linear  # in a bfloat16 model it stays as it is
    assert pack_linears(model, float32_model=True) == 1
    assert [type(m) for m in model] == [PanelLinear, nn.Linear, PanelLinear, nn.Linear, PanelLinear]
    assert model[4].panels.dtype == torch.bfloat16 and torch.equal(model[4].weight, stored.float())


def test_without_a_compiler_products_fall_back_with_one_warning(monkeypatch, tmp_path, kernels_turned_on):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="no C compiler .* found"):
        assert build.load() is None
    assert build.load() is None  # found missing once: no second warning (pytest would fail on an error)
    model = nn.Sequential(nn.Linear(600, 600, bias=False))
    weight = model[0].weight.detach().clone()
    pack_linears(model)
    assert not isinstance(model[0], PanelLinear)
    x = torch.randn(2, 600)
    torch.testing.assert_close(model(x), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_a_compiler_that_fails_falls_back_with_its_error(monkeypatch, tmp_path, kernels_turned_on):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: fatal error: something broke' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setenv("LLAMA_CORE_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="could not build the CPU kernels .*something broke"):
        assert build.load() is None


def test_the_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    model = nn.Sequential(nn.Linear(1024, 512, bias=False))
    pack_linears(model)
    assert not isinstance(model[0], PanelLinear)


@needs_kernels
def test_the_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CORE_CACHE", str(tmp_path))
    (tmp_path / "tmp").mkdir()  # the fallback directory too: one built there before would be loaded instead
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load() is not None
    built = list((tmp_path / "kernels").glob("kernels-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(build, "_loaded", {})
    stamp = built[0].stat().st_mtime_ns
    assert build.load() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert not [p for p in (tmp_path / "kernels").iterdir() if p != built[0]]  # no partial file left


@needs_kernels
def test_a_build_says_so_in_one_logged_line_and_a_load_from_the_cache_says_nothing(monkeypatch, tmp_path, capsys,
                                                                                   caplog):
    """The line is logged at WARNING (shown on stderr where nothing set logging up: tests/test_command_line's
    llama-generate tests see it there), so a command line can silence it (llama-generate -q)."""
    monkeypatch.setenv("LLAMA_CORE_CACHE", str(tmp_path))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setattr(build, "_loaded", {})
    caplog.set_level(logging.WARNING, logger="llama_core")
    assert build.load() is not None
    kept = tmp_path / "kernels"
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("llama_core.cpu_kernels.build", logging.WARNING,
         f"llama_core: compiling its CPU kernels for this machine (once; kept in {kept})")]
    assert capsys.readouterr() == ("", "")  # the line alone: no print beside it
    caplog.clear()
    monkeypatch.setattr(build, "_loaded", {})  # a new process: the library is in the cache
    assert build.load() is not None
    assert caplog.records == [] and capsys.readouterr() == ("", "")


@needs_kernels
def test_a_cache_that_cannot_be_written_falls_back_to_a_temporary_directory(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LLAMA_CORE_CACHE", str(tmp_path / "a-file" / "cache"))  # no directory can be made there
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load() is not None
    assert len(list((tmp_path / "tmp").glob("llama_core-kernels-*/kernels-*.so"))) == 1


@needs_kernels
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=str)
def test_a_checkpoint_stored_in_16_bits_serves_from_16_bit_panels_with_float32_panels_results(
        tmp_path, tiny_args, tiny_state_dict, tokenizer_path, tokenizer, stored):
    from conftest import build_llama, write_meta_checkpoint

    state = {name: t.to(stored) for name, t in tiny_state_dict.items()}  # as Llama-2's checkpoints come
    llama = build_llama(write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [state], tokenizer_path))
    projections = [m for m in llama.model.modules() if isinstance(m, PanelLinear)]
    assert len(projections) == 4 * tiny_args.n_layers + 1 and all(m.panels.dtype == stored for m in projections)
    assert all(block.in_one_call for block in llama.model.layers)
    assert llama.loaded.info.weights == f"float32, {str(stored).removeprefix('torch.')} weights"  # start-up line, Model tab
    float32_model = build_llama(write_meta_checkpoint(tmp_path / "float32", tiny_args, [tiny_state_dict], tokenizer_path))
    projection_bytes = 4 * sum(m.panels.numel() for m in projections)
    assert llama.loaded.info.weights_bytes == float32_model.loaded.info.weights_bytes - projection_bytes // 2
    wide = build_llama(write_meta_checkpoint(tmp_path / "same", tiny_args, [state], tokenizer_path))
    for module in wide.model.modules():
        if isinstance(module, PanelLinear):
            module.panels = to_panels(module.weight)  # the same values in float32 panels, as before 16-bit ones
    prompts = [tokenizer.encode(t, bos=True, eos=False) for t in ("Once upon a time", "The king", "A")]
    tokens, logprobs = llama.generate(prompts, 10, temperature=0, logprobs=True)
    expected_tokens, expected_logprobs = wide.generate(prompts, 10, temperature=0, logprobs=True)
    assert tokens == expected_tokens and logprobs == expected_logprobs


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_16_bit_checkpoint_loads_a_block_at_a_time_as_stored_into_its_panels(tmp_path, tiny_args, tiny_state_dict,
                                                                                tokenizer_path, monkeypatch, dtype):
    from conftest import build_llama, write_meta_checkpoint
    from llama_core import checkpoint, loader
    from llama_core.runner import cpu_serving_layout

    state = {name: t.to(torch.bfloat16) for name, t in tiny_state_dict.items()}
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [state], tokenizer_path)
    built, unpacked_blocks, projection_dtypes = [], [], set()

    class Recorded(checkpoint.Transformer):
        def __init__(self, args):
            super().__init__(args)
            built.append(self)

    def laid_out(part, float32_model=True):
        linears = [m for block in built[0].layers for m in block.modules()
                   if type(m) is nn.Linear and m.weight.device.type != "meta"]
        projection_dtypes.update(m.weight.dtype for m in linears)
        unpacked_blocks.append(sum(any(m in linears for m in block.modules()) for block in built[0].layers))
        return cpu_serving_layout(part, float32_model)

    monkeypatch.setattr(checkpoint, "Transformer", Recorded)
    monkeypatch.setattr(loader, "cpu_serving_layout", laid_out)
    llama = build_llama(ckpt, dtype=dtype)
    assert len(unpacked_blocks) == tiny_args.n_layers + 3
    if dtype == "float32":  # each block in panels before the next is read
        assert max(unpacked_blocks) == 1
    # As stored: never cast to float32 on the way to the panels (a float32 model); a bfloat16 model's own.
    assert projection_dtypes == {torch.bfloat16}
    panels = all(isinstance(block.attention.wqkv, PanelLinear) for block in llama.model.layers)
    assert panels == (dtype == "float32")  # a bfloat16 model runs torch's bfloat16 products, as before


def test_whether_the_kernels_will_run_is_known_without_building_them(monkeypatch, kernels_turned_on):
    # A process that only plans memory (the command line's, before the model's process starts) asks this.
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.delenv(build.TARGET_VARIABLE, raising=False)
    flags = set(build._cpu_features().split())
    vectors = "avx512f" in flags or {"avx2", "fma"} <= flags
    assert build.expected() == (build.shutil.which("cc") is not None and vectors)
    assert build._loaded == {}  # nothing was built or loaded
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not build.expected()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
    assert not build.expected()
    monkeypatch.delenv("LLAMA_CORE_CPU_KERNELS")
    monkeypatch.setattr(build, "_loaded", {("cc", "native"): None})  # built and left unused
    assert not build.expected()
