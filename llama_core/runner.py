"""A loaded model on its device(s), ready to serve: its inference weight layout, a KV cache of
`max_batch_size` slots of `max_seq_len` positions, and the forwards the serving engine runs on it.

The decode step comes in three shapes. Dynamic (the default): only the given rows, attending over the
longest row's positions: the least work, which is what a CPU wants. Static (`compile=True` on CUDA):
the cache's leading rows 0..n-1 up to the highest row asked for, n rounded up to a power of two (at most
max_batch_size), attending over a context length rounded up to a power of two (at least 256 positions, at
most max_seq_len), so torch.compile compiles the step twice, for one row (with coordinate-descent tuning)
and for n a symbolic size (without; with int8 or int4 kernels and more than 64 slots, once up to 64 rows and
once past), with the length a symbolic size, and captures it as a CUDA graph (mode "reduce-overhead") once
per row count and length: a few graphs; no step reads more of the cache than twice what its longest row
uses, and a lone request decodes one row, not max_batch_size (its products read each weight once either way, but
many rows' products and attention cost more: on an H100, a 7B-shaped step over 32 rows took 2.2 times one
row's). Compiled, and captured for one row and for every row at the shortest length, when the runner is
made; slots_to_fill() keeps new requests in the lowest rows. Leading rows (`compile=True` on CPU):
rows 0..n-1 up to the highest row asked for (at least 2), over the longest row's positions, compiled once
with n and the length as symbolic sizes: one C++ kernel per fused group of small operations instead of
hundreds of eager calls per step, compiled when the runner is made. In the last two, rows not asked for
compute a throw-away token at a spare position past the context, which nothing attends to (the cache has
max_seq_len + 1 positions): so a row being prefilled in chunks keeps what it wrote, and no context length
a step attends over is ever the whole cache (torch.compile would specialise that one and compile again).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from .devices import execution_device, on_one_device, to_device
from .errors import InvalidRequestError
from .model import Span, Transformer, TransformerBlock
from .cpu_kernels import PanelLinear, available as cpu_kernels_available, kernel_for, rows_read_as_one
from .cpu_kernels import build as cpu_kernels_build
from .packed_linear import PackedLinear, pack_linears, unpack_linears
from .int4 import Int4Linear, keep_int4_in_panels
from .quantize import Int8Linear, failed_in_triton, keep_int8_in_panels, triton_failed, triton_rows

CacheRows = torch.Tensor | slice


class ModelRunner:
    """A Transformer with its KV cache, and the three forwards of serving: prefill, decode and spans.

    The KV cache has one owner at a time (a serving engine), which `claim` and `release` track.
    """

    def __init__(self, model: Transformer, max_batch_size: int, max_seq_len: int, compile: bool = False,
                 tensor_parallel: bool = False, kv_cache_dtype: Optional[torch.dtype] = None,
                 warm_up: bool = True) -> None:
        """model: loaded weights in eval mode. compile: decode with a compiled step (static on CUDA, leading rows on CPU: see the module docstring).
        tensor_parallel: every forward is replayed on the other ranks (see llama_core.distributed.parallel),
        so only model.forward may run it. kv_cache_dtype: the KV cache's, None for the model's.
        warm_up: compile the step here, in this thread (see warm_up); False leaves it to the thread that will
        run the steps (a serving engine's, as it starts).

        Raises:
            InvalidRequestError: max_batch_size or max_seq_len not a positive integer.
        """
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        self.model = model
        self.args = model.args
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tensor_parallel = tensor_parallel
        self.device = execution_device(model.tok_embeddings)  # where inputs go; logits come back here too
        self.dtype = model.tok_embeddings.weight.dtype
        if model.layers[0].attention.wqkv is None:
            model.fuse_projections()
        if self.device.type == "cpu":
            # The compiled step traces through plain products: it cannot take packed weights as inputs.
            if not compile and not tensor_parallel and on_one_device(model):
                cpu_serving_layout(model, float32_model=self.dtype == torch.float32)  # the loader's did most parts
                if self.dtype == torch.float32 and cpu_kernels_available():
                    model.use_cpu_kernels()
            model.use_column_major_weights()
        # a compiled step's spare position
        model.setup_caches(max_batch_size, max_seq_len + (1 if compile else 0), kv_cache_dtype)
        self._first_kv_cache = model.layers[0].attention.kv_cache  # every forward and copy writes it
        self.kv_cache_dtype = self._first_kv_cache.k_cache.dtype
        self.decode_step = DecodeStep(model, max_batch_size, compile, context=max_seq_len)
        if warm_up:
            self.warm_up()
        self._owner: Optional[object] = None
        self._owner_lock = threading.Lock()

    def warm_up(self) -> None:
        """Compiles a compiled decode step now, for the calling thread, rather than in the first request;
        nothing for an eager one. Run it in the thread that will run the steps: torch.compile's CUDA graphs
        are recorded per thread, so a step first run in another thread captures them again (on that thread's
        first request, in a memory pool of its own)."""
        if self.decode_step.compiled:
            self.decode_step.warm_up()

    @property
    def parameter_count(self) -> int:
        # Packed, int8 and int4 projections hold their weights as buffers in a layout of their own.
        held_apart = sum(m.in_features * m.out_features for m in self.model.modules()
                         if isinstance(m, (PackedLinear, PanelLinear, Int8Linear, Int4Linear)))
        return held_apart + sum(p.numel() for p in self.model.parameters())

    def memory_bytes(self) -> tuple[int, int]:
        """(weights, KV cache): the bytes the model's tensors take on their devices (a tensor held twice, as
        tied embeddings are, once; weights an offloading device map keeps on the meta device not counted)."""
        tensors: dict[tuple[str, int], tuple[int, bool]] = {}
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if tensor.device.type == "meta":
                continue
            try:
                key = (str(tensor.device), tensor.data_ptr())
            except RuntimeError:  # an opaque layout (oneDNN's packed weight) has no pointer to share
                key = (str(tensor.device), id(tensor))
            tensors[key] = (tensor.numel() * tensor.element_size(), ".kv_cache." in f".{name}")
        weights = sum(size for size, cache in tensors.values() if not cache)
        return weights, sum(size for size, cache in tensors.values() if cache)

    @property
    def decodes_rows_alike(self) -> bool:
        """Whether a forward over several tokens of a sequence gives each token the logits a decode step would
        give it, bit for bit: an eager model on llama_core's CPU kernels, whose every row is computed the same
        way whatever else shares the forward."""
        return not self.decode_step.compiled and on_cpu_kernels(self.model, self.device)

    @property
    def rows_read_as_one(self) -> int:
        """How many tokens a forward can take for about the cost of one, where the weights' reading dominates:
        on llama_core's CPU kernels, the fewest rows any of its products reads its weight for once (AVX-512:
        8; see cpu_kernels.rows_read_as_one); else 1."""
        if not self.decodes_rows_alike:
            return 1
        kinds = {"int4" if isinstance(m, Int4Linear) else "int8" if isinstance(m, Int8Linear) else "float"
                 for m in self.model.modules() if isinstance(m, (Int4Linear, Int8Linear, PanelLinear))}
        return max(1, min((rows_read_as_one(kind) for kind in kinds), default=1))

    @property
    def mixes_prompts(self) -> bool:
        """Whether prompts can ride along in a decode step (`forward_spans`): an eager model on one device
        of its own (not a compiled step, offloaded layers or tensor parallelism)."""
        return not self.decode_step.compiled and not self.tensor_parallel and on_one_device(self.model)

    # -- ownership of the KV cache ----------------------------------------------------------------
    def claim(self, owner: object) -> bool:
        """Gives the KV cache to owner until release(owner); False if another owner holds it."""
        with self._owner_lock:
            if self._owner is not None and self._owner is not owner:
                return False
            self._owner = owner
            return True

    def release(self, owner: object) -> None:
        with self._owner_lock:
            if self._owner is owner:
                self._owner = None

    @property
    def kv_cache_version(self) -> Optional[int]:
        """A count that moves whenever anything writes the KV cache (torch's version counter of its first
        buffer, which writes through views move too); None where torch keeps none (a cache made under
        inference_mode). The owner compares it with what it saw after its own last write, to notice the
        model run directly (`model(tokens)` writes rows 0..B-1) in between."""
        try:
            return self._first_kv_cache.k_cache._version
        except RuntimeError:
            return None

    # -- forwards ----------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, rows: CacheRows, kv_len: int,
                logit_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Writes tokens [B, S] at positions [B, S] into cache rows; logits [B, S, vocab], or [B, 1, vocab]
        at logit_index [B]."""
        return self.model(tokens, positions, cache_rows=rows, kv_len=kv_len, logit_index=logit_index)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, rows: Optional[CacheRows] = None,
               kv_len: Optional[int] = None, rows_end: Optional[int] = None) -> torch.Tensor:
        """Logits [B, vocab] for one token per row (see DecodeStep)."""
        return self.decode_step(tokens, positions, rows, kv_len, rows_end)

    def slots_to_fill(self, free_slots: Sequence[int], busy_slots: Iterable[int]) -> list[int]:
        """The free slots a new request should take (see DecodeStep.slots_to_fill)."""
        return self.decode_step.slots_to_fill(free_slots, busy_slots)

    def forward_spans(self, spans: list[Span]) -> list[torch.Tensor]:
        """Several cached batches in one forward (see Transformer.forward_spans); only where mixes_prompts."""
        return self.model.forward_spans(spans)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copies the KV-cache rows of positions [0, length) from one slot to another, in every layer on that
        layer's device (and, under tensor parallelism, on every rank): what src_slot computed for a prompt's
        first `length` tokens serves dst_slot without computing it again.

        Raises:
            ValueError: a slot outside the cache, the same slot twice, or a length outside [1, max_seq_len].
        """
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not 0 <= slot < self.max_batch_size:
                raise ValueError(f"{name} must be in [0, {self.max_batch_size}), got {slot}")
        if src_slot == dst_slot or not 1 <= length <= self.max_seq_len:
            raise ValueError(f"cannot copy {length} positions from slot {src_slot} to slot {dst_slot}")
        if self.tensor_parallel:
            from .distributed import parallel

            parallel.broadcast_copy_prefix(src_slot, dst_slot, length)
        self.model.copy_cache_prefix(src_slot, dst_slot, length)


SMALLEST_CONTEXT = 256  # the static step's shortest context length; longer ones double up to max_seq_len
# The static step on CUDA: mode "reduce-overhead" (CUDA graphs), and coordinate-descent tuning, under which
# inductor turns a one-row product into a tuned reduction that reads each weight once, fused with what
# comes before it: for int8 weights without llama_core.triton_products' kernel, their conversion (without it an
# int8 weight is first written out in bfloat16 for cuBLAS: 5 bytes moved per weight instead of 1). gpt-fast's
# settings.
STATIC_STEP_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
# The static step for more than one row: CUDA graphs without the tuning. Its products are cuBLAS's (int8 and
# int4: llama_core.triton_products'), so the tuning would only time variants of its small kernels, each
# compiled in turn, for a row count and a context length both symbolic: on an H100 a 32-slot 7B engine had
# not finished compiling its two graphs, tuned, after 300 s (docs/benchmarks.md, "GPU").
STATIC_MANY_ROWS_OPTIONS = {"triton.cudagraphs": True}


class DecodeStep:
    """One new token for each of a set of KV-cache rows: dynamic, static or leading rows (see the module's
    docstring)."""

    def __init__(self, model: Transformer, max_batch_size: int, compile: bool = False, static: bool = False,
                 smallest_context: int = SMALLEST_CONTEXT, context: Optional[int] = None) -> None:
        """context: the positions rows use (default: the whole cache); where the cache holds more, the last
        one is the spare position of throw-away tokens (see the module's docstring)."""
        self.model = model
        self.smallest_context = smallest_context
        self.max_batch_size = max_batch_size
        self.max_seq_len = model.layers[0].attention.kv_cache.max_seq_len
        self.context = context or self.max_seq_len
        on_cuda = next(model.parameters()).device.type == "cuda"
        if compile:  # torch.compile traces torch's operations, not ctypes calls
            model.use_cpu_kernels(False)
            for module in model.modules():  # a quantized layer's kernel is chosen before tracing: choosing it
                if isinstance(module, (Int8Linear, Int4Linear)):  # builds the kernels, under a lock dynamo
                    kernel_for(module)  # cannot trace
        if compile and unpack_linears(model):
            model.use_column_major_weights()
        self.compiled = compile
        self.static = static or (compile and on_cuda)
        self.leading_rows = compile and not self.static
        self._traced: list[_FloatsAsConstants] = []  # the compiled functions, while warm_up traces them
        self._step = self._compiled_step() if compile else self._all_rows

    def _compiled_step(self) -> Callable:
        on_cuda = self._device.type == "cuda"
        if self.static:  # dynamic: the context length (and, past one row, the row count) a symbolic size
            one_row = _FloatsAsConstants(torch.compile(
                self._one_row, options=STATIC_STEP_OPTIONS if on_cuda else None, fullgraph=True, dynamic=True))
            many_rows = _FloatsAsConstants(torch.compile(
                self._all_rows, options=STATIC_MANY_ROWS_OPTIONS if on_cuda else None, fullgraph=True, dynamic=True))
            self._traced = [one_row, many_rows]

            def step(tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
                return (one_row if tokens.shape[0] == 1 else many_rows)(tokens, positions, kv_len)

            return step
        leading = _FloatsAsConstants(torch.compile(self._leading_rows, fullgraph=True, dynamic=True))
        self._traced = [leading]
        return leading

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: Optional[torch.Tensor | slice] = None,
        kv_len: Optional[int] = None,
        rows_end: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] for tokens [B] at positions [B] in cache rows [B] (a slice: consecutive rows;
        None: rows 0..B-1).

        kv_len: a bound the caller knows on the host (> every position; extra positions are masked), so
        the dynamic step needs no device-to-host read; None reads it from positions. rows_end: one past
        the highest row, likewise (None: read from rows where they are a tensor)."""
        if rows is None:
            rows = slice(0, tokens.shape[0])
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if not self.static and not self.leading_rows:
            return self.model(tokens[:, None], positions[:, None], cache_rows=rows, kv_len=kv_len)[:, 0]
        if rows_end is None:
            rows_end = rows.stop if isinstance(rows, slice) else int(rows.max()) + 1
        if self.leading_rows:
            all_tokens, all_positions = self._padded(tokens, positions, rows, max(rows_end, self._fewest_rows))
            return self._call_leading(all_tokens, all_positions, max(kv_len, 2))[rows]
        all_tokens, all_positions = self._padded(tokens, positions, rows, self.row_count(rows_end))
        logits = self._step(all_tokens, all_positions, self.context_length(kv_len))[rows]
        # Copy out of the step's output, which the next CUDA graph replay overwrites (a slice is a view).
        return logits.clone() if isinstance(rows, slice) else logits

    def row_count(self, rows_end: int) -> int:
        """The static step's row count for rows below rows_end: the smallest power of two that covers them,
        at most max_batch_size."""
        count = 1
        while count < rows_end:
            count *= 2
        return min(count, self.max_batch_size)

    def slots_to_fill(self, free_slots: Sequence[int], busy_slots: Iterable[int]) -> list[int]:
        """The free slots a new request should take: for the static step, those that keep its row count
        lowest (below the row count the busy slots already need, else the lowest such count that has one
        free); for the others any free slot."""
        if not self.static or not free_slots:
            return list(free_slots)
        needed = max(self.row_count(max(busy_slots, default=-1) + 1), self.row_count(min(free_slots) + 1))
        return [slot for slot in free_slots if slot < needed]

    def context_length(self, kv_len: int) -> int:
        """The static step's context length for rows whose positions are below kv_len: the smallest power-of-two
        multiple of smallest_context that covers it, at most the context."""
        length = min(self.smallest_context, self.context)
        while length < kv_len:
            length *= 2
        return min(length, self.context)

    def warm_up(self) -> None:
        """Compiles the step now rather than in the first request: throw-away tokens at the spare last position,
        for two rows (leading rows), or for one row and for every row at the shortest context (static),
        where the static step's CUDA graphs are also captured. Where llama_core.triton_products' kernels are
        in the step and they are what failed (quantize.failed_in_triton), it is compiled again without them
        (quantize.triton_failed); any other failure is raised as it is."""
        for traced in self._traced:  # warmed up again (a second serve()): a trace now is patched too
            traced.tracing = True
        try:
            self._warm_up()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if not self._triton_products() or not failed_in_triton(exc):
                raise
            triton_failed(exc)
            torch._dynamo.reset()
            self._step = self._compiled_step()
            self._warm_up()
        for traced in self._traced:  # every graph serving needs is traced: later calls skip the float patch
            traced.tracing = False

    def _triton_products(self) -> bool:
        return triton_rows() is not None and any(isinstance(m, (Int8Linear, Int4Linear)) for m in self.model.modules())

    def _warm_up(self) -> None:
        with torch.inference_mode():  # as the engine calls it: torch.compile guards on inference tensors
            if self.static:
                counts = {1, self.max_batch_size}
                if self._triton_products():  # up to MAX_ROWS rows the products are the kernel's, past it cuBLAS's:
                    counts.add(min(self.max_batch_size, triton_rows().MAX_ROWS))  # a graph for each, traced now
                for count in sorted(counts):
                    positions = torch.full((count,), self.max_seq_len - 1, device=self._device)
                    for _ in range(3):  # torch.compile's CUDA graphs: a warm-up run, the capture, a replay
                        self._step(positions * 0, positions, self.context_length(1))
                return
            positions = torch.full((self._fewest_rows,), self.max_seq_len - 1, device=self._device)
            self._call_leading(positions * 0, positions, self.max_seq_len // 2)

    @property
    def _fewest_rows(self) -> int:
        # Never one row: torch.compile would specialise the batch size to 1 and compile again for more.
        return min(2, self.max_batch_size)

    @property
    def _device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def _padded(self, tokens, positions, rows, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """count rows of tokens and positions: the given ones at rows, throw-away ones elsewhere."""
        all_tokens = torch.zeros(count, dtype=tokens.dtype, device=tokens.device)
        all_positions = torch.full((count,), self.max_seq_len - 1, dtype=positions.dtype, device=positions.device)
        all_tokens[rows] = tokens
        all_positions[rows] = positions
        return all_tokens, all_positions

    def _call_leading(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        if self.max_batch_size > 2:  # one graph for any count of rows from 2 to max_batch_size
            torch._dynamo.mark_dynamic(tokens, 0, min=2, max=self.max_batch_size)
            torch._dynamo.mark_dynamic(positions, 0, min=2, max=self.max_batch_size)
        return self._step(tokens, positions, kv_len)

    def _one_row(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        # _all_rows for one row, as a function of its own: torch.compile keeps its compiled code apart, with
        # the options of its own (STATIC_STEP_OPTIONS) and its own traces (_FloatsAsConstants).
        return self._all_rows(tokens, positions, kv_len)

    def _all_rows(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        # Rows 0..B-1 (B a row count). Rows not asked for sit at the spare position: they attend over all of [0, kv_len).
        return self.model(tokens[:, None], positions[:, None], kv_len=kv_len)[:, 0]

    def _leading_rows(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        # cache_rows None: rows 0..B-1 with B symbolic (a slice object would be specialised to its bounds).
        return self.model(tokens[:, None], positions[:, None], cache_rows=None, kv_len=kv_len)[:, 0]


class _FloatsAsConstants:
    """compiled, traced with the model's float attributes (each RMSNorm's eps, rope_theta) as constants.
    Under dynamic=True, torch 2.11's dynamo traces them as symbolic values, specialises them, and then
    guards each one on every call by making it a tensor and reading it back with .item(): two host-side
    .item() calls a layer on every step (67 for a 7B). Every call patches dynamo's config while tracing is
    True; DecodeStep.warm_up, having traced every graph serving needs, sets it False: the patch costs tens of
    microseconds a step."""

    def __init__(self, compiled: Callable) -> None:
        self.compiled = compiled
        self.tracing = True

    def __call__(self, *args):
        if not self.tracing:
            return self.compiled(*args)
        with torch._dynamo.config.patch(specialize_float=True):
            return self.compiled(*args)


def cpu_serving_layout(part: nn.Module, float32_model: bool = True) -> nn.Module:
    """One part of a just-loaded CPU model (a block, the embeddings, the norm, the output layer) in the layout
    an eager ModelRunner serves it in: q/k/v and gate/up fused, float32 and int8 projections in
    llama_core.cpu_kernels' panels (16-bit ones where those hold the weight exactly, or where a float32_model's
    weight was loaded as stored). The loader applies it as
    each part is read, so a model stored in 16 bits never exists whole in float32. Returns the part, or what
    takes its place."""
    if isinstance(part, TransformerBlock) and part.attention.wqkv is None:
        part.attention.fuse_projections()
        part.feed_forward.fuse_projections()
    holder = nn.ModuleDict({"part": part})  # so that a part which is itself a projection can be replaced
    pack_linears(holder, float32_model=float32_model)
    keep_int8_in_panels(holder)
    keep_int4_in_panels(holder)
    return holder["part"]


def cpu_products_of(model: nn.Module, device: torch.device) -> Optional[str]:
    """What a CPU model's products run on, in words (the app's Model tab shows it): llama_core's kernels where
    its projections are in their panels, else torch's own; None off the CPU."""
    if device.type != "cpu":
        return None
    return cpu_kernels_build.describe() if on_cpu_kernels(model, device) else "torch's own"


