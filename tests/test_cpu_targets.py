"""The CPU kernels built for x86 targets other than this machine's: AVX2 (with and without AVX-VNNI) and AVX-512
without VNNI give the native build's products and layer operations bit for bit, since every output sums in the
same order on every target; a model served by an AVX2 build decodes to the native build's tokens and
log-probabilities; a target with neither AVX2 nor AVX-512, or one the compiler does not know, is left unused
with one warning; and the Model tab's words for what the products run on. Each target runs here only where
this CPU can run its instructions."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from llama_core import cpu_kernels
from llama_core.cpu_kernels import build, panels
from llama_core.int4 import Int4Linear
from llama_core.quantize import Int8Linear

from conftest import build_llama

CPU_FLAGS = set(build._cpu_features().split())
AVX2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}  # what -march=haswell code may use
TILE_ROWS = {"avx2": (3, 2), "avx2 with avx-vnni": (3, 2), "avx-512 without vnni": (8, 2)}  # 16-bit panels, int8 and int4
INSTRUCTIONS = {"avx2": "AVX2", "avx2 with avx-vnni": "AVX2 with AVX-VNNI", "avx-512 without vnni": "AVX-512"}
TARGETS = {  # name: (the compiler's flags, the CPU flags its code needs)
    "avx2": (("-march=haswell",), AVX2),
    "avx2 with avx-vnni": (("-march=haswell", "-mavxvnni"), AVX2 | {"avx_vnni"}),
    "avx-512 without vnni": (("-march=skylake-avx512",), AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl",
                                                                 "avx512cd"}),
}

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="llama_core's CPU kernels are not used here (no C compiler, or neither "
                                          "AVX-512 nor AVX2)")
needs_x86_compiler = pytest.mark.skipif(shutil.which("cc") is None or build.platform.machine() not in ("x86_64", "AMD64"),
                                        reason="needs a C compiler and an x86 CPU")


def building_for(target: str, monkeypatch, cache) -> None:
    """The kernels turned on and to be built for `target` into the cache folder `cache`, as a user would ask
    with LLAMA_CORE_CPU_TARGET: none built or loaded yet in this process."""
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv("LLAMA_CORE_CACHE", str(cache))
    monkeypatch.setenv(build.TARGET_VARIABLE, target)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(panels, "_KERNELS", None)


def runs_here(target: str):
    missing = sorted(TARGETS[target][1] - CPU_FLAGS)
    return pytest.param(target, marks=pytest.mark.skipif(bool(missing), reason=f"this CPU lacks {missing}"))


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Each target's build of the kernels, made on first use."""
    built: dict[str, ctypes.CDLL] = {}
    directory = tmp_path_factory.mktemp("targets")

    def library(target: str) -> ctypes.CDLL:
        if target not in built:
            path = directory / f"{target.replace(' ', '-')}.so"
            flags = (*build.FLAGS, *TARGETS[target][0], "-fopenmp")
            result = build.subprocess.run(["cc", *flags, *map(str, build.SOURCES), "-o", str(path)],
                                          capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            built[target] = ctypes.CDLL(str(path))
            build._declare(built[target])
            assert built[target].native_vectors() == 1
        return built[target]

    return library


def products(library: ctypes.CDLL, weights: dict, x: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """x times each weight through one build of the kernels, on 2 threads."""
    out_features, in_features = shape
    results = {}
    for kind, weight in weights.items():
        y = torch.empty(x.shape[0], out_features)
        args = (x.shape[0], out_features, in_features, 2)
        if kind == "int8":
            panel, scales, sums = weight
            assert library.panel_linear_i8(x.data_ptr(), panel.data_ptr(), scales.data_ptr(), sums.data_ptr(),
                                           y.data_ptr(), *args) == 0
        elif kind == "int4":
            panel, scales = weight
            assert library.panel_linear_i4(x.data_ptr(), panel.data_ptr(), scales.data_ptr(), y.data_ptr(), *args) == 0
        else:
            getattr(library, f"panel_linear_{kind}")(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), *args)
        results[kind] = y
    return results


@needs_kernels
@needs_x86_compiler
@pytest.mark.parametrize("target", [runs_here(name) for name in TARGETS])
def test_every_product_equals_the_native_builds_bit_for_bit(libraries, target):
    torch.manual_seed(0)
    for shape in [(96, 64), (100, 7), (31, 34), (70, 96), (2304, 768)]:
        weight = torch.randn(shape)
        int8, int4 = Int8Linear(weight), Int4Linear(weight)
        int8_panels, sums = panels.to_int8_panels(int8.weight)
        int8_scales = torch.zeros(sums.shape[0])
        int8_scales[:shape[0]] = int8.scales
        weights = {"f32": panels.to_panels(weight), "bf16": panels.to_panels(weight.bfloat16()),
                   "f16": panels.to_panels(weight.half()), "int8": (int8_panels, int8_scales, sums),
                   "int4": int4._panels_for_cpu()}
        for rows in (1, 2, 3, 4, 5, 6, 7, 9, 13, 40):  # alone, streams, each partial tile, widening
            x = torch.randn(rows, shape[1]) * torch.logspace(-2, 2, rows)[:, None]
            expected = products(build.load(), weights, x, shape)
            got = products(libraries(target), weights, x, shape)
            for kind in weights:
                assert torch.equal(got[kind], expected[kind]), (kind, shape, rows)


def layer_ops(library: ctypes.CDLL, rows: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor) -> list:
    """argmax, RMSNorm and SiLU gating of the same inputs through one build of the kernels."""
    argmax, normed, gated = torch.empty(rows.shape[0], dtype=torch.int64), torch.empty_like(rows), \
        torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    library.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], argmax.data_ptr())
    library.rms_norm(rows.data_ptr(), weight.data_ptr(), normed.data_ptr(), rows.shape[0], rows.shape[1], 1e-5, 2)
    library.silu_mul(gate_up.data_ptr(), gated.data_ptr(), gate_up.shape[0], gate_up.shape[1] // 2, 2)
    return [argmax, normed, gated]


@needs_kernels
@needs_x86_compiler
@pytest.mark.parametrize("target", [runs_here(name) for name in TARGETS])
def test_layer_operations_equal_the_native_builds_bit_for_bit(libraries, target):
    torch.manual_seed(0)
    rows = torch.randn(6, 1003) * 10
    rows[1, 500:503] = rows[1].max() + 1  # equal maxima: the first
    rows[2, 700], rows[3, 9] = float("nan"), float("-inf")
    gate_up = torch.randn(5, 2 * 1001) * 30  # past exp's clamps at both ends
    weight = torch.randn(1003)
    expected, got = layer_ops(build.load(), rows, gate_up, weight), layer_ops(libraries(target), rows, gate_up, weight)
    assert libraries(target).vector_instructions().decode() == INSTRUCTIONS[target]  # what the Model tab says
    library = libraries(target)
    assert (library.tile_rows(), library.int_tile_rows()) == TILE_ROWS[target]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[0], torch.argmax(rows, dim=-1))
    for a, b in zip(got[1:], expected[1:]):  # bit for bit; the rows with NaN and -inf norm to NaN
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_kernels
@needs_x86_compiler
@pytest.mark.skipif(bool(AVX2 - CPU_FLAGS), reason=f"this CPU lacks {sorted(AVX2 - CPU_FLAGS)}")
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_model_served_by_an_avx2_build_decodes_as_by_the_native_one(monkeypatch, tmp_path, meta_ckpt_dir,
                                                                      tokenizer, quantize):
    # Through LLAMA_CORE_CPU_TARGET, as a user would build for another CPU: RMSNorm, attention over float32 and
    # bfloat16 caches, whole blocks in one call and every product, for a batch of two prompts.
    prompts = [tokenizer.encode(text, bos=True, eos=False) for text in ("def forward(self, x):", "Once upon a")]
    llama = build_llama(meta_ckpt_dir, quantize=quantize)
    native = llama.generate(prompts, 12, temperature=0, logprobs=True)
    building_for("haswell", monkeypatch, tmp_path)
    assert cpu_kernels.available() and panels._KERNELS._name.startswith(str(tmp_path))  # built for the target
    assert llama.generate(prompts, 12, temperature=0, logprobs=True) == native


