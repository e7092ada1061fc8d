"""The static-shape decode step (what CUDA graphs need) agrees with the dynamic one, compiled or not."""

from __future__ import annotations

import shutil

import pytest

from llama_core.runner import DecodeStep
from llama_core.quantize import Int8Linear, quantize_int8

from conftest import build_llama


def _prompts(tokenizer):
    return [tokenizer.encode(text, bos=True, eos=False) for text in ("Once upon a time", "The", "A tiny model said")]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_static_decode_equals_dynamic_decode(meta_ckpt_dir, tokenizer, compile):
    if compile and shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    dynamic = build_llama(meta_ckpt_dir, max_batch_size=4)
    static = build_llama(meta_ckpt_dir, max_batch_size=4, compile=compile)
    # Context lengths of 8, 16 and 32 positions: the step runs (compiled: captured) at each as rows grow.
    static.runner.decode_step = DecodeStep(static.model, 4, compile=compile, static=True, smallest_context=8,
                                           context=static.max_seq_len)
    prompts = _prompts(tokenizer)
    assert max(len(p) for p in prompts) + 12 > 16
    expected_tokens, expected_lps = dynamic.generate(prompts, 12, temperature=0, logprobs=True)
    tokens, lps = static.generate(prompts, 12, temperature=0, logprobs=True)
    assert tokens == expected_tokens
    for got, want in zip(lps, expected_lps):
        assert got == pytest.approx(want, abs=1e-4)
    # The engine's slots go through the same step.
    with static.serve() as engine:
        streams = [engine.submit(p, 12, temperature=0) for p in prompts]
        assert [[c.token for c in s] for s in streams] == expected_tokens
    # And with prompts prefilled in chunks while another row decodes: the static step also runs the rows
    # being prefilled, which must not disturb what their chunks already wrote.
    with static.serve(prefill_chunk=2) as engine:
        first = engine.submit(prompts[0], 12, temperature=0)
        tokens = iter(first)
        head = [next(tokens).token]
        others = [engine.submit(p, 12, temperature=0) for p in prompts[1:]]
        assert head + [c.token for c in tokens] == expected_tokens[0]
        assert [[c.token for c in s] for s in others] == expected_tokens[1:]
        assert max(len(p) for p in prompts) > 2


def test_int8_weights_quantized_from_a_cpu_llama_compile(meta_ckpt_dir, tokenizer):
    # A CPU Llama holds column-major float weights; quantizing them must still give row-major int8, which
    # the compiled int8 product needs.
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    llama = build_llama(meta_ckpt_dir, max_batch_size=4)
    quantize_int8(llama.model)
    assert all(m.weight.is_contiguous() for m in llama.model.modules() if isinstance(m, Int8Linear))
    prompts = _prompts(tokenizer)
    eager, _ = llama.generate(prompts, 12, temperature=0)
    llama.runner.decode_step = DecodeStep(llama.model, 4, compile=True)
    assert llama.generate(prompts, 12, temperature=0)[0] == eager


def test_decode_rows_and_prompts_in_one_forward_equal_separate_forwards(meta_ckpt_dir, tokenizer):
    import torch

    from llama_core.runner import right_padded
    from llama_core.model import Span

    llama = build_llama(meta_ckpt_dir, max_batch_size=5)
    model = llama.model
    prompts = _prompts(tokenizer)
    decoding, joining = prompts[:2], [prompts[2], prompts[0] + prompts[1][1:]]
    tokens, positions, lengths = right_padded(decoding, 0, llama.device)
    join_tokens, join_positions, join_lengths = right_padded(joining, 0, llama.device)
    join_rows = torch.tensor([4, 2])
    with torch.inference_mode():
        model(tokens, positions, cache_rows=slice(0, 2), kv_len=tokens.shape[1])  # rows 0-1 are decoding
        cache = [(a.kv_cache.k_cache.clone(), a.kv_cache.v_cache.clone()) for a in (l.attention for l in model.layers)]
        step = torch.tensor([5, 9])
        expected_step = model(step[:, None], lengths[:, None], cache_rows=slice(0, 2), kv_len=int(lengths.max()) + 1)[:, 0]
        expected_join = model(join_tokens, join_positions, cache_rows=join_rows, kv_len=join_tokens.shape[1],
                              logit_index=join_lengths - 1)[:, 0]
        for layer, (k, v) in zip(model.layers, cache):  # back to before, then both in one forward
            layer.attention.kv_cache.k_cache.copy_(k)
            layer.attention.kv_cache.v_cache.copy_(v)
        got_step, got_join = model.forward_spans([
            Span(step[:, None], lengths[:, None], slice(0, 2), int(lengths.max()) + 1, torch.zeros(2, dtype=torch.long)),
            Span(join_tokens, join_positions, join_rows, join_tokens.shape[1], join_lengths - 1),
        ])
    assert torch.allclose(got_step, expected_step, atol=1e-4)
    assert torch.allclose(got_join, expected_join, atol=1e-4)


