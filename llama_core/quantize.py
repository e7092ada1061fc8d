"""int8 weights (`quantize="int8"`): each projection's weight stored as int8 with one float scale per output
channel (row).

On CPU (float32) the product runs in llama_core's own kernel where it is built (llama_core.cpu_kernels):
each row of activations is rounded to 8 bits on its own scale and multiplied with the int8 weight in
integer arithmetic (VNNI's four-products-per-lane instruction where the CPU has it, else AVX2's pairwise
products), reading the weight once per tile of rows (8 with AVX-512 VNNI, 2 with AVX2). Without it, the
product runs in fbgemm's int8 GEMM (`torch.ops.quantized.linear_dynamic`, the kernel behind torch.ao's
dynamic quantization): the activations are quantized to 8 bits on the fly and multiplied
with the int8 weight in integer arithmetic, never through a dequantized copy of the weight.
scripts/bench_int8.py measured it the fastest candidate on the 15m and 110m shapes at 1 to 32 rows (2.6 to
9 times float32's speed on the projections, 1.6 to 5.9 with the row scaling below), ahead of torch's
weight-only `_weight_int8pack_mm` (docs/benchmarks.md); on models as small as the embedded one the ops
around each product make it slower than float32.

fbgemm quantizes its whole input with one scale. Each row is therefore first divided by its own largest
magnitude, and two constant columns (+1 and -1, against zero weights) pin the input's range to [-1, 1]:
every row gets its own 8-bit scale, the same whatever other rows share the forward (a prompt's outlier
token cannot coarsen a decoding row), and the output is multiplied back row by row.

Under torch.compile, which can trace neither kernel, the same rounding runs in float, so compiled and eager
steps agree. On CUDA, up to 64 rows of 16-bit activations (decoding) are multiplied in llama_core's Triton
kernel (llama_core.triton_products), which converts each weight as it reads it. Elsewhere (a prompt's many
rows, other dtypes, CUDA without triton) the activations stay as they are and the product is the dequantized
one, which inductor fuses under `--compile` where a step has one row (the compiled step's coordinate-descent
tuning turns that product into a reduction reading the int8 weight; see llama_core.runner); with more rows
the weight is converted before cuBLAS multiplies it.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
import warnings
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .packed_linear import PackedLinear

QUANTIZATIONS = ("int8", "int4")  # what Llama.build(quantize=...) takes besides None (int4: llama_core.int4)


class Int8Linear(nn.Module):
    """y = x @ (W_int8 * scales[:, None]).T: weight int8 [out, in] row-major, scales [out] in the model's dtype."""

    quantization = "int8"  # what quantization_of reports

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        quantized, scales = _rounded_rows(weight.detach())
        self._set(quantized, scales.to(weight.dtype))

    def _set(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        _reduce_range()  # found now, in eager mode: forward reads it (None: no fbgemm in this torch)
        triton_rows()  # likewise: imported here, never while torch.compile traces forward

    @classmethod
    def stacked(cls, linears: Iterable["Int8Linear"]) -> "Int8Linear":
        """Rows of several quantized linears stacked into one (scales are per row, so they stack too)."""
        linears = list(linears)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._set(torch.cat([l.weight for l in linears]), torch.cat([l.scales for l in linears]))
        return fused

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] this layer stands for, in the scales' dtype."""
        return self.weight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32:
            if cpu_kernels.kernel_for(self) == "panels":
                if torch.compiler.is_compiling():  # the kernel's rounding, the sums in float
                    return F.linear(_panel_rounding(x), self.weight.to(x.dtype)) * self.scales
                panels, scales, weight_sums = self._panels_for_cpu()
                return cpu_kernels.panel_product(x, panels, self.out_features, self.in_features, scales, weight_sums)
            if _REDUCE_RANGE is not None:
                rows, magnitude = _rows_on_own_scale(x)
                if torch.compiler.is_compiling():  # dynamo cannot trace fbgemm's packed weight: the same sums in float
                    out = F.linear(_fbgemm_rounding(rows), self.weight.to(x.dtype)) * self.scales
                else:
                    out = torch.ops.quantized.linear_dynamic(rows, self._packed_for_cpu(), _REDUCE_RANGE)
                return out.mul_(magnitude).view(*x.shape[:-1], self.out_features)
        if self.scales.dtype == x.dtype and fits_triton(x, self.weight):
            out = triton_product(x, self.weight, self.scales)
            if out is not None:
                return out
        return F.linear(x, self.weight.to(x.dtype)) * self.scales

    def _packed_for_cpu(self):
        """fbgemm's packed copy of the weight (two zero columns added, see the module's docstring), made on
        first use."""
        key = self.weight.data_ptr()  # a weight moved or replaced is packed again
        if getattr(self, "_packed_key", None) != key:
            self._packed, self._packed_key = _fbgemm_pack(self.weight, self.scales), key
        return self._packed

    def _panels_for_cpu(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For cpu_kernels, made on first use: the weight in int8 panels, its scales (float32) and its rows'
        sums, both padded to whole panels."""
        key = self.weight.data_ptr()
        if getattr(self, "_panels_key", None) != key:
            panels, weight_sums = cpu_kernels.to_int8_panels(self.weight)
            scales = torch.zeros(weight_sums.shape[0], dtype=torch.float32)
            scales[:self.out_features] = self.scales
            self._panels, self._panels_key = (panels, scales, weight_sums), key
        return self._panels

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)  # copies into the buffers in place: pack them again
        self._packed_key = self._panels_key = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8PanelLinear(Int8Linear):
    """An Int8Linear whose weight lives only in llama_core.cpu_kernels' int8 panels, as the runner keeps a
    float32 model's int8 projections on the CPU where the kernels are built: one copy of the weight, not
    the row-major one beside the panels made from it (on a 7B, 6.2 GiB less). `weight` and `scales` give
    the row-major values back (copies); like PanelLinear's, the panels are not in the state dict."""

    def __init__(self, linear: Int8Linear) -> None:
        nn.Module.__init__(self)
        self._shape = (linear.out_features, linear.in_features)
        panels, scales, weight_sums = linear._panels_for_cpu()
        self.register_buffer("panels", panels, persistent=False)
        self.register_buffer("padded_scales", scales, persistent=False)
        self.register_buffer("weight_sums", weight_sums, persistent=False)
        self._kernel = "panels"

    @property
    def weight(self) -> torch.Tensor:
        return cpu_kernels.from_int8_panels(self.panels, *self._shape)

    @property
    def scales(self) -> torch.Tensor:
        return self.padded_scales[:self._shape[0]]

    @property
    def in_features(self) -> int:
        return self._shape[1]

    @property
    def out_features(self) -> int:
        return self._shape[0]

    def _panels_for_cpu(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.panels, self.padded_scales, self.weight_sums


def keep_int8_in_panels(model: nn.Module) -> int:
    """Replaces each float32 Int8Linear on the CPU in model by an Int8PanelLinear, in place, where
    llama_core's CPU kernels are built; returns how many."""
    if not cpu_kernels.available():
        return 0
    return replace_children(model, lambda child: Int8PanelLinear(child) if type(child) is Int8Linear
                            and child.weight.device.type == "cpu" and child.scales.dtype == torch.float32 else None)


def replace_children(model: nn.Module, replacement: Callable[[nn.Module], Optional[nn.Module]]) -> int:
    """Puts replacement(child) in place of each module below model for which it gives one (not None); returns
    how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replaces every bias-free nn.Linear (and oneDNN-packed projection) in model with an Int8Linear, in place;
    returns model, or its Int8Linear where model is itself such a linear."""
    if quantizable(model):
        return Int8Linear(model.weight)
    for name, child in list(model.named_children()):
        setattr(model, name, quantize_int8(child))
    return model


def _rounded_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] with each row rounded to int8 on its own scale, its largest magnitude / 127: the int8
    weight, row-major whatever the float weight's layout (the int8 kernels read it that way), and the scales
    in float32. On the CPU a few rows at a time, in one float32 buffer that stays in cache: on the whole
    weight at once each step wrote a fresh float32 copy, and loading a 7B as int8 spent most of its time in
    page faults. On a GPU in chunks of DEVICE_ROUNDING_CHUNK_BYTES: the whole of a 7B's output layer took 1 GiB
    of scratch the memory check did not count."""
    rows, columns = weight.shape
    chunk_bytes = ROUNDING_CHUNK_BYTES if weight.device.type == "cpu" else DEVICE_ROUNDING_CHUNK_BYTES
    step = max(1, chunk_bytes // (4 * columns))
    quantized = torch.empty(rows, columns, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    buffer, magnitudes = torch.empty(2, min(step, rows), columns, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, step):
        chunk = weight[start:start + step]
        w = buffer[:chunk.shape[0]].copy_(chunk)
        # The largest |value| of each row (vector_norm's inf is 4 times slower here).
        scale = torch.abs(w, out=magnitudes[:chunk.shape[0]]).amax(dim=1).clamp_min_(1e-8).div_(127.0)
        quantized[start:start + step] = w.div_(scale[:, None]).round_().clamp_(-127, 127)
        scales[start:start + step] = scale
    return quantized, scales


ROUNDING_CHUNK_BYTES = 1 << 21  # float32 rows _rounded_rows rounds at a time on the CPU
DEVICE_ROUNDING_CHUNK_BYTES = 64 << 20  # and on a GPU


def quantizable(module: nn.Module) -> bool:
    return isinstance(module, (PackedLinear, cpu_kernels.PanelLinear)) or (isinstance(module, nn.Linear) and module.bias is None)


def quantization_of(model: nn.Module) -> Optional[str]:
    """"int4" when model holds int4 layers (llama_core.int4; its output layer is then int8), "int8" when it holds
    int8 ones only, else None."""
    held = {getattr(m, "quantization", None) for m in model.modules()}
    return "int4" if "int4" in held else "int8" if "int8" in held else None


def _fbgemm_pack(weight: torch.Tensor, scales: torch.Tensor):
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    padded = torch.cat([weight, weight.new_zeros(weight.shape[0], 2)], dim=1)
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user type; fbgemm's kernel takes one
        warnings.simplefilter("ignore")
        per_channel = torch._make_per_channel_quantized_tensor(
            padded, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(per_channel, None)


def _rows_on_own_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., in] as rows [N, in + 2] for fbgemm: each divided by its largest magnitude [N, 1], then +1 and -1
    (against zero weights), so that the input's range is [-1, 1] and each row is quantized on its own scale."""
    rows = x.reshape(-1, x.shape[-1])
    magnitude = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30)
    return torch.cat([rows / magnitude, _BOUNDS.expand(rows.shape[0], 2)], dim=1), magnitude