def on_cpu_kernels(model: nn.Module, device: torch.device) -> bool:
    """Whether a CPU model's products run in llama_core's kernels (its projections in their panels, the
    kernels built)."""
    return (device.type == "cpu" and any(isinstance(getattr(m, "panels", None), torch.Tensor) for m in model.modules())
            and cpu_kernels_build.describe() is not None)


def panel_storage_of(model: nn.Module) -> Optional[str]:
    """"bfloat16" or "float16" where every projection of model is in CPU panels of that dtype, else None."""
    dtypes = {m.panels.dtype for m in model.modules() if isinstance(m, PanelLinear)}
    if len(dtypes) != 1 or any(isinstance(m, nn.Linear) for m in model.modules()):
        return None
    dtype = dtypes.pop()
    return None if dtype == torch.float32 else str(dtype).removeprefix("torch.")


def right_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                 starts: Optional[Sequence[int]] = None, max_seq_len: Optional[int] = None):
    """Prompts as one prefill batch: tokens [B, longest] padded on the right, positions [B, longest]
    (0, 1, ... in every row) and lengths [B]. A row never attends to the padding after its own prompt,
    and decoding overwrites the padding's cache entries before they are ever read.

    starts: where each row's tokens begin (a prompt's uncached part follows its cached prefix); padding
    positions then stop at max_seq_len - 1, a position no prompt reaches."""
    lengths = to_device([len(p) for p in prompts], device)
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    positions = torch.arange(longest, device=device).expand(len(prompts), longest)
    if starts is not None and any(starts):
        positions = positions + to_device(starts, device)[:, None]
        if max_seq_len is not None:
            positions = positions.clamp(max=max_seq_len - 1)
    return to_device(tokens, device), positions, lengths


def cache_rows(slots: list[int], device: torch.device) -> CacheRows:
    """The KV-cache rows of these slots: a slice when they are consecutive (the cache is then read through
    views, not gathered), else an index tensor."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return to_device(slots, device)