def test_cpu_compiled_step_decodes_as_eager_does_with_the_one_graph_compiled_at_its_warm_up(meta_ckpt_dir,
                                                                                          tokenizer):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    from torch._dynamo.utils import counters

    eager = build_llama(meta_ckpt_dir, max_batch_size=4)
    compiled = build_llama(meta_ckpt_dir, max_batch_size=4, compile=True)  # warmed up by its first generation
    assert compiled.runner.decode_step.leading_rows and not compiled.runner.mixes_prompts
    graphs = counters["stats"]["unique_graphs"]
    prompts = _prompts(tokenizer)
    for batch in (prompts, prompts[1:2], [prompts[2], prompts[0]]):
        expected_tokens, expected_lps = eager.generate(batch, 12, temperature=0, logprobs=True)
        tokens, lps = compiled.generate(batch, 12, temperature=0, logprobs=True)
        assert tokens == expected_tokens
        for got, want in zip(lps, expected_lps):
            assert got == pytest.approx(want, abs=1e-4)
    # Rows far apart, a slot freed in the middle, prompts prefilled in chunks while others decode.
    expected = eager.generate(prompts, 12, temperature=0)[0]
    with compiled.serve(prefill_chunk=2) as engine:
        first = iter(engine.submit(prompts[0], 12, temperature=0))
        head = [next(first).token]
        others = [engine.submit(p, 12, temperature=0) for p in prompts[1:]]
        assert head + [c.token for c in first] == expected[0]
        assert [[c.token for c in s] for s in others] == expected[1:]
    assert counters["stats"]["unique_graphs"] == graphs + 1, "the compiled step was compiled again after its warm-up"


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_model_compiles_on_the_cpu_and_decodes_as_eager_does(monkeypatch, meta_ckpt_dir, tokenizer,
                                                                         quantize):
    """The quantized layers choose their CPU kernel before the step is traced (choosing loads the kernels,
    the first time under a lock, which dynamo refuses: loading failed, reported as the model not fitting)."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    from llama_core.cpu_kernels import build

    monkeypatch.setattr(build, "_loaded", {})  # as in a fresh process: the kernels not loaded yet
    compiled = build_llama(meta_ckpt_dir, max_batch_size=2, quantize=quantize, compile=True)
    eager = build_llama(meta_ckpt_dir, max_batch_size=2, quantize=quantize)
    prompts = _prompts(tokenizer)[:2]
    expected_tokens, expected_lps = eager.generate(prompts, 8, temperature=0, logprobs=True)
    tokens, lps = compiled.generate(prompts, 8, temperature=0, logprobs=True)
    assert tokens == expected_tokens
    for got, want in zip(lps, expected_lps):  # activations rounded as the kernel rounds them, summed in float: an
        assert got == pytest.approx(want, abs=0.05)  # 8-bit activation's rounding may fall the other way


def test_a_cpu_compiled_step_serves_more_rows_than_the_eager_path_splits_its_products_at(meta_ckpt_dir, tokenizer):
    """From SEPARATE_PRODUCTS_FROM_ROWS rows the eager CPU path splits stacked projections; the compiled step
    must not branch on its symbolic row count, or its one graph would hold only below that (with 32 slots it
    failed to compile at start-up)."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    from llama_core.model import SEPARATE_PRODUCTS_FROM_ROWS

    rows = SEPARATE_PRODUCTS_FROM_ROWS + 4
    eager = build_llama(meta_ckpt_dir, max_batch_size=rows)
    compiled = build_llama(meta_ckpt_dir, max_batch_size=rows, compile=True)
    prompts = [tokenizer.encode(f"Once upon a time {word}", bos=True, eos=False)
               for word in "the a one two three four five six seven eight nine ten red blue green old young sad".split()]
    prompts = (prompts * 2)[:rows]
    expected_tokens, expected_lps = eager.generate(prompts, 8, temperature=0, logprobs=True)
    tokens, lps = compiled.generate(prompts, 8, temperature=0, logprobs=True)
    assert tokens == expected_tokens
    for got, want in zip(lps, expected_lps):
        assert got == pytest.approx(want, abs=1e-4)


