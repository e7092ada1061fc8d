"""Shared fixtures: a small SentencePiece tokenizer, a random tiny GQA Llama saved in four checkpoint
layouts (Meta single file, Meta two model-parallel shards, Hugging Face sharded safetensors, and the same
in the older sharded pytorch_model.bin files), the
Hugging Face LlamaForCausalLM holding the same weights as reference, and paths into ../shared.

Everything here is built from scratch in temporary directories; only fixtures named shared_* need
../shared (or the folder LLAMA_SHARED_DIR names, e.g. a copy carried to a GPU machine), and tests that use
them skip where it is absent.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import signal
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from llama_core import DEFAULT_CKPT_DIR, Llama, Tokenizer  # noqa: E402
from llama_core.checkpoint import load_model, permute_rotary  # noqa: E402
from llama_core.checkpoint_files import read_model_args  # noqa: E402
from llama_core.config import ModelArgs  # noqa: E402
from llama_core.model import Transformer  # noqa: E402

# The models here are tiny: one thread avoids oversubscribing small CPUs (and any job running beside the tests).
torch.set_num_threads(1)

shared_dir = Path(os.environ.get("LLAMA_SHARED_DIR") or Path(__file__).resolve().parents[2] / "shared").resolve()
LLAMA2_TOKENIZER = shared_dir / "llama2" / "tokenizer.model"
STORIES_DIR = shared_dir / "models" / "stories260K"

needs_llama2_tokenizer = pytest.mark.skipif(
    not LLAMA2_TOKENIZER.is_file(), reason=f"../shared not present: no Llama-2 tokenizer at {LLAMA2_TOKENIZER}"
)
needs_stories = pytest.mark.skipif(
    not (STORIES_DIR / "consolidated.00.pth").is_file(), reason=f"../shared not present: no stories260K at {STORIES_DIR}"
)

def engine_model_dir() -> Path:
    """The embedded default model, else ../shared's stories260K; skips the test where neither is present."""
    if (DEFAULT_CKPT_DIR / "params.json").is_file():
        return DEFAULT_CKPT_DIR
    if STORIES_DIR.is_dir():
        return STORIES_DIR
    pytest.skip("neither the embedded default model nor ../shared/models/stories260K is present")


# The tiny random model: grouped-query attention (4 query heads share 2 key/value heads).
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, norm_eps=1e-5)
TINY_VOCAB = 384  # 256 byte pieces + 3 specials + the corpus's 78 characters, leaving ~47 merges
WEIGHT_STD = 0.2  # large enough that logits are peaky and greedy decoding has no near-ties
MAX_SEQ_LEN = 128
LAYOUTS = ("meta", "meta_sharded", "hf", "hf_bin")


def interruptible() -> None:
    """Popen's preexec_fn for an app a test stops with Ctrl-C: SIGINT handled as in a terminal. Tests run as a
    background job inherit it ignored, and so would the app, which then never hears the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def on_event_loop() -> bool:
    """Whether the caller runs on an asyncio event loop (not in a worker thread)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


@pytest.fixture(scope="session")
def shared_path() -> Path:
    return shared_dir


# -- tokenizer ------------------------------------------------------------------------------------
def tokenizer_corpus() -> str:
    """Deterministic ASCII training text (prose and code), independent of any file, so the vocabulary is
    stable; characters outside it (é, 你, 🙂) are spelled in byte-fallback pieces."""
    rng = random.Random(0)
    words = (
        "once upon a time there was a little model that read tokens and wrote text the king and queen said "
        "hello world to every prompt in the batch while the cache kept keys and values for each layer"
    ).split()
    code = [
        "def forward(self, tokens, input_pos=None):",
        "    return self.output(self.norm(h)).float()",
        "import torch",
        "x = torch.zeros(4, 64)  # [B, dim]",
        "for i, layer in enumerate(self.layers):",
        'print(f"{name}: {value!r}")',
        "if not 0 < top_p <= 1: raise ValueError('bad top_p')",
        "[INST] <<SYS>> system <</SYS>> user [/INST] answer",
    ]
    lines = []
    for _ in range(2000):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ",", ":", ";"]))
        lines.append(rng.choice(code) + f" {rng.randint(0, 999)}")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    with open(out, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(tokenizer_corpus().splitlines()),
            model_writer=f,
            model_type="bpe",
            vocab_size=TINY_VOCAB,
            byte_fallback=True,
            character_coverage=1.0,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path) -> Tokenizer:
    return Tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def llama2_tokenizer() -> Tokenizer:
    if not LLAMA2_TOKENIZER.is_file():
        pytest.skip(f"../shared not present: no Llama-2 tokenizer at {LLAMA2_TOKENIZER}")
    return Tokenizer(LLAMA2_TOKENIZER)


