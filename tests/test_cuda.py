"""The CUDA path: the same answers as the CPU reference in float32, close ones in bfloat16, int8 and int4, and
the compiled decode step (CUDA graphs) equal to the eager one, through generate and the engine; and the
real trained stories260K model greedy on CUDA as on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from llama_core.devices import to_device
from llama_core.serving import Engine
from llama_core import int4, quantize
from llama_core.int4 import Int4Linear
from llama_core.quantize import Int8Linear

from conftest import STORIES_DIR, build_llama, greedy_concurrently, hf_greedy, hf_logits, needs_stories

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts(tokenizer) -> list[list[int]]:
    texts = ("Once upon a time", "The", "def forward(self, tokens, input_pos=None):", "héllo wörld 🙂 the king")
    return [tokenizer.encode(t, bos=True, eos=False) for t in texts]


@pytest.fixture(scope="module")
def cuda_fp32(meta_ckpt_dir):
    return build_llama(meta_ckpt_dir, device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def cpu_fp32(meta_ckpt_dir):
    return build_llama(meta_ckpt_dir)


def test_cuda_float32_logprobs_match_hf(cuda_fp32, hf_model, tokenizer):
    for prompt in _prompts(tokenizer):
        tokens, lps = cuda_fp32.generate([prompt], 1, temperature=0, logprobs=True, echo=True)
        reference = torch.log_softmax(hf_logits(hf_model, tokens[0]), dim=-1)
        expected = [0.0] + [float(reference[i - 1, t]) for i, t in enumerate(tokens[0]) if i > 0]
        torch.testing.assert_close(torch.tensor(lps[0]), torch.tensor(expected), atol=2e-4, rtol=0)


def test_cuda_float32_greedy_batch_matches_hf(cuda_fp32, hf_model, tokenizer):
    prompts = _prompts(tokenizer)
    tokens, _ = cuda_fp32.generate(prompts, 24, temperature=0)
    for prompt, got in zip(prompts, tokens):
        expected, gap = hf_greedy(hf_model, prompt, 24)
        assert gap > 1e-3, "reference has a near-tie: the comparison would be meaningless"
        assert got == expected


def test_bfloat16_stays_close_to_float32(meta_ckpt_dir, cpu_fp32, tokenizer):
    bf16 = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16")
    prompt = _prompts(tokenizer)[2]
    with torch.inference_mode():
        ref = torch.log_softmax(cpu_fp32.model(torch.tensor([prompt]), kv_len=len(prompt))[0], -1)
        got = torch.log_softmax(bf16.model(torch.tensor([prompt], device="cuda"), kv_len=len(prompt))[0], -1).cpu()
    probs = ref.exp()
    # Expected |difference| under the reference distribution: bf16 keeps ~3 significant digits.
    assert float((probs * (got - ref).abs()).sum(-1).max()) < 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.9


def _cuda_graph_skips() -> int:
    """How many compiled graphs inductor ran without CUDA graphs (it says why in its log): the compiled step
    gives the same tokens without them, only slower, so the tests ask."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def test_compiled_cuda_graph_decode_equals_eager(meta_ckpt_dir, tokenizer):
    skips = _cuda_graph_skips()
    eager = build_llama(meta_ckpt_dir, device="cuda", dtype="float32")
    compiled = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", compile=True)
    prompts = _prompts(tokenizer)
    expected, expected_lps = eager.generate(prompts, 20, temperature=0, logprobs=True)
    for _ in range(2):  # the second call replays the captured graph
        tokens, lps = compiled.generate(prompts, 20, temperature=0, logprobs=True)
        assert tokens == expected
        for got, want in zip(lps, expected_lps):
            assert got == pytest.approx(want, abs=1e-4)
    # Fewer rows than the graph was captured for, then the engine's loop thread.
    assert compiled.generate(prompts[:1], 20, temperature=0)[0] == expected[:1]
    with compiled.serve() as engine:
        streams = [engine.submit(p, 20, temperature=0) for p in prompts]
        assert [[c.token for c in s] for s in streams] == expected
    assert _cuda_graph_skips() == skips