def test_to_device_on_cpu_keeps_values_and_dtype():
    import torch

    from llama_core.devices import to_device

    cpu = torch.device("cpu")
    assert to_device([3, 1, 2], cpu).tolist() == [3, 1, 2] and to_device([3, 1], cpu).dtype == torch.long
    assert to_device([[1.0], [2.0]], cpu, torch.long).dtype == torch.long
    host = torch.arange(4)
    assert to_device(host, cpu) is host


def test_the_static_steps_context_length_covers_the_rows_in_powers_of_two(meta_ckpt_dir):
    model = build_llama(meta_ckpt_dir, max_batch_size=2).model  # a 128-position cache
    step = DecodeStep(model, 2, static=True, smallest_context=16)
    assert [step.context_length(n) for n in (1, 16, 17, 32, 33, 100, 128)] == [16, 16, 32, 32, 64, 128, 128]
    assert DecodeStep(model, 2, static=True).context_length(1) == 128  # never past the cache


@pytest.mark.parametrize("max_batch_size", [4, 96])
def test_the_static_cuda_steps_graphs_are_all_traced_in_warm_up_with_their_options(meta_ckpt_dir, monkeypatch,
                                                                                    max_batch_size):
    # One row: coordinate-descent tuning (its products become tuned reductions); more rows: CUDA graphs only
    # (its tuned compile had not ended after 300 s for a 7B on an H100). Warm-up traces every graph serving needs,
    # each with the model's floats as constants (under torch 2.11 dynamo otherwise guards each one with a .item()
    # on every call); with llama_core's Triton products past 64 slots, the many-row step has a graph up to 64 rows
    # (the kernel's) and one past (cuBLAS's), else the first step of a few rows compiled again while serving.
    import torch

    from llama_core import quantize, runner

    compiled = []

    def fake_compile(function, options=None, **kwargs):
        calls = []
        compiled.append({"function": function.__name__, "options": options, "kwargs": kwargs, "calls": calls})

        def run(tokens, positions, kv_len):
            calls.append((tokens.shape[0], torch._dynamo.config.specialize_float))
            return torch.zeros(tokens.shape[0], 3)

        return run

    class TritonProducts:
        MAX_ROWS = 64

    model = build_llama(meta_ckpt_dir, max_batch_size=4).model
    quantize_int8(model)
    monkeypatch.setattr(quantize, "_TRITON_ROWS", TritonProducts)
    monkeypatch.setattr(quantize, "_TRITON_LOOKED_FOR", True)
    monkeypatch.setattr(DecodeStep, "_device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(runner.torch, "compile", fake_compile)
    monkeypatch.setattr(torch, "full", lambda size, value, device=None: torch.zeros(size, dtype=torch.long) + value)
    step = DecodeStep(model, max_batch_size, static=True, compile=True, smallest_context=16)
    step.warm_up()
    one_row, many_rows = compiled
    assert one_row["options"] == {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    assert many_rows["options"] == {"triton.cudagraphs": True}
    assert one_row["kwargs"] == many_rows["kwargs"] == {"fullgraph": True, "dynamic": True}
    warmed = [4] if max_batch_size == 4 else [64, 96]
    assert one_row["calls"] == [(1, True)] * 3
    assert many_rows["calls"] == [(rows, True) for rows in warmed for _ in range(3)]
    with torch.inference_mode():
        step._step(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 16)
        step._step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 16)
    assert many_rows["calls"][-1] == (2, False) and one_row["calls"][-1] == (1, False)


def test_a_step_warmed_up_again_traces_with_floats_as_constants_again(meta_ckpt_dir):
    # The patch was switched off after the first warm-up, for good: a second (serve() after generate()) traced
    # without it, and under torch 2.11 a retrace then guarded every float with a host read per step (CUDA review).
    from llama_core.runner import _FloatsAsConstants

    step = DecodeStep(build_llama(meta_ckpt_dir, max_batch_size=2).model, 2)
    step._traced = [_FloatsAsConstants(lambda *args: None)]
    seen = []
    step._warm_up = lambda: seen.append(step._traced[0].tracing)
    step.warm_up()
    assert seen == [True] and not step._traced[0].tracing  # serving skips the patch
    step.warm_up()
    assert seen == [True, True] and not step._traced[0].tracing


def test_a_compiled_static_step_compiles_when_warmed_up_and_not_again_across_lengths(meta_ckpt_dir):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    import torch
    from torch._dynamo.utils import counters

    llama = build_llama(meta_ckpt_dir, max_batch_size=2, compile=True)  # a spare position past the context
    step = DecodeStep(llama.model, 2, compile=True, static=True, smallest_context=16, context=llama.max_seq_len)
    counters.clear()
    step.warm_up()
    assert counters["stats"]["unique_graphs"] == 2  # one row, and a symbolic row count
    with torch.inference_mode():
        for position in (3, 20, 40, 100, llama.max_seq_len - 1):  # lengths 16, 32, 64, 128, 128
            step(torch.tensor([5, 6]), torch.tensor([position, 2]), slice(0, 2), position + 1)
            step(torch.tensor([5]), torch.tensor([position]), slice(0, 1), position + 1)  # one row
            step(torch.tensor([5]), torch.tensor([position]), slice(1, 2), position + 1)  # rows 0 and 1
    assert counters["stats"]["unique_graphs"] == 2
    # A call reads nothing back to the host, its guards included: torch 2.11 guarded each RMSNorm's eps
    # and rope_theta with a tensor's .item() on every call unless traced with floats as constants.
    from torch.profiler import profile

    with torch.inference_mode(), profile() as prof:
        step(torch.tensor([5, 6]), torch.tensor([7, 2]), slice(0, 2), 8)
    reads = [e.name for e in prof.events() if e.name in ("aten::item", "aten::_local_scalar_dense")]
    assert reads == []


@pytest.mark.parametrize("seq_len", [1, 5])
def test_grouped_query_attention_equals_sdpas_own(seq_len):
    import torch
    import torch.nn.functional as F

    from llama_core.model import _causal_mask, grouped_query_attention

    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 2, 8, 2, 12, 16
    q = torch.randn(batch, seq_len, heads, head_dim, generator=gen).transpose(1, 2)  # as the model's: strided
    k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=gen) for _ in range(2))
    positions = torch.tensor([[3 + i for i in range(seq_len)], [6 + i for i in range(seq_len)]])
    mask = _causal_mask(positions, length, torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), expected)