@needs_x86_compiler
def test_a_target_without_avx2_or_avx512_is_left_unused_saying_why(tmp_path, monkeypatch):
    # Built for x86-64's baseline (SSE2), the kernels would run in 4-lane vectors without FMA: torch's products
    # serve instead.
    building_for("x86-64", monkeypatch, tmp_path)
    assert not build.expected()  # known from the compiler's macros, before building
    with pytest.warns(UserWarning, match="the CPU target 'x86-64' has neither AVX-512 nor AVX2 with FMA"):
        assert build.load() is None
    assert list(tmp_path.glob("kernels/kernels-*.so"))  # it was built, then left unused
    monkeypatch.setenv(build.TARGET_VARIABLE, "haswell")
    assert build.expected()


@needs_x86_compiler
def test_a_target_the_compiler_does_not_know_falls_back_with_its_error(tmp_path, monkeypatch):
    building_for("haswel", monkeypatch, tmp_path)
    assert not build.expected()
    with pytest.warns(UserWarning, match="could not build the CPU kernels.*haswel"):
        assert build.load() is None


def test_what_the_products_run_on_is_described_in_words(monkeypatch):
    # The app's Model tab shows it: which instructions, built for which CPU.
    if cpu_kernels.available():
        assert build.describe() == (f"llama_core's kernels ({build.load().vector_instructions().decode()}, built for "
                                    f"{build.target()})")
        assert build.load().vector_instructions().decode() in ("AVX-512 with VNNI", "AVX-512", "AVX2 with AVX-VNNI",
                                                               "AVX2")
    monkeypatch.setenv(build.DISABLE_VARIABLE, "0")
    assert build.describe() is None