def _panel_rounding(x: torch.Tensor) -> torch.Tensor:
    """The activations cpu_kernels' int8 product multiplies: each row rounded to the nearest of 255 levels
    over [-m, m], m its largest magnitude, as linear.c computes them."""
    largest = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)
    scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
    return (x * (1.0 / scale)).round() * scale


def _fbgemm_rounding(rows: torch.Tensor) -> torch.Tensor:
    """The values fbgemm multiplies for rows in [-1, 1] (less the bound columns): 0..255 (0..127 with reduce
    range) around zero point 128 (64), in float32 steps as fbgemm computes them (-1 maps to 1, not 0)."""
    levels = 127 if _REDUCE_RANGE else 255
    step, inverse = _FBGEMM_STEPS[levels]
    zero = (levels + 1) // 2
    return ((rows[:, :-2] * inverse).round() + zero).clamp(0, levels).sub(zero) * step


_BOUNDS = torch.tensor([[1.0, -1.0]])
_REDUCE_RANGE: Optional[bool] = None
# fbgemm's step for [-1, 1] and its inverse, in float32 as it computes them (so that -1 maps to 1, not 0).
_FBGEMM_STEPS = {levels: (float(torch.tensor(2.0) / levels), float(1 / (torch.tensor(2.0) / levels))) for levels in (127, 255)}


