"""Parity with transformers' LlamaForCausalLM on the same random GQA weights, in float32, for every
checkpoint layout: prompt log-probabilities and greedy continuations must match the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import LAYOUTS, MAX_SEQ_LEN, build_hf_model, build_llama, hf_greedy, hf_logits
from llama_core import InvalidRequestError

GREEDY_TOKENS = 40
MIN_GREEDY_TOKENS = 32


def prompts(tokenizer) -> list[list[int]]:
    long_text = "def forward(self, tokens, input_pos=None):\n    return self.output(self.norm(h)).float()\n"
    return [
        [tokenizer.bos_id],
        tokenizer.encode("Once upon a time", bos=True, eos=False),
        tokenizer.encode("héllo wörld 🙂", bos=True, eos=False),
        tokenizer.encode(long_text, bos=True, eos=False),
    ]


@pytest.fixture(scope="module", params=LAYOUTS)
def layout_llama(request, ckpt_dirs):
    return build_llama(ckpt_dirs[request.param])


def test_fixture_prompts_cover_long_positions(tokenizer):
    # The longest prompt plus its continuation must reach well into the 128-position context.
    assert len(prompts(tokenizer)[-1]) + GREEDY_TOKENS > 80


@pytest.mark.parametrize("prompt_index", range(4))
def test_prompt_logprobs_match_hf(layout_llama, hf_model, tokenizer, prompt_index):
    prompt = prompts(tokenizer)[prompt_index]
    tokens, logprobs = layout_llama.generate([prompt], max_gen_len=1, temperature=0, logprobs=True, echo=True)
    tokens, logprobs = tokens[0], logprobs[0]
    assert tokens[: len(prompt)] == prompt
    assert len(tokens) == len(prompt) + 1 and len(logprobs) == len(tokens)

    reference = torch.log_softmax(hf_logits(hf_model, tokens), dim=-1)
    expected = [0.0] + [float(reference[i - 1, tokens[i]]) for i in range(1, len(tokens))]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_full_logits_match_hf(layout_llama, hf_model, tokenizer):
    prompt = prompts(tokenizer)[-1]
    with torch.inference_mode():
        ours = layout_llama.model(torch.tensor([prompt]), kv_len=len(prompt))[0]
    reference = hf_logits(hf_model, prompt)
    torch.testing.assert_close(
        torch.log_softmax(ours, -1), torch.log_softmax(reference, -1), atol=1e-4, rtol=0
    )
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_unfused_projections_match_hf(tiny_args, tiny_state_dict, hf_model, tokenizer):
    # The model as constructed (separate wq, wk, wv, w1, w3), before Llama fuses them for inference.
    from llama_core.model import Transformer

    model = Transformer(tiny_args)
    model.load_state_dict(tiny_state_dict)
    prompt = prompts(tokenizer)[-1]
    with torch.inference_mode():
        ours = model(torch.tensor([prompt]))[0]
    torch.testing.assert_close(
        torch.log_softmax(ours, -1), torch.log_softmax(hf_logits(hf_model, prompt), -1), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("prompt_index", range(4))
def test_greedy_continuation_matches_hf(layout_llama, hf_model, tokenizer, prompt_index):
    prompt = prompts(tokenizer)[prompt_index]
    expected, min_gap = hf_greedy(hf_model, prompt, GREEDY_TOKENS, tokenizer.eos_id)
    # Guards on the fixture, not the package: enough tokens, and no near-tie that float noise could flip
    # (the two implementations' logits differ by about 1e-5 here).
    assert len(expected) >= MIN_GREEDY_TOKENS, "fixture model emits EOS too early for this prompt"
    assert min_gap > 1e-4, f"fixture model has a near-tie (gap {min_gap:.2e}); greedy comparison would be fragile"

    tokens, logprobs = layout_llama.generate([prompt], max_gen_len=GREEDY_TOKENS, temperature=0, logprobs=True)
    assert tokens[0] == expected

    reference = torch.log_softmax(hf_logits(hf_model, prompt + expected), dim=-1)
    start = len(prompt) - 1
    expected_lps = [float(reference[start + i, t]) for i, t in enumerate(expected)]
    torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(expected_lps), atol=1e-4, rtol=0)



def test_cpu_weights_are_column_major_and_compute_the_same(meta_ckpt_dir, tokenizer, monkeypatch):
    # Without llama_core's CPU kernels (no compiler), the plain products run on column-major weights: it is
    # in effect, and changes nothing but rounding. (The parity tests above run on the panel kernels.)
    monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
    llama = build_llama(meta_ckpt_dir)
    projections = [m.weight for m in llama.model.modules() if isinstance(m, torch.nn.Linear)]
    assert projections and all(w.stride() == (1, w.shape[0]) for w in projections)
    prompt = torch.tensor([prompts(tokenizer)[-1]])
    with torch.inference_mode():
        column_major = llama.model(prompt, kv_len=prompt.shape[1])
        for module in llama.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(module.weight.contiguous(), requires_grad=False)
        row_major = llama.model(prompt, kv_len=prompt.shape[1])
    torch.testing.assert_close(column_major, row_major, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["panels", "onednn"])
def test_weights_in_a_cpu_layout_match_hf(layout, meta_ckpt_dir, hf_model, tokenizer, monkeypatch):
    # On CPU the projections run in llama_core's panel kernels (cpu_kernels) where they build, else in
    # oneDNN's layout for weights of at least MIN_PACKED_WEIGHTS; the fixture's are smaller, so pack all.
    from llama_core import cpu_kernels, packed_linear

    if layout == "panels":
        if not cpu_kernels.available():
            pytest.skip("llama_core's CPU kernels are not used here (no C compiler, or neither AVX-512 nor AVX2)")
        layer_type = cpu_kernels.PanelLinear
    else:
        if not packed_linear.packing_available():
            pytest.skip("this torch build has no oneDNN: weights stay in MKL's layout")
        monkeypatch.setenv("LLAMA_CORE_CPU_KERNELS", "0")
        monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHTS", 0)
        layer_type = packed_linear.PackedLinear
    llama = build_llama(meta_ckpt_dir)
    assert not [m for m in llama.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len([m for m in llama.model.modules() if isinstance(m, layer_type)]) > 0
    for prompt in prompts(tokenizer):
        expected, _ = hf_greedy(hf_model, prompt, GREEDY_TOKENS, tokenizer.eos_id)
        tokens, logprobs = llama.generate([prompt], max_gen_len=GREEDY_TOKENS, temperature=0, logprobs=True)
        assert tokens[0] == expected
        reference = torch.log_softmax(hf_logits(hf_model, prompt + expected), dim=-1)
        expected_lps = [float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(expected)]
        torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(expected_lps), atol=1e-4, rtol=0)


def test_a_padded_vocabulary_matches_hf_and_its_padding_is_never_drawn(tmp_path, tiny_args, tiny_state_dict,
                                                                       tokenizer_path, tokenizer):
    """A fine-tune's vocabulary padded past the tokenizer's pieces (Llama-2's 32,000 as 32001 or 32032 rows):
    the same logits as transformers, and greedy the same as transformers' restricted to the pieces (the rows
    past them have no text). Their output rows are made large enough to win, unrestricted."""
    padding = tokenizer.n_words // 64
    args = dataclasses.replace(tiny_args, vocab_size=tokenizer.n_words + padding)
    generator = torch.Generator().manual_seed(7)
    state = dict(tiny_state_dict)
    state["tok_embeddings.weight"] = torch.cat([state["tok_embeddings.weight"], torch.randn(padding, args.dim,
                                                                                             generator=generator)])
    state["output.weight"] = torch.cat([state["output.weight"],
                                        8 * torch.randn(padding, args.dim, generator=generator)])
    hf = build_hf_model(state, args, MAX_SEQ_LEN)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_path.read_bytes())
    llama = build_llama(tmp_path)
    prompt = prompts(tokenizer)[0]
    with torch.inference_mode():
        ours = llama.model(torch.tensor([prompt]), kv_len=len(prompt))[0]
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=1e-4, rtol=1e-5)  # the padding: large logits
    assert (ours.argmax(-1) >= tokenizer.n_words).any()  # the padding would win unrestricted

    generated = llama.generate([prompt], 24, temperature=0, logprobs=True)
    tokens, reference = generated[0][0], []
    for _ in range(len(tokens)):
        reference.append(int(hf_logits(hf, prompt + reference)[-1, : tokenizer.n_words].argmax()))
    assert tokens == reference and max(tokens) < tokenizer.n_words
    sampled = llama.generate([prompt], 24, temperature=1.0, top_p=1.0, seed=3)[0][0]
    assert max(sampled) < tokenizer.n_words
    with pytest.raises(InvalidRequestError, match=rf"token ids are integers from 0 to {tokenizer.n_words - 1}"):
        llama.generate([[1, tokenizer.n_words]], 4)  # a padding row's id has no text: not a prompt token