def test_compiled_decode_over_growing_context_lengths_equals_eager(meta_ckpt_dir, tokenizer):
    eager = build_llama(meta_ckpt_dir, device="cuda", dtype="float32")
    compiled = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", compile=True)
    # Lengths 16, 32, 64 and 128: the step compiled by the first generation, a CUDA graph captured for each.
    compiled.runner.decode_step.smallest_context = 16
    prompts = _prompts(tokenizer)
    expected, expected_lps = eager.generate(prompts, 80, temperature=0, logprobs=True)
    for _ in range(2):
        tokens, lps = compiled.generate(prompts, 80, temperature=0, logprobs=True)
        assert tokens == expected
        for got, want in zip(lps, expected_lps):
            assert got == pytest.approx(want, abs=1e-4)


def _assert_greedy_under(reference, prompts, tokens, lps, tol):
    """Each generated token is, within tol nats, the reference model's most likely one, with its logprob."""
    for prompt, generated, generated_lps in zip(prompts, tokens, lps):
        sequence = prompt + generated
        with torch.inference_mode():
            logits = reference.model(torch.tensor([sequence], device=reference.device), kv_len=len(sequence))[0]
        scores = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).cpu()
        chosen = scores[torch.arange(len(generated)), torch.tensor(generated)]
        assert float((scores.max(-1).values - chosen).max()) < tol
        assert generated_lps == pytest.approx(chosen.tolist(), abs=tol)


def test_compiled_bfloat16_decode_is_greedy_under_the_eager_model(meta_ckpt_dir, tokenizer):
    # In bf16 compiled and eager kernels round differently, so near-ties may resolve differently.
    eager = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16")
    compiled = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16", compile=True)
    prompts = _prompts(tokenizer)
    tokens, lps = compiled.generate(prompts, 20, temperature=0, logprobs=True)
    assert all(len(t) == 20 for t in tokens)
    _assert_greedy_under(eager, prompts, tokens, lps, tol=0.1)


def test_engine_on_cuda_concurrent_equals_solo(meta_ckpt_dir, tokenizer):
    llama = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", max_batch_size=4)
    prompts = _prompts(tokenizer) * 2
    solo = [llama.generate([p], 16, temperature=0)[0][0] for p in prompts]
    with llama.serve() as engine:
        assert greedy_concurrently(engine, prompts, 16) == solo


def test_sampling_on_cuda_is_seeded_and_respects_top_p(meta_ckpt_dir, tokenizer):
    prompts = _prompts(tokenizer)
    runs = [build_llama(meta_ckpt_dir, device="cuda", seed=5).generate(prompts, 16, temperature=1.0, top_p=0.9)[0]
            for _ in range(2)]
    assert runs[0] == runs[1]
    llama = build_llama(meta_ckpt_dir, device="cuda", seed=6)
    # top_p tiny: only the most likely token survives, so sampling is greedy.
    greedy = llama.generate(prompts, 16, temperature=0)[0]
    assert llama.generate(prompts, 16, temperature=1.0, top_p=1e-6)[0] == greedy


@pytest.mark.filterwarnings("error:llama_core. the Triton int8/int4 products failed:RuntimeWarning")
def test_int8_on_cuda_is_close_and_compiles(meta_ckpt_dir, cpu_fp32, tokenizer):
    llama = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16", quantize="int8")
    assert isinstance(llama.model.layers[0].attention.wqkv, Int8Linear)
    prompt = _prompts(tokenizer)[2]
    with torch.inference_mode():
        ref = torch.log_softmax(cpu_fp32.model(torch.tensor([prompt]), kv_len=len(prompt))[0], -1)
        got = torch.log_softmax(llama.model(torch.tensor([prompt], device="cuda"), kv_len=len(prompt))[0], -1).cpu()
    assert float((ref.exp() * (got - ref).abs()).sum(-1).max()) < 0.1
    # Compiled as serving compiles it: the runner's cache with its spare position, warmed up before the first
    # generation (Llama.warm_up, in generate's thread).
    compiled = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16", quantize="int8", compile=True)
    tokens, lps = compiled.generate(_prompts(tokenizer), 12, temperature=0, logprobs=True)
    assert all(len(t) == 12 for t in tokens)
    # The compiled step's one-row kernel against the eager forward's tensor-core one, each rounding the layers'
    # bf16 activations its own way: one of 48 logprobs differed by 0.117 on an H100 (2026-11-27).
    _assert_greedy_under(llama, _prompts(tokenizer), tokens, lps, tol=0.15)


