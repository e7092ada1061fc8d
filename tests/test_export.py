"""Export to Hugging Face's layout (llama_core.export, `llama-export --to hf`): transformers' LlamaForCausalLM
reads the exported folder and computes our model's logits; our loader reads it back to identical logits; bad
arguments get a one-line error and exit status 2 (1 for a checkpoint or folder that cannot be used). Sources:
the embedded model (Meta layout, bfloat16), the tiny random GQA model of conftest in two Meta shards and in
Hugging Face's sharded layout (safetensors, and the older pytorch_model*.bin, which the export turns into
safetensors), and ../shared's stories260K (a trained GQA model whose params.json does not state its context)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import REPO_ROOT, STORIES_DIR, hf_config, load_weights, meta_to_hf_state_dict, needs_stories
from llama_core import DEFAULT_CKPT_DIR, Llama
from llama_core.checkpoint import hf_to_meta, hf_to_meta_name, meta_to_hf
from llama_core.config import ModelArgs
from llama_core.export import ASSUMED_CONTEXT, export_hf, main
from llama_core.model import Transformer

SOURCES = ["embedded", "meta_sharded", "hf", "hf_bin", pytest.param("stories260K", marks=needs_stories)]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east"


@pytest.fixture(scope="module")
def source_dirs(ckpt_dirs):
    return {"embedded": DEFAULT_CKPT_DIR, "meta_sharded": ckpt_dirs["meta_sharded"], "hf": ckpt_dirs["hf"],
            "hf_bin": ckpt_dirs["hf_bin"], "stories260K": STORIES_DIR}


@pytest.fixture(scope="module", params=SOURCES)
def exported(request, source_dirs, tmp_path_factory):
    """(source folder, its export)."""
    source = source_dirs[request.param]
    out = tmp_path_factory.mktemp("export") / request.param
    export_hf(source, out)
    return source, out


def build(ckpt_dir) -> Llama:
    return Llama.build(ckpt_dir, max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32")


def prompt(llama: Llama) -> list[int]:
    """About 20 tokens: text where the vocabulary has pieces for it, else arbitrary ids (stories260K's
    tokenizer is a stand-in)."""
    tokens = llama.tokenizer.encode(TEXT, bos=True, eos=False)[:24]
    return tokens if len(tokens) > 8 else [llama.tokenizer.bos_id] + [(37 * i) % 500 + 3 for i in range(20)]


@torch.inference_mode()
def our_logits(llama: Llama, tokens: list[int]) -> torch.Tensor:
    return llama.model(torch.tensor([tokens]), kv_len=len(tokens))[0].float()


def test_names_and_rotary_layout_invert_the_loaders():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=10)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(args).state_dict().items()}
    for name, shape in shapes.items():
        tensor = torch.randn(shape)
        hf_name, hf_tensor = meta_to_hf(name, tensor, args.n_heads, args.n_kv_heads)
        assert hf_to_meta_name(hf_name) == name
        back_name, back = hf_to_meta(DEFAULT_CKPT_DIR, hf_name, hf_tensor, args.n_heads, args.n_kv_heads)
        assert back_name == name and torch.equal(back, tensor)
        assert torch.equal(hf_tensor, tensor) == ("wq" not in name and "wk" not in name)


def test_transformers_reads_the_export_and_gives_our_logits(exported):
    from transformers import LlamaForCausalLM

    source, out = exported
    ours = build(source)
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = prompt(ours)
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(our_logits(ours, tokens), reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(our_logits(ours, tokens).argmax(-1), reference.argmax(-1))


def test_our_loader_reads_the_export_back_to_identical_weights_and_logits(exported):
    source, out = exported
    vocab_size = build(source).tokenizer.n_words
    before, after = load_weights(source, vocab_size), load_weights(out, vocab_size)
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    original, reloaded = build(source), build(out)
    tokens = prompt(original)
    assert torch.equal(our_logits(reloaded, tokens), our_logits(original, tokens))


def test_config_states_the_model_and_the_files_are_complete(exported):
    source, out = exported
    llama = build(source)
    config = json.loads((out / "config.json").read_text())
    args = llama.args
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        args.dim, args.hidden_dim, args.n_layers)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        args.n_heads, args.n_kv_heads, llama.tokenizer.n_words)
    assert (config["rms_norm_eps"], config["rope_theta"], config["tie_word_embeddings"]) == (
        args.norm_eps, args.rope_theta, False)
    assert (config["bos_token_id"], config["eos_token_id"]) == (llama.tokenizer.bos_id, llama.tokenizer.eos_id)
    assert config["max_position_embeddings"] == (args.max_seq_len or ASSUMED_CONTEXT)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
    assert dtypes == {{"float32": "F32", "bfloat16": "BF16"}[config["torch_dtype"]]}
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (llama.tokenizer.bos_id, llama.tokenizer.eos_id)
    assert (out / "tokenizer.model").read_bytes() == llama.tokenizer.model_path.read_bytes()


@needs_stories
def test_unstated_context_is_assumed_and_said_or_given(tmp_path, capsys):
    assert main(["--to", "hf", str(tmp_path / "assumed"), "--ckpt-dir", str(STORIES_DIR)]) == 0
    assert json.loads((tmp_path / "assumed" / "config.json").read_text())["max_position_embeddings"] == ASSUMED_CONTEXT
    assert "stories260K does not state its context" in capsys.readouterr().err
    assert main(["--to", "hf", str(tmp_path / "given"), "--ckpt-dir", str(STORIES_DIR),
                 "--max-position-embeddings", "512"]) == 0
    assert json.loads((tmp_path / "given" / "config.json").read_text())["max_position_embeddings"] == 512
    assert "does not state" not in capsys.readouterr().err


def test_tied_embeddings_are_written_as_two_tensors(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    """A Hugging Face checkpoint that ties lm_head to the embeddings (and stores it once) exports both."""
    tied = tmp_path / "tied"
    tied.mkdir()
    weights = {k: v for k, v in meta_to_hf_state_dict(tiny_state_dict, tiny_args).items() if k != "lm_head.weight"}
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(tiny_args, 128).to_dict()
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (tied / "tokenizer.model").write_bytes(tokenizer_path.read_bytes())
    export_hf(tied, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), tiny_state_dict["tok_embeddings.weight"])
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), tiny_state_dict["tok_embeddings.weight"])
    original, exported = build(tied), build(tmp_path / "out")
    tokens = prompt(original)
    assert torch.equal(our_logits(exported, tokens), our_logits(original, tokens))


def test_the_checkpoints_own_generation_config_is_kept(tmp_path):
    # The export wrote Llama-2's defaults in its place: a fine-tune's sampling and end-of-turn tokens, which
    # llama-generate and the app read from it, were lost (QA).
    from llama_core.generation_config import read_generation_config

    source = tmp_path / "tuned"
    export_hf(DEFAULT_CKPT_DIR, source)
    stated = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.3, "top_p": 0.5}
    (source / "generation_config.json").write_text(json.dumps(stated))
    export_hf(source, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == stated
    assert read_generation_config(tmp_path / "out").eos_token_ids == (2, 7)  # as the loader reads it
    (source / "generation_config.json").write_text("not JSON")  # unreadable: the defaults, as without one
    export_hf(source, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["temperature"] == 0.6


def test_dtype_converts_the_weights(tmp_path):
    export_hf(DEFAULT_CKPT_DIR, tmp_path, dtype="float16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"F16"}


# -- the command line --------------------------------------------------------------------------------
def test_python_m_exports_the_embedded_model_by_default(tmp_path):
    out = tmp_path / "tiny-shakespeare-hf"
    result = subprocess.run([sys.executable, "-m", "llama_core.export", "--to", "hf", str(out)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} (Hugging Face layout): 3,148,224 parameters in bfloat16")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.model"]


def test_a_folder_that_is_not_empty_is_refused_unless_forced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "params.json").write_text("{}")  # another checkpoint's: it would make the folder read as Meta's
    assert main(["--to", "hf", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: output folder {out} is not empty") and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "params.json"]
    assert main(["--to", "hf", str(out), "--force"]) == 0
    assert not (out / "params.json").exists() and (out / "notes.txt").read_text() == "mine"
    reference = build(DEFAULT_CKPT_DIR)
    assert torch.equal(our_logits(build(out), prompt(reference)), our_logits(reference, prompt(reference)))


@pytest.mark.parametrize("case", ["missing checkpoint", "checkpoint without config", "output is the checkpoint",
                                  "output is a file", "another model's tokenizer", "no --to", "unknown layout",
                                  "bad dtype", "bad context"])
def test_bad_arguments_get_a_one_line_error_and_status_2_or_1(tmp_path, capsys, tokenizer_path, case):
    """Status 2 for a usage error (argparse's); 1 where the checkpoint or the output folder cannot be used."""
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("x")
    argv = {
        "missing checkpoint": ["--to", "hf", str(out), "--ckpt-dir", str(tmp_path / "nowhere")],
        "checkpoint without config": ["--to", "hf", str(out), "--ckpt-dir", str(empty)],
        "output is the checkpoint": ["--to", "hf", str(DEFAULT_CKPT_DIR), "--force"],
        "output is a file": ["--to", "hf", str(tmp_path / "file")],
        "another model's tokenizer": ["--to", "hf", str(out), "--tokenizer", str(tokenizer_path)],
        "no --to": [str(out)],
        "unknown layout": ["--to", "gguf", str(out)],
        "bad dtype": ["--to", "hf", str(out), "--dtype", "int4"],
        "bad context": ["--to", "hf", str(out), "--max-position-embeddings", "0"],
    }[case]
    expected = {
        "missing checkpoint": f"--ckpt-dir {tmp_path / 'nowhere'}: no such directory",
        "checkpoint without config": f"--ckpt-dir {empty} holds no params.json (Meta layout) or config.json",
        "output is the checkpoint": f"output folder {DEFAULT_CKPT_DIR} is the checkpoint being exported",
        "output is a file": f"output {tmp_path / 'file'} is a file, not a folder",
        "another model's tokenizer": f"tokenizer {tokenizer_path} has 384 pieces but the model in {DEFAULT_CKPT_DIR} "
                                     "has vocab_size 2048",
        "no --to": "the following arguments are required: --to",
        "unknown layout": "argument --to: invalid choice: 'gguf'",
        "bad dtype": "argument --dtype: invalid choice: 'int4'",
        "bad context": "argument --max-position-embeddings: must be a positive integer, got '0'",
    }[case]
    assert exit_status(argv) == (2 if case in ("no --to", "unknown layout", "bad dtype", "bad context") else 1)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert not out.exists() and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in DEFAULT_CKPT_DIR.iterdir()) == [
        "consolidated.00.pth", "params.json", "tokenizer.model", "training.json"]



def exit_status(argv: list[str]) -> int:
    """main's status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