def test_the_static_step_runs_the_fewest_leading_rows_and_new_requests_take_the_lowest_slots(meta_ckpt_dir, tokenizer):
    llama = build_llama(meta_ckpt_dir, max_batch_size=4)
    prompts = _prompts(tokenizer)
    expected, _ = build_llama(meta_ckpt_dir, max_batch_size=4).generate(prompts, 6, temperature=0)
    step = DecodeStep(llama.model, 4, static=True, smallest_context=16)
    llama.runner.decode_step = step
    assert [step.row_count(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert DecodeStep(llama.model, 4).slots_to_fill([2, 3], [0]) == [2, 3]  # the dynamic step: any
    assert step.slots_to_fill([0, 1, 2, 3], []) == [0]
    assert step.slots_to_fill([1, 2, 3], [0]) == [1]
    assert step.slots_to_fill([2, 3], [0, 1]) == [2, 3]
    assert step.slots_to_fill([0, 2, 3], [1]) == [0]  # below the 2 rows the busy slot needs
    assert step.slots_to_fill([1, 2], [3]) == [1, 2]
    counts = []
    run = step._step
    step._step = lambda tokens, positions, kv_len: (counts.append(tokens.shape[0]), run(tokens, positions, kv_len))[1]
    with llama.serve() as engine:
        for _ in range(2):  # one request at a time: each decodes one row, in slot 0
            for prompt, tokens in zip(prompts, expected):
                counts.clear()
                assert [c.token for c in engine.submit(prompt, 6, temperature=0)] == tokens
                assert set(counts) == {1}
        counts.clear()
        streams = [engine.submit(p, 6, temperature=0) for p in prompts]
        assert [[c.token for c in s] for s in streams] == expected
        assert max(counts) == 4  # three at once: rows 0..3