@pytest.mark.filterwarnings("error:llama_core. the Triton int8/int4 products failed:RuntimeWarning")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quantized_kernels_are_the_dequantized_product_eager_and_compiled(dtype, kind):
    # llama_core.triton_products multiplies a few rows (decoding) by the int8 or int4 weight as it reads it: the
    # same as the dequantized product in float32 rounded once, at one row (a reduction) and at 2-64 (tensor
    # cores), eager and inside compiled functions (the triton_op inductor places in its code), with the row
    # count fixed and symbolic (as in the decode step).
    if not quantize.triton_rows():
        pytest.skip("this CUDA build of torch has no triton (or LLAMA_CORE_TRITON_PRODUCTS=0)")
    torch.manual_seed(0)
    weight = torch.randn(11008, 4096, device="cuda", dtype=dtype) * 0.02
    layer = Int8Linear(weight) if kind == "int8" else Int4Linear(weight)
    dequantized = (layer.weight.float() * layer.scales.float()[:, None] if kind == "int8"
                   else layer.dequantized(torch.float32))
    # Compiled in bfloat16 only, with few shapes: each compile takes seconds, and tests_cuda has 170 s.
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    any_rows = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (1, 2, 5, 16, 17, 64):
        x = torch.randn(rows, 1, 4096, device="cuda", dtype=dtype)
        want = x.float() @ dequantized.T
        runs = [layer(x)]
        if dtype == torch.bfloat16:
            runs += [compiled(x)] if rows in (1, 17) else [any_rows(x)]
        for got in runs:
            assert got.shape == (rows, 1, 11008) and got.dtype == dtype
            assert float((got.float() - want).abs().max() / want.abs().max()) < 8e-3, rows
    prompt = torch.randn(65, 4096, device="cuda", dtype=dtype)  # past MAX_ROWS: the dequantized product
    plain = (torch.nn.functional.linear(prompt, layer.weight.to(dtype)) * layer.scales if kind == "int8"
             else torch.nn.functional.linear(prompt, layer.dequantized(dtype)))
    torch.testing.assert_close(layer(prompt), plain)


@pytest.mark.filterwarnings("error:llama_core. the Triton int8/int4 products failed:RuntimeWarning")
def test_int4_on_cuda_is_close_to_the_cpus_and_compiles(meta_ckpt_dir, tokenizer, monkeypatch):
    # The same 4-bit weights (quantized on each device alike), multiplied on the CPU as on CUDA: the dequantized
    # weight in a plain product. The CPU's own products round the activations to 8 bits (llama_core's kernels,
    # and fbgemm's for the int8 output layer): 0.08 and 0.013 from the plain products, seen on an H100.
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
    monkeypatch.setattr(int4, "_TORCH_INT4", None)
    monkeypatch.setattr(quantize, "_REDUCE_RANGE", None)
    monkeypatch.setattr(quantize, "_reduce_range", lambda: False)
    cpu_int4 = build_llama(meta_ckpt_dir, quantize="int4")
    llama = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", quantize="int4")
    assert llama.loaded.info.quantization == "int4"
    assert isinstance(llama.model.layers[0].attention.wqkv, Int4Linear)
    assert isinstance(llama.model.output, Int8Linear)
    prompt = _prompts(tokenizer)[2]
    with torch.inference_mode():
        ref = torch.log_softmax(cpu_int4.model(torch.tensor([prompt]), kv_len=len(prompt))[0], -1)
        got = torch.log_softmax(llama.model(torch.tensor([prompt], device="cuda"), kv_len=len(prompt))[0], -1).cpu()
    assert float((ref.exp() * (got - ref).abs()).sum(-1).max()) < 0.002
    eager = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16", quantize="int4")
    compiled = build_llama(meta_ckpt_dir, device="cuda", dtype="bfloat16", quantize="int4", compile=True)
    tokens, lps = compiled.generate(_prompts(tokenizer), 12, temperature=0, logprobs=True)
    assert all(len(t) == 12 for t in tokens)
    _assert_greedy_under(eager, _prompts(tokenizer), tokens, lps, tol=0.1)


@needs_stories
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_stories260k_greedy_on_cuda_equals_cpu_float32(compile):
    def build(device, **options):
        return build_llama(STORIES_DIR, device=device, dtype="float32", max_seq_len=256, **options)

    cpu, cuda = build("cpu"), build("cuda", compile=compile)
    bos = cpu.tokenizer.bos_id
    prompts = [[bos], [bos, 300, 301, 302, 13, 400, 77, 200, 150], cpu.tokenizer.encode("Once upon a time", bos=True, eos=False)]
    expected, expected_lps = cpu.generate(prompts, 96, temperature=0, logprobs=True)
    assert all(len(t) >= 20 for t in expected), "the CPU run must say something to compare"
    for _ in range(2 if compile else 1):  # compiled: capture, then replay
        tokens, lps = cuda.generate(prompts, 96, temperature=0, logprobs=True)
        assert tokens == expected
        for got, want in zip(lps, expected_lps):
            assert got == pytest.approx(want, abs=1e-4)