_TRITON_ROWS = None  # llama_core.triton_products where it is used (see triton_rows)
_TRITON_LOOKED_FOR = False


def triton_rows():
    """llama_core.triton_products, on a CUDA build of torch with triton importable, unless
    LLAMA_CORE_TRITON_PRODUCTS=0 (then, as without triton, the dequantized product: under --compile inductor
    fuses it for one row). Found when a quantized layer is made, never while torch.compile traces one."""
    global _TRITON_ROWS, _TRITON_LOOKED_FOR
    if not _TRITON_LOOKED_FOR:
        _TRITON_LOOKED_FOR = True
        if torch.version.cuda is not None and os.environ.get("LLAMA_CORE_TRITON_PRODUCTS", "1") != "0":
            try:
                from . import triton_products
            except ImportError:  # a CUDA build without triton
                pass
            else:
                _TRITON_ROWS = triton_products
    return _TRITON_ROWS


def triton_failed(exc: BaseException) -> None:
    """Stops using llama_core.triton_products after it failed (a triton it cannot be built with, say): the
    dequantized product from now on, said once, with why."""
    global _TRITON_ROWS
    if _TRITON_ROWS is not None:
        _TRITON_ROWS = None
        warnings.warn(f"llama_core: the Triton int8/int4 products failed ({type(exc).__name__}: "
                      f"{str(exc)[:300]}); the dequantized product is used instead", RuntimeWarning, stacklevel=2)