# -- the tiny random model ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_args(tokenizer) -> ModelArgs:
    return ModelArgs(**TINY, vocab_size=tokenizer.n_words, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="session")
def tiny_state_dict(tiny_args) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights in Meta's names; norms are random too so they can't be skipped."""
    gen = torch.Generator().manual_seed(1234)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(tiny_args).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = WEIGHT_STD * torch.randn(shape, generator=gen)
    return state


def meta_params(args: ModelArgs, vocab_size: int) -> dict:
    return {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": vocab_size,
        "multiple_of": args.multiple_of,
        "ffn_dim_multiplier": None,
        "norm_eps": args.norm_eps,
    }


def write_meta_checkpoint(path: Path, args: ModelArgs, shards: list[dict], tokenizer_file: Path | None,
                          vocab_size: int = -1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "params.json").write_text(json.dumps(meta_params(args, vocab_size)))
    for i, shard in enumerate(shards):
        torch.save(shard, path / f"consolidated.{i:02d}.pth")
    if tokenizer_file is not None:
        (path / "tokenizer.model").write_bytes(tokenizer_file.read_bytes())
    return path


# Meta's model-parallel layout: column-parallel weights split along dim 0, row-parallel ones along dim 1.
SHARD_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}


def split_meta_shards(state: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    shards = [{} for _ in range(n)]
    for name, tensor in state.items():
        dim = SHARD_DIM.get(name.split(".")[-2]) if tensor.dim() > 1 else None
        parts = [tensor] * n if dim is None else tensor.chunk(n, dim=dim)
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    return shards


@pytest.fixture(scope="session")
def meta_ckpt_dir(tmp_path_factory, tiny_args, tiny_state_dict, tokenizer_path) -> Path:
    # vocab_size -1 as in Meta's own params.json: filled in from the tokenizer.
    return write_meta_checkpoint(tmp_path_factory.mktemp("ckpt") / "meta", tiny_args, [tiny_state_dict], tokenizer_path)


@pytest.fixture(scope="session")
def meta_sharded_ckpt_dir(tmp_path_factory, tiny_args, tiny_state_dict, tokenizer_path) -> Path:
    shards = split_meta_shards(tiny_state_dict, 2)
    return write_meta_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "meta_sharded", tiny_args, shards, tokenizer_path, tiny_args.vocab_size
    )


def hf_config(args: ModelArgs, max_position_embeddings: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )


def meta_to_hf_state_dict(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Meta names and interleaved rotary layout to HF names and half-split layout (HF's conversion script)."""
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["output.weight"],
    }
    for i in range(args.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = permute_rotary(state[p + "attention.wq.weight"], args.n_heads)
        out[q + "self_attn.k_proj.weight"] = permute_rotary(state[p + "attention.wk.weight"], args.n_kv_heads)
        out[q + "self_attn.v_proj.weight"] = state[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = state[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = state[p + "feed_forward.w1.weight"]
        out[q + "mlp.down_proj.weight"] = state[p + "feed_forward.w2.weight"]
        out[q + "mlp.up_proj.weight"] = state[p + "feed_forward.w3.weight"]
        out[q + "input_layernorm.weight"] = state[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "ffn_norm.weight"]
    return out


def build_hf_model(state: dict[str, torch.Tensor], args: ModelArgs, max_position_embeddings: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(args, max_position_embeddings)).to(torch.float32)
    missing, unexpected = model.load_state_dict(meta_to_hf_state_dict(state, args), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model(tiny_args, tiny_state_dict):
    """The reference: transformers' LlamaForCausalLM (eager attention, float32) on the tiny weights."""
    return build_hf_model(tiny_state_dict, tiny_args, MAX_SEQ_LEN)


@pytest.fixture(scope="session")
def hf_ckpt_dir(tmp_path_factory, hf_model, tokenizer_path) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    hf_model.save_pretrained(path, max_shard_size="150KB", safe_serialization=True)
    (path / "tokenizer.model").write_bytes(tokenizer_path.read_bytes())
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    return path


def write_hf_bin_checkpoint(path: Path, hf_state: dict[str, torch.Tensor], like: Path, shards: int = 2) -> Path:
    """A Hugging Face checkpoint in PyTorch's format, as transformers 4 saved Llama-2: `pytorch_model-0000N-of-
    0000M.bin` with `pytorch_model.bin.index.json`, each layer's rotary inv_freq buffer among the tensors (as in
    Meta's Llama-2-hf), and the config and tokenizer of the checkpoint `like`."""
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.model"):
        (path / name).write_bytes((like / name).read_bytes())
    state = dict(hf_state)
    for layer in {key.split(".")[2] for key in state if key.startswith("model.layers.")}:
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    names = list(state)  # the model's order, as transformers wrote its shards: a block's tensors together
    weight_map = {}
    for shard in range(shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = names[shard * len(names) // shards:(shard + 1) * len(names) // shards]
        torch.save({key: state[key].clone() for key in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="session")
def hf_bin_ckpt_dir(tmp_path_factory, hf_model, hf_ckpt_dir) -> Path:
    return write_hf_bin_checkpoint(tmp_path_factory.mktemp("ckpt") / "hf_bin", hf_model.state_dict(), hf_ckpt_dir)


@pytest.fixture(scope="session")
def ckpt_dirs(meta_ckpt_dir, meta_sharded_ckpt_dir, hf_ckpt_dir, hf_bin_ckpt_dir) -> dict[str, Path]:
    return {"meta": meta_ckpt_dir, "meta_sharded": meta_sharded_ckpt_dir, "hf": hf_ckpt_dir, "hf_bin": hf_bin_ckpt_dir}


def build_llama(ckpt_dir: Path, **kwargs) -> Llama:
    options = dict(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, device="cpu", dtype="float32", seed=0)
    options.update(kwargs)
    return Llama.build(ckpt_dir, **options)


def load_weights(ckpt_dir: Path, vocab_size: int) -> dict[str, torch.Tensor]:
    """The state dict the checkpoint loader produces (Meta's names, before any inference-time fusing)."""
    args = read_model_args(ckpt_dir)
    if args.vocab_size == -1:
        args.vocab_size = vocab_size
    return load_model(ckpt_dir, args, torch.device("cpu"), torch.float32).state_dict()


@pytest.fixture(scope="session")
def llama(meta_ckpt_dir) -> Llama:
    """The tiny model loaded from its Meta checkpoint, float32 on CPU, for tests that only read from it."""
    return build_llama(meta_ckpt_dir)


def greedy_concurrently(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Submits each prompt to engine (greedy) from a thread of its own, all at once; each one's tokens."""
    import threading

    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = [chunk.token for chunk in engine.submit(prompts[i], max_new_tokens, temperature=0)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


# -- helpers over the reference model -------------------------------------------------------------
@torch.inference_mode()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of the HF model, full recompute."""
    return hf(torch.tensor([tokens])).logits[0].float()


_greedy_memo: dict = {}


@torch.inference_mode()
def hf_greedy(hf, tokens: list[int], n: int, eos_id: int = 2) -> tuple[list[int], float]:
    """HF greedy continuation up to n tokens (stopping before EOS) and the smallest top-1/top-2 logit gap
    seen: an argmax loop over HF's own forward with its KV cache. Memoised per (model, prompt, n)."""
    key = (id(hf), tuple(tokens), n, eos_id)
    if key not in _greedy_memo:
        from transformers import DynamicCache

        # The cache is filled in place; transformers renamed its argument from past_key_values to cache (5.24).
        name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        out, min_gap, cache = [], float("inf"), {name: DynamicCache()}
        step_input = torch.tensor([tokens])
        for _ in range(n):
            logits = hf(step_input, use_cache=True, **cache).logits[0, -1].float()
            top2 = logits.topk(2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            nxt = int(logits.argmax())
            if nxt == eos_id:
                break
            out.append(nxt)
            step_input = torch.tensor([[nxt]])
        _greedy_memo[key] = (out, min_gap)
    out, min_gap = _greedy_memo[key]
    return list(out), min_gap