def test_host_values_reach_the_gpu_without_a_sync():
    cuda = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode is on: a plain copy from the host synchronises
            torch.tensor([1, 2, 3], device=cuda)
        from_list, from_tensor = to_device([1, 2, 3], cuda), to_device(torch.arange(3), cuda)
        as_long = to_device([[0.0], [1.0]], cuda, torch.long)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert from_list.device.type == "cuda" and from_list.tolist() == [1, 2, 3] and from_tensor.tolist() == [0, 1, 2]
    assert as_long.dtype == torch.long and as_long.tolist() == [[0], [1]]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_overlapped_engine_on_cuda_equals_the_synchronous_one(meta_ckpt_dir, tokenizer, compile):
    llama = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", compile=compile)
    prompts = _prompts(tokenizer)
    results = {}
    for overlap in (False, True):
        engine = Engine(llama.loaded, seed=0, overlap=overlap)
        engine.warm_up()  # as serve() does: compiled and captured before the first request, floats as constants
        assert engine.overlap == overlap
        streams = [engine.submit(p, 10 + 5 * i, temperature=0.8 if i % 2 else 0, top_p=0.9, seed=i, top_logprobs=2)
                   for i, p in enumerate(prompts)]
        results[overlap] = [([(c.token, c.logprob, c.top_logprobs) for c in s], s.finish_reason) for s in streams]
        engine.close()
    assert results[True] == results[False]
    engine = Engine(llama.loaded)
    assert engine.overlap and engine.prefill_chunk == 2048  # the defaults on CUDA


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_float16_kv_cache_on_cuda_equals_the_cpu_path_over_the_same_cache(meta_ckpt_dir, tokenizer, compile):
    """A float32 model on CUDA with its keys and values in float16 (eager, and in the compiled step's CUDA
    graphs): the greedy tokens of the CPU's float32 model with the same float16 cache, log-probabilities close."""
    cpu = build_llama(meta_ckpt_dir, kv_cache_dtype="float16")
    cuda = build_llama(meta_ckpt_dir, device="cuda", dtype="float32", kv_cache_dtype="float16", compile=compile)
    assert cuda.model.layers[0].attention.kv_cache.k_cache.dtype == torch.float16
    prompts = _prompts(tokenizer)
    expected, expected_lps = cpu.generate(prompts, 20, temperature=0, logprobs=True)
    tokens, lps = cuda.generate(prompts, 20, temperature=0, logprobs=True)
    assert tokens == expected
    for got, want in zip(lps, expected_lps):
        assert got == pytest.approx(want, abs=2e-3)


@needs_stories
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_reply_held_to_a_grammar_on_cuda_is_the_cpus_beside_free_ones(compile):
    """A request with a grammar in an overlapped CUDA engine (the batch then runs without a step ahead), beside
    free requests and a logit bias: the same tokens as on the CPU in float32."""
    pytest.importorskip("llguidance", reason="llguidance is not installed (scripts/gpu_check.sh --carry brings it)")
    from llama_core import Grammar

    grammar = Grammar.json({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                             "age": {"type": "integer", "maximum": 99}},
                            "required": ["name", "age"], "additionalProperties": False})

    def run(device, **options):
        llama = build_llama(STORIES_DIR, device=device, dtype="float32", max_seq_len=256, max_batch_size=4, **options)
        engine = Engine(llama.loaded, seed=0)
        engine.warm_up()  # as serve() does
        prompt = llama.tokenizer.encode("Once upon a time", bos=True, eos=False)
        streams = [engine.submit(prompt, 40, temperature=0, grammar=grammar),
                   engine.submit(prompt, 40, temperature=0),
                   engine.submit(prompt, 40, temperature=0.8, seed=3, logit_bias={"13": -100})]
        tokens = [[c.token for c in s] for s in streams]
        engine.close()
        return tokens, llama.tokenizer.decode(tokens[0])

    (expected, text), (got, _) = run("cpu"), run("cuda", compile=compile)
    assert got == expected and set(json.loads(text)) == {"name", "age"}