def failed_in_triton(exc: BaseException) -> bool:
    """Whether exc, or an exception it wraps, is a failure of the Triton products in use: one of Triton's own
    exception types (its compiler's or its runtime's, whatever the traceback shows), or one raised in the
    products' code, in Triton's, or in torch's for user-defined Triton kernels (by the frames of its traceback,
    or, for code torch.compile traced rather than ran, of its real_stack). Wrapped: its __cause__ and
    __context__ (torch.compile's BackendCompilerFailed and InductorError are raised `from None`, which keeps
    the context), and their inner_exception."""
    code = _triton_code()
    for error in _wrapped(exc):
        if type(error).__module__.partition(".")[0] == "triton":
            return True
        frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
        frames += [summary.filename for summary in getattr(error, "real_stack", None) or ()]
        if any(path.startswith(code) for path in frames):
            return True
    return False


def _triton_code() -> tuple[str, ...]:
    """The files, or folders, of the code that runs the Triton products: the products' module in use,
    Triton's package, and torch's handling of user-defined Triton kernels (only the products' in a step)."""
    code = []
    if _TRITON_ROWS is not None:
        code.append(inspect.getsourcefile(_TRITON_ROWS) or "")
    triton = sys.modules.get("triton")
    if getattr(triton, "__file__", None):
        code.append(os.path.dirname(triton.__file__) + os.sep)
    wrap = sys.modules.get("torch._higher_order_ops.triton_kernel_wrap")
    if getattr(wrap, "__file__", None):
        code.append(wrap.__file__)
    return tuple(path for path in code if path)


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """exc and every exception it wraps, each once."""
    seen, pending = set(), [exc]
    while pending:
        error = pending.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        pending += [error.__cause__, error.__context__, getattr(error, "inner_exception", None)]


def triton_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                   int4: bool = False) -> Optional[torch.Tensor]:
    """x times an int8 weight (int4: packed levels) in llama_core.triton_products, where fits_triton says so:
    the traced operator under torch.compile, else the kernel launched now; None where launching it failed
    (a triton it cannot be built with, say: see triton_failed), for the caller's plain product."""
    if torch.compiler.is_compiling():
        return (_TRITON_ROWS.int4_rows_product if int4 else _TRITON_ROWS.int8_rows_product)(x, weight, scales)
    try:
        return (_TRITON_ROWS.int4_product if int4 else _TRITON_ROWS.int8_product)(x, weight, scales)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        triton_failed(exc)
        return None


def fits_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether llama_core.triton_products multiplies x by a quantized weight on CUDA: loaded, and a few rows
    of 16-bit activations (a prompt's many rows are compute-bound: the dequantized weight through cuBLAS)."""
    return (_TRITON_ROWS is not None and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() <= _TRITON_ROWS.MAX_ROWS * x.shape[-1] and weight.is_contiguous())


def _reduce_range() -> bool:
    """Whether activations must keep to 7 bits: fbgemm's kernels without VNNI add pairs of u8 x s8 products in
    saturating 16-bit sums, which 8-bit activations can overflow. Found once, by trying a sum that would."""
    global _REDUCE_RANGE
    if _REDUCE_RANGE is None and "fbgemm" in torch.backends.quantized.supported_engines:
        packed = _fbgemm_pack(torch.full((16, 64), 127, dtype=torch.int8), torch.ones(16))
        got = torch.ops.quantized.linear_dynamic(torch.ones(1, 66), packed, False)
        _REDUCE_RANGE = bool((got - 127 * 64).abs().max() > 1)
    return bool(_REDUCE_RANGE)
