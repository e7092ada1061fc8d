"""Checkpoint loading: every layout yields exactly the weights that were written, whatever the sharding."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import (
    LAYOUTS,
    build_llama,
    hf_logits,
    load_weights,
    meta_to_hf_state_dict,
    split_meta_shards,
    write_meta_checkpoint,
)
from llama_core import checkpoint, cpu_kernels
from llama_core.checkpoint import load_model, model_part, permute_rotary, unpermute_rotary
from llama_core.checkpoint_files import checkpoint_layout, read_model_args, stored_dtype
from llama_core.config import ModelArgs
from llama_core.devices import resolve_dtype
from llama_core.errors import CheckpointError
from llama_core.quantize import quantize_int8


def assert_weights_equal(loaded, state_dict, what):
    assert set(loaded) == set(state_dict), what
    for name, tensor in state_dict.items():
        assert torch.equal(loaded[name], tensor), f"{what}: {name} differs from the weights written"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_the_written_weights(ckpt_dirs, tiny_state_dict, tiny_args, layout):
    assert_weights_equal(load_weights(ckpt_dirs[layout], tiny_args.vocab_size), tiny_state_dict, layout)
    llama = build_llama(ckpt_dirs[layout])
    assert llama.model.args.n_kv_heads == 2 and llama.model.args.n_heads == 4
    assert llama.model.args.vocab_size == tiny_args.vocab_size


def test_layout_detection(ckpt_dirs):
    assert checkpoint_layout(ckpt_dirs["meta"]) == "meta"
    assert checkpoint_layout(ckpt_dirs["meta_sharded"]) == "meta"
    assert checkpoint_layout(ckpt_dirs["hf"]) == "hf"


def test_a_folder_with_both_config_files_is_the_layout_whose_weights_it_holds(ckpt_dirs, tmp_path):
    # params.json won whenever it was there: a stray one beside Hugging Face's files failed as "no weights",
    # and a folder holding both checkpoints loaded Meta's silently (QA).
    import shutil

    stray = shutil.copytree(ckpt_dirs["hf"], tmp_path / "stray")
    shutil.copy(ckpt_dirs["meta"] / "params.json", stray)
    assert checkpoint_layout(stray) == "hf"
    meta = shutil.copytree(ckpt_dirs["meta"], tmp_path / "meta")
    shutil.copy(ckpt_dirs["hf"] / "config.json", meta)
    assert checkpoint_layout(meta) == "meta"
    both = shutil.copytree(ckpt_dirs["hf"], tmp_path / "both")
    for path in ckpt_dirs["meta"].iterdir():
        if path.name in ("params.json",) or path.name.startswith("consolidated."):
            shutil.copy(path, both)
    with pytest.raises(CheckpointError, match="holds two checkpoints"):
        checkpoint_layout(both)


def test_shards_without_their_index_are_named_as_such(ckpt_dirs, tmp_path):
    from llama_core.checkpoint_files import weight_files
    from llama_core.errors import CheckpointNotFoundError

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((ckpt_dirs["hf"] / "config.json").read_bytes())
    for i in (1, 2):
        (sharded / f"model-0000{i}-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match=r"holds weight shards \(model-00001-of-00002.safetensors, "
                                                      r"...\) but not model.safetensors.index.json"):
        weight_files(sharded)


def test_model_args_agree_across_layouts(ckpt_dirs, tiny_args):
    meta = read_model_args(ckpt_dirs["meta"])
    hf = read_model_args(ckpt_dirs["hf"])
    assert meta.vocab_size == -1  # Meta's convention: filled in from the tokenizer at build time
    assert (meta.dim, meta.n_layers, meta.n_heads, meta.n_kv_heads) == (64, 2, 4, 2)
    assert meta.hidden_dim == hf.hidden_dim == tiny_args.hidden_dim == 176  # 2/3 * 4 * 64 = 170, rounded up to 16
    assert hf.vocab_size == tiny_args.vocab_size
    assert hf.rope_theta == meta.rope_theta == 10000.0
    assert hf.norm_eps == meta.norm_eps == 1e-5


def test_hf_config_rope_theta_read_from_either_place(tmp_path, ckpt_dirs):
    raw = json.loads((ckpt_dirs["hf"] / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelArgs.from_hf_config(tmp_path / "config.json").rope_theta == 500000.0
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelArgs.from_hf_config(tmp_path / "config.json").rope_theta == 20000.0
    raw["rope_theta"] = 20000.0  # both, the same
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelArgs.from_hf_config(tmp_path / "config.json").rope_theta == 20000.0
    raw["rope_theta"] = 10000.0  # both, apart: transformers 5 read the nested one, this package the other (QA)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"rope_theta is 10000.0, but rope_parameters.rope_theta is 20000.0"):
        ModelArgs.from_hf_config(tmp_path / "config.json")


def test_a_tensor_missing_from_a_hugging_face_checkpoint_is_named_as_its_files_name_it(ckpt_dirs, tmp_path):
    # Named as this package's model names it (layers.1.feed_forward.w3.weight), not as the files do (QA).
    import shutil

    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(ckpt_dirs["hf"], tmp_path / "broken")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    weights = load_file(str(shard))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        build_llama(broken)


@pytest.mark.parametrize("n_heads", [4, 2, 1])
def test_unpermute_rotary_inverts_permute(n_heads):
    weight = torch.randn(n_heads * 16, 64)
    permuted = permute_rotary(weight, n_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, n_heads), weight)
    # Within each head, HF's layout puts the even (first-of-pair) rows before the odd ones.
    head = weight[:16]
    assert torch.equal(permuted[:16], torch.cat((head[0::2], head[1::2])))


@pytest.mark.parametrize("n_shards", [1, 2])
def test_meta_checkpoint_with_rope_freqs_loads(tmp_path, tiny_args, tiny_state_dict, tokenizer_path, n_shards):
    # Meta's own Llama-2 consolidated.NN.pth files carry a precomputed "rope.freqs" buffer beside the weights.
    shards = split_meta_shards(tiny_state_dict, n_shards)
    for shard in shards:
        shard["rope.freqs"] = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, shards, tokenizer_path)
    assert_weights_equal(load_weights(ckpt, tiny_args.vocab_size), tiny_state_dict, f"{n_shards} shard(s) with rope.freqs")
    assert build_llama(ckpt).model.args.n_layers == tiny_args.n_layers


def test_hf_single_file_with_tied_embeddings(tmp_path, tiny_args, tiny_state_dict, tokenizer_path, ckpt_dirs):
    state = dict(tiny_state_dict)
    state["output.weight"] = state["tok_embeddings.weight"]
    hf_state = meta_to_hf_state_dict(state, tiny_args)
    del hf_state["lm_head.weight"]  # tied: HF saves only the embeddings
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"))
    config = json.loads((ckpt_dirs["hf"] / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_path, tmp_path / "tokenizer.model")

    loaded = load_weights(tmp_path, tiny_args.vocab_size)
    assert_weights_equal(loaded, state, "tied HF checkpoint")
    model = build_llama(tmp_path).model
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_part_is_assigned_as_soon_as_its_tensors_are_read(ckpt_dirs, tiny_args, monkeypatch, layout):
    read = []  # tensor names in the order the checkpoint gives them
    reader = checkpoint.iter_rank_tensors

    def reading(*args, **kwargs):
        for name, tensor in reader(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(checkpoint, "iter_rank_tensors", reading)
    held_at_each_part, parts = [], []

    def assigned(part):
        parts.append(part)
        done = sum(len(list(p.state_dict())) for p in parts)
        held_at_each_part.append(len(read) - done)  # read, and not yet in an assigned part

    model = load_model(ckpt_dirs[layout], tiny_args, torch.device("cpu"), torch.float32, assigned=assigned)
    assert sorted(map(id, parts)) == sorted(map(id, [*model.layers, model.tok_embeddings, model.norm, model.output]))
    assert sum(len(list(p.state_dict())) for p in parts) == len(read) == len(model.state_dict())
    # Meta's files give a block's tensors one after another (two shards: joined tensor by tensor), so
    # nothing waits; Hugging Face's small shard files split a block at most once per file boundary.
    most_held = 0 if layout.startswith("meta") else max(len(list(block.state_dict())) for block in model.layers)
    assert max(held_at_each_part) <= most_held, held_at_each_part


def test_int8_while_loading_quantizes_exactly_what_loading_then_quantizing_does(meta_sharded_ckpt_dir, tiny_args):
    built = []  # the model load_model builds

    class Recorded(checkpoint.Transformer):
        def __init__(self, args):
            super().__init__(args)
            built.append(self)

    full_precision_blocks = []  # at each part's quantization: the blocks holding float weights

    def quantize(part):
        full_precision_blocks.append(sum(isinstance(block.attention.wq, torch.nn.Linear)
                                         and block.attention.wq.weight.device.type != "meta" for block in built[0].layers))
        return quantize_int8(part)  # the output layer's Int8Linear takes its place

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "Transformer", Recorded)
        while_loading = load_model(meta_sharded_ckpt_dir, tiny_args, torch.device("cpu"), torch.float32, assigned=quantize)
    assert full_precision_blocks and max(full_precision_blocks) == 1
    assert not any(isinstance(m, torch.nn.Linear) for m in while_loading.modules())
    after = quantize_int8(load_model(meta_sharded_ckpt_dir, tiny_args, torch.device("cpu"), torch.float32))
    assert while_loading.state_dict().keys() == after.state_dict().keys()
    for name, tensor in after.state_dict().items():
        assert torch.equal(while_loading.state_dict()[name], tensor), name
    built_int8 = build_llama(meta_sharded_ckpt_dir, quantize="int8")  # the loader's own path
    assert not any(isinstance(m, torch.nn.Linear) for m in built_int8.model.modules())


def test_a_tensor_given_twice_is_refused(tmp_path, ckpt_dirs, tiny_args):
    ckpt = tmp_path / "hf"
    shutil.copytree(ckpt_dirs["hf"], ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    from safetensors.torch import load_file

    first, last = load_file(ckpt / files[0]), load_file(ckpt / files[-1])
    name = next(iter(first))
    last[name] = first[name]  # in two files: an index would name one, the loader reads every file listed
    save_file(last, str(ckpt / files[-1]))
    with pytest.raises(CheckpointError, match=rf"holds tensor {re.escape(name)} twice"):  # as the files name it
        load_weights(ckpt, tiny_args.vocab_size)


def test_model_part_names_what_is_assigned_whole():
    assert model_part("layers.12.attention.wq.weight") == "layers.12"
    assert [model_part(n) for n in ("tok_embeddings.weight", "norm.weight", "output.weight")] == ["tok_embeddings", "norm", "output"]


def test_tokenizer_found_in_parent_directory(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    ckpt = write_meta_checkpoint(tmp_path / "7B", tiny_args, [tiny_state_dict], tokenizer_file=None)
    shutil.copy(tokenizer_path, tmp_path / "tokenizer.model")  # Meta's downloads keep it beside the model folders
    llama = build_llama(ckpt)
    assert llama.tokenizer.model_path == tmp_path / "tokenizer.model"


def test_explicit_tokenizer_path(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [tiny_state_dict], tokenizer_file=None)
    llama = build_llama(ckpt, tokenizer_path=tokenizer_path)
    assert llama.tokenizer.n_words == tiny_args.vocab_size


def test_bfloat16_load_generates_close_to_float32(meta_ckpt_dir, llama, tokenizer):
    bf16 = build_llama(meta_ckpt_dir, dtype="bfloat16")
    assert bf16.model.output.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].attention.kv_cache.k_cache.dtype == torch.bfloat16
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    tokens, logprobs = bf16.generate([prompt], max_gen_len=4, temperature=0, logprobs=True, echo=True)
    reference, ref_logprobs = llama.generate([prompt], max_gen_len=4, temperature=0, logprobs=True, echo=True)
    assert tokens[0][: len(prompt)] == prompt and len(tokens[0]) == len(prompt) + 4
    assert all(0 <= t < tokenizer.n_words for t in tokens[0])
    # bfloat16 keeps ~3 significant digits: prompt log-probabilities stay near the float32 ones.
    n = len(prompt)
    torch.testing.assert_close(torch.tensor(logprobs[0][:n]), torch.tensor(ref_logprobs[0][:n]), atol=0.15, rtol=0.05)


def test_checkpoint_paths_may_start_with_a_tilde(meta_ckpt_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(meta_ckpt_dir.parent))
    llama = build_llama(f"~/{meta_ckpt_dir.name}", tokenizer_path=f"~/{meta_ckpt_dir.name}/tokenizer.model")
    assert llama.ckpt_dir == meta_ckpt_dir


@pytest.mark.parametrize("field", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("written, stored", [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", None),
                                             (None, None), (7, None)])
def test_a_hugging_face_checkpoint_says_which_16_bit_dtype_it_is_stored_in(tmp_path, ckpt_dirs, field, written, stored):
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    config = json.loads((ckpt_dirs["hf"] / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if written is not None:
        config[field] = written
    (ckpt / "config.json").write_text(json.dumps(config))
    assert stored_dtype(ckpt) == stored
    assert stored_dtype(ckpt_dirs["meta"]) is None  # params.json does not say


def test_auto_dtype_on_a_gpu_is_the_16_bit_dtype_the_checkpoint_is_stored_in(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capability = {"cuda": (9, 0)}  # an H100's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cuda"])
    assert resolve_dtype("auto", cuda, "float16") == torch.float16  # Hugging Face's Llama-2: not rounded to bfloat16
    assert resolve_dtype("auto", cuda, "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("auto", cpu, "float16") == torch.float32  # the CPU keeps 16-bit weights in its panels
    assert resolve_dtype("bfloat16", cuda, "float16") == torch.bfloat16  # what the user asks for
    capability["cuda"] = (7, 5)  # a T4's: torch.cuda.is_bf16_supported() says yes (emulated), float16 is native
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_dtype("auto", cuda, "bfloat16") == torch.float16
    assert resolve_dtype("auto", cuda, None) == torch.float16
    assert resolve_dtype("bfloat16", cuda, None) == torch.bfloat16  # asked for: emulated, but it runs


# -- Hugging Face checkpoints in PyTorch's format (pytorch_model*.bin) ----------------------------------------
def test_transformers_reading_the_same_bin_files_gives_our_logits(hf_bin_ckpt_dir, tokenizer):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(hf_bin_ckpt_dir, dtype=torch.float32, attn_implementation="eager")
    prompt = tokenizer.encode("The KV cache holds the keys and values of every position so far.", bos=True, eos=False)
    ours = build_llama(hf_bin_ckpt_dir)
    with torch.inference_mode():
        got = ours.model(torch.tensor([prompt]), kv_len=len(prompt))[0]
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(hf_logits(reference, prompt), -1),
                               atol=1e-4, rtol=0)


def test_one_float16_pytorch_bin_in_torch_legacy_format_loads(tmp_path, hf_model, hf_bin_ckpt_dir, tiny_state_dict,
                                                               tiny_args):
    # One file, no index, no inv_freq; torch.save's pre-1.6 format, which cannot be mmap'd; float16 as on the Hub.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(hf_bin_ckpt_dir / name, ckpt / name)
    torch.save({key: tensor.half() for key, tensor in hf_model.state_dict().items()}, ckpt / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert_weights_equal(load_weights(ckpt, tiny_args.vocab_size),
                         {name: tensor.half().float() for name, tensor in tiny_state_dict.items()}, "legacy float16 .bin")
    # On the CPU the projections stay in the float16 they are stored in (the kernels' 16-bit panels), as from safetensors.
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    info = build_llama(ckpt, dtype="auto").loaded.info
    assert info.dtype == "float32"
    assert info.projections_stored_in == ("float16" if cpu_kernels.available() else None)


def test_safetensors_are_read_where_a_folder_also_has_bin_files(tmp_path, hf_ckpt_dir, tiny_state_dict, tiny_args):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_ckpt_dir, ckpt)
    torch.save({"model.embed_tokens.weight": torch.zeros(3)}, ckpt / "pytorch_model.bin")  # never read
    assert_weights_equal(load_weights(ckpt, tiny_args.vocab_size), tiny_state_dict, "safetensors beside a .bin")


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (open, (str(_RunsCodeWhenUnpickled.marker), "w"))


def test_a_bin_file_that_would_run_code_is_refused_and_runs_none(tmp_path, hf_bin_ckpt_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_bin_ckpt_dir, ckpt)
    _RunsCodeWhenUnpickled.marker = tmp_path / "ran"
    shard = sorted(ckpt.glob("pytorch_model-*.bin"))[0]
    torch.save({**torch.load(shard, weights_only=True), "model.norm.weight": _RunsCodeWhenUnpickled()}, shard)
    with pytest.raises(CheckpointError, match=rf"cannot read weight shard .*{shard.name}"):
        build_llama(ckpt)
    assert not _RunsCodeWhenUnpickled.marker.exists()


@pytest.mark.parametrize("layout", ["meta bfloat16", "hf float16 safetensors", "hf float32 safetensors"])
def test_the_load_bar_counts_the_bytes_the_files_store_not_the_loaded_dtypes(tmp_path, monkeypatch, layout):
    """The embedded model (Meta's layout, bfloat16) and its export to safetensors, loaded in float32: the bar's
    size is the files' weights as stored, within the files' headers of their size on disk."""
    from llama_core import DEFAULT_CKPT_DIR
    from llama_core.checkpoint_files import weight_files
    from llama_core.export import export_hf

    ckpt_dir = DEFAULT_CKPT_DIR
    if layout.startswith("hf"):
        ckpt_dir = tmp_path / "hf"
        export_hf(DEFAULT_CKPT_DIR, ckpt_dir, dtype=layout.split()[1])
    seen = []
    close = checkpoint.WeightsProgress.close
    monkeypatch.setattr(checkpoint.WeightsProgress, "close", lambda bar: seen.append((bar.n, bar.total)) or close(bar))
    load_model(ckpt_dir, read_model_args(ckpt_dir), torch.device("cpu"), torch.float32, progress=True)
    read, total = seen[0]
    on_disk = sum(path.stat().st_size for path in weight_files(ckpt_dir))
    assert read == total and on_disk - 64 * 1024 < total <= on_disk, (read, total, on_disk)
