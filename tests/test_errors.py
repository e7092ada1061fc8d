"""Every mistake a caller can make is the package's own exception, of the right standard base class,
with a message naming what was wrong."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from conftest import MAX_SEQ_LEN, build_llama, split_meta_shards, write_meta_checkpoint
from llama_core import (
    CheckpointError,
    CheckpointNotFoundError,
    ContextLengthError,
    DialogError,
    InvalidRequestError,
    Llama,
    LlamaError,
    Tokenizer,
)


def test_error_hierarchy():
    assert issubclass(CheckpointNotFoundError, FileNotFoundError) and issubclass(CheckpointNotFoundError, LlamaError)
    assert issubclass(CheckpointError, ValueError) and issubclass(CheckpointError, LlamaError)
    assert issubclass(InvalidRequestError, ValueError) and issubclass(InvalidRequestError, LlamaError)
    assert issubclass(ContextLengthError, InvalidRequestError) and issubclass(DialogError, InvalidRequestError)
    assert not issubclass(CheckpointNotFoundError, CheckpointError)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


# -- checkpoints ------------------------------------------------------------------------------------
def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="checkpoint directory not found: .*nowhere") as info:
        build_llama(tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)


def test_directory_without_params_or_config(tmp_path, tokenizer_path):
    shutil.copy(tokenizer_path, tmp_path / "tokenizer.model")
    with pytest.raises(CheckpointNotFoundError, match=r"no params.json \(Meta layout\) or config.json"):
        build_llama(tmp_path)


def test_an_empty_directory_or_a_file_says_what_a_checkpoint_folder_holds(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"no params.json \(Meta layout\) or config.json"):
        build_llama(tmp_path)  # no tokenizer either: the folder is not a checkpoint, said first
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match=r"consolidated.00.pth is a file, not a directory: pass the "
                                                      r"folder holding params.json"):
        build_llama(tmp_path / "consolidated.00.pth")


def test_a_missing_last_shard_is_named_as_such(tmp_path, meta_sharded_ckpt_dir):
    ckpt = copy_ckpt(meta_sharded_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "consolidated.01.pth").unlink()
    with pytest.raises(CheckpointError, match=r"1/2 of it, as in one of 2 model-parallel shards; are "
                                              r"consolidated.NN.pth files missing\?"):
        build_llama(ckpt)


def test_missing_first_shard(tmp_path, meta_sharded_ckpt_dir):
    ckpt = copy_ckpt(meta_sharded_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "consolidated.00.pth").unlink()
    found = ", ".join(sorted(p.name for p in ckpt.glob("consolidated.*.pth")))
    with pytest.raises(CheckpointNotFoundError, match=r"must be numbered from consolidated\.00\.pth on, none missing; "
                                                      rf"found {re.escape(found)}: consolidated\.00\.pth is missing"):
        build_llama(ckpt)


def test_no_weight_shard_at_all(tmp_path, meta_ckpt_dir):
    ckpt = copy_ckpt(meta_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "consolidated.00.pth").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no consolidated\.\*\.pth weight shard"):
        build_llama(ckpt)


def test_missing_tokenizer(tmp_path, meta_ckpt_dir):
    ckpt = copy_ckpt(meta_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "tokenizer.model").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no tokenizer.model in .*pass tokenizer_path"):
        build_llama(ckpt)
    with pytest.raises(CheckpointNotFoundError, match="tokenizer model not found: .*absent.model"):
        build_llama(ckpt, tokenizer_path=tmp_path / "absent.model")


def test_corrupt_tokenizer(tmp_path, meta_ckpt_dir):
    ckpt = copy_ckpt(meta_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="cannot read tokenizer model"):
        build_llama(ckpt)
    with pytest.raises(CheckpointError, match="cannot read tokenizer model"):
        Tokenizer(ckpt / "tokenizer.model")


def test_truncated_pth(tmp_path, meta_ckpt_dir):
    ckpt = copy_ckpt(meta_ckpt_dir, tmp_path / "ckpt")
    shard = ckpt / "consolidated.00.pth"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read weight shard .*consolidated\.00\.pth \(truncated"):
        build_llama(ckpt)


HF_SHARDS = {"hf": "model-*.safetensors", "hf_bin": "pytorch_model-*.bin"}


@pytest.mark.parametrize("layout", HF_SHARDS)
def test_a_truncated_hf_shard_is_named(tmp_path, ckpt_dirs, layout):
    ckpt = copy_ckpt(ckpt_dirs[layout], tmp_path / "ckpt")
    shard = sorted(ckpt.glob(HF_SHARDS[layout]))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"cannot read weight shard .*{shard.name}"):
        build_llama(ckpt)


@pytest.mark.parametrize("layout", HF_SHARDS)
def test_hf_index_names_a_missing_shard(tmp_path, ckpt_dirs, layout):
    ckpt = copy_ckpt(ckpt_dirs[layout], tmp_path / "ckpt")
    shard = sorted(ckpt.glob(HF_SHARDS[layout]))[0]
    shard.unlink()
    with pytest.raises(CheckpointNotFoundError, match=rf"weight shard .*{shard.name} listed in .*index.json not found"):
        build_llama(ckpt)


def test_hf_without_weights(tmp_path, hf_ckpt_dir):
    ckpt = copy_ckpt(hf_ckpt_dir, tmp_path / "ckpt")
    for path in ckpt.glob("model*"):
        path.unlink()
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors, model.safetensors.index.json, "
                       "pytorch_model.bin or pytorch_model.bin.index.json in "):
        build_llama(ckpt)


@pytest.mark.parametrize("index", ["[1, 2]", '{"weight_map": ["a.bin"]}', '{"weight_map": {"x": 5}}', "{"])
def test_an_unreadable_shard_index_is_refused_naming_it(tmp_path, hf_bin_ckpt_dir, index):
    ckpt = copy_ckpt(hf_bin_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "pytorch_model.bin.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=r"cannot read shard index .*pytorch_model\.bin\.index\.json"):
        build_llama(ckpt)


def test_a_pytorch_bin_holding_something_besides_tensors_is_refused_naming_it(tmp_path, hf_bin_ckpt_dir):
    ckpt = copy_ckpt(hf_bin_ckpt_dir, tmp_path / "ckpt")
    shard = sorted(ckpt.glob("pytorch_model-*.bin"))[0]
    state = torch.load(shard, weights_only=True)
    torch.save({**state, "step": 1000}, shard)
    with pytest.raises(CheckpointError, match=rf"weight shard .*{shard.name} holds 'step', a int, where a tensor"):
        build_llama(ckpt)


def test_params_vocab_size_differs_from_tokenizer(tmp_path, tiny_args, tiny_state_dict, tokenizer_path, tokenizer):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [tiny_state_dict], tokenizer_path, vocab_size=512)
    with pytest.raises(CheckpointError, match=rf"has {tokenizer.n_words} pieces but the model .* vocab_size 512"):
        build_llama(ckpt)


def test_hf_vocab_size_differs_from_tokenizer(tmp_path, hf_ckpt_dir, tokenizer):
    ckpt = copy_ckpt(hf_ckpt_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] = 32000
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"has {tokenizer.n_words} pieces but the model .* vocab_size 32000"):
        build_llama(ckpt)


def test_weights_vocab_differs_from_tokenizer(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    state = dict(tiny_state_dict)
    state["tok_embeddings.weight"] = torch.zeros(400, tiny_args.dim)
    state["output.weight"] = torch.zeros(400, tiny_args.dim)
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [state], tokenizer_path)  # vocab_size -1
    with pytest.raises(CheckpointError, match=r"tensor (output|tok_embeddings)\.weight has shape \(400, 64\)"):
        build_llama(ckpt)


def test_shards_with_mismatched_shapes(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    shards = split_meta_shards(tiny_state_dict, 2)
    name = "layers.1.attention.wq.weight"
    shards[1][name] = torch.zeros(shards[1][name].shape[0], tiny_args.dim + 8)
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, shards, tokenizer_path)
    with pytest.raises(CheckpointError, match=rf"consolidated\.01\.pth: tensor {name} has shape .* does not fit"):
        build_llama(ckpt)


def test_shards_with_different_tensors(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    shards = split_meta_shards(tiny_state_dict, 2)
    del shards[1]["layers.0.ffn_norm.weight"]
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, shards, tokenizer_path)
    with pytest.raises(CheckpointError, match=r"does not fit .*differing tensors \['layers.0.ffn_norm.weight'\]"):
        build_llama(ckpt)


def test_sharded_tensor_wrong_size_after_merge(tmp_path, tiny_args, tiny_state_dict, tokenizer_path):
    # Three shards of a model whose params say two: every tensor concatenates, but to the wrong size.
    shards = split_meta_shards(tiny_state_dict, 2)
    shards.append({k: v.clone() for k, v in shards[1].items()})
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, shards, tokenizer_path)
    with pytest.raises(CheckpointError, match=r"has shape .* but the model config expects"):
        build_llama(ckpt)


@pytest.mark.parametrize("n_layers, message", [
    (3, r"lacks tensor\(s\) \['layers\.2\..*n_layers=3"),  # more layers than weights
    (1, r"has tensor layers\.1\..*, which the model config \(n_layers=1\) has no place for"),  # fewer
])
def test_params_with_another_layer_count_than_the_weights(tmp_path, tiny_args, tiny_state_dict, tokenizer_path,
                                                          n_layers, message):
    ckpt = write_meta_checkpoint(tmp_path / "ckpt", tiny_args, [tiny_state_dict], tokenizer_path)
    params = json.loads((ckpt / "params.json").read_text())
    params["n_layers"] = n_layers
    (ckpt / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError, match=message):
        build_llama(ckpt)


@pytest.mark.parametrize(
    "params, message",
    [
        ("{not json", "cannot read model config"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 5}', "dim 64 is not divisible by n_heads 5"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 3}', "n_heads 4 is not divisible by n_kv_heads 3"),
        ('{"dim": 64, "n_layers": 0, "n_heads": 4}', "'n_layers' must be a positive integer, got 0"),
        ('{"n_layers": 2, "n_heads": 4}', "missing field.*dim"),  # not the 7B's 4096
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "multiple_of": 0}', "'multiple_of' must be a positive integer"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim_multiplier": "1.3"}',
         "'ffn_dim_multiplier' must be a positive number, got '1.3'"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "norm_eps": null}', "'norm_eps' must be a positive number, got None"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "norm_eps": "abc"}', "'norm_eps' must be a positive number"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "rope_theta": -1}', "'rope_theta' must be a positive number, got -1"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "rope_theta": NaN}', "'rope_theta' must be a positive number, got nan"),
        ('{"dim": 64, "n_layers": 2, "n_heads": true}', "'n_heads' must be a positive integer, got True"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "use_scaled_rope": true}', "use_scaled_rope .* is not supported"),
    ],
)
def test_bad_params_json(tmp_path, meta_ckpt_dir, params, message):
    ckpt = copy_ckpt(meta_ckpt_dir, tmp_path / "ckpt")
    (ckpt / "params.json").write_text(params)
    with pytest.raises(CheckpointError, match=message):
        build_llama(ckpt)


def test_hf_config_missing_field(tmp_path, hf_ckpt_dir):
    ckpt = copy_ckpt(hf_ckpt_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    del config["intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing field.*intermediate_size"):
        build_llama(ckpt)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
     "rope_parameters .*linear.* is not supported"),  # as transformers 5 writes a scaled model's
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling .* is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' .* is not supported"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": None, "architectures": ["MistralForCausalLM"]}, r"architectures \['MistralForCausalLM'\] is not"),
    ({"model_type": "gpt2", "hidden_size": None, "n_embd": 64}, "model_type 'gpt2' is not supported"),  # not "missing"
    ({"sliding_window": 4096}, "sliding_window 4096 is not supported"),
    ({"attention_bias": True}, "attention_bias true .* is not supported"),
    ({"mlp_bias": True}, "mlp_bias true .* is not supported"),
    ({"head_dim": 32}, r"head_dim 32 other than hidden_size / num_attention_heads \(16\) is not supported"),
    ({"rms_norm_eps": "1e-5"}, "'norm_eps' must be a positive number, got '1e-5'"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": "10000"}},
     "'rope_theta' must be a positive number, got '10000'"),
])
def test_hf_config_of_another_architecture_is_refused(tmp_path, hf_ckpt_dir, change, message):
    """Loaded anyway, such a model would run but compute something else."""
    ckpt = copy_ckpt(hf_ckpt_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None or key == "rope_theta"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        build_llama(ckpt)


def test_hf_config_as_transformers_writes_a_llama_is_read(tmp_path, hf_ckpt_dir):
    ckpt = copy_ckpt(hf_ckpt_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="llama", architectures=["LLaMAForCausalLM"], hidden_act="silu", attention_bias=False,
                  mlp_bias=False, sliding_window=None,
                  head_dim=config["hidden_size"] // config["num_attention_heads"], pretraining_tp=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    (ckpt / "config.json").write_text(json.dumps(config))
    assert build_llama(ckpt).model.args.rope_theta == 10000.0


# -- build options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0", "mps", "meta", "xpu:0"])
def test_bad_device(meta_ckpt_dir, device):
    with pytest.raises(InvalidRequestError, match=rf"device must be 'auto', 'cpu' or 'cuda\[:N\]', got '{device}'"):
        build_llama(meta_ckpt_dir, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(meta_ckpt_dir):
    with pytest.raises(InvalidRequestError, match="CUDA is not available"):
        build_llama(meta_ckpt_dir, device="cuda")


@pytest.mark.parametrize("dtype", ["float64", "fp16", "int8", ""])
def test_bad_dtype(meta_ckpt_dir, dtype):
    with pytest.raises(InvalidRequestError, match=rf"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got '{dtype}'"):
        build_llama(meta_ckpt_dir, dtype=dtype)


@pytest.mark.parametrize("option, value", [("max_seq_len", 0), ("max_batch_size", -1), ("max_seq_len", 2.5),
                                           ("max_batch_size", True)])
def test_bad_build_sizes(meta_ckpt_dir, option, value):
    with pytest.raises(InvalidRequestError, match=rf"{option} must be a positive integer, got {value!r}"):
        build_llama(meta_ckpt_dir, **{option: value})


@pytest.mark.parametrize("option, value, message", [
    ("seed", "x", "seed must be None or an integer from 0 to 9223372036854775807, got 'x'"),  # not at the first request
    ("seed", -1, "seed must be None or an integer from 0 to 9223372036854775807, got -1"),
    ("seed", 2**70, "seed must be None or an integer from 0 to 9223372036854775807, got 1180591620717411303424"),
    ("seed", 1.5, "seed must be None or an integer .*, got 1.5"),
    ("compile", "yes", "compile must be True or False, got 'yes'"),
    ("max_seq_len", 1, r"max_seq_len must be at least 2 \(a prompt's first token and one more\), got 1"),
])
def test_bad_build_options(meta_ckpt_dir, option, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        build_llama(meta_ckpt_dir, **{option: value})


def test_the_context_is_the_trained_one_unless_asked_and_past_it_warns():
    assert Llama.build(None, max_batch_size=1, device="cpu").max_seq_len == 512  # the embedded model's params.json
    with pytest.warns(UserWarning, match="max_seq_len 1024 is past the 512 tokens the model in .* was trained for"):
        assert Llama.build(None, max_seq_len=1024, max_batch_size=1, device="cpu").max_seq_len == 1024


def test_load_allocates_the_context_build_does(meta_ckpt_dir):
    """llama_core.load's max_seq_len defaults as Llama.build's: the trained context (the embedded model's 512),
    DEFAULT_MAX_SEQ_LEN where the config does not state one (Meta's params.json); one asked for is taken."""
    from llama_core import load
    from llama_core.config import DEFAULT_MAX_SEQ_LEN

    assert load(None, max_batch_size=1, device="cpu").info.max_seq_len == 512
    assert load(meta_ckpt_dir, max_batch_size=1, device="cpu").info.max_seq_len == DEFAULT_MAX_SEQ_LEN
    assert load(None, max_seq_len=64, max_batch_size=1, device="cpu").info.max_seq_len == 64


# -- requests ---------------------------------------------------------------------------------------
def test_prompt_longer_than_context(llama, tokenizer):
    prompt = [tokenizer.bos_id] + [5] * (MAX_SEQ_LEN - 1)
    with pytest.raises(ContextLengthError, match=rf"prompt 0 has {MAX_SEQ_LEN} tokens, but max_seq_len is {MAX_SEQ_LEN}") as info:
        llama.generate([prompt], max_gen_len=4)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ContextLengthError, match=r"prompt 1 has \d+ tokens"):
        llama.text_completion(["short", "word " * 200], max_gen_len=4)
    with pytest.raises(ContextLengthError, match=rf"prompt 0 has {MAX_SEQ_LEN} tokens"):
        list(llama.stream(prompt, max_gen_len=4))


def test_more_prompts_than_max_batch_size(llama):
    with pytest.raises(InvalidRequestError, match="5 prompts given, but max_batch_size is 4"):
        llama.generate([[1, 5]] * 5, max_gen_len=4)
    with pytest.raises(InvalidRequestError, match="5 prompts given, but max_batch_size is 4"):
        llama.text_completion(["a"] * 5, max_gen_len=4)


def test_empty_prompt_list(llama):
    with pytest.raises(InvalidRequestError, match="no prompts given"):
        llama.generate([], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match="no prompts given"):
        llama.text_completion([], max_gen_len=4)


def test_empty_prompt(llama):
    with pytest.raises(InvalidRequestError, match="prompt 0 is empty"):
        llama.generate([[]], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match="prompt 1 is empty"):
        llama.generate([[1, 5], []], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match="prompt 0 is empty"):
        list(llama.stream([], max_gen_len=4))


def test_token_ids_outside_vocabulary(llama, tokenizer):
    last = tokenizer.n_words - 1
    with pytest.raises(InvalidRequestError, match=rf"prompt 0\[1\] is {tokenizer.n_words}: token ids are integers "
                                                  rf"from 0 to {last}"):
        llama.generate([[1, tokenizer.n_words]], max_gen_len=4)
    for bad in (-1, 2.0, True, "5"):
        with pytest.raises(InvalidRequestError, match=rf"prompt 0\[1\] is {re.escape(repr(bad))}: token ids"):
            llama.generate([[1, bad]], max_gen_len=4)


def test_prompts_of_the_wrong_type_are_named(llama):
    numpy = pytest.importorskip("numpy", reason="numpy is not installed")
    for prompt, kind in ((numpy.array([1, 5]), "numpy.ndarray"), (torch.tensor([1, 5]), "torch.Tensor")):
        with pytest.raises(InvalidRequestError, match=rf"prompt 0 must be a list of token ids, got {kind} "
                                                      r"\(convert it with .tolist\(\)\)"):
            llama.generate([prompt], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match="^prompt 0 must be a list of token ids, got str$"):
        llama.generate(["ROMEO:"], max_gen_len=4)
    with pytest.raises(InvalidRequestError, match=r"^expected a list of prompts, got torch.Tensor"):
        llama.generate(torch.tensor([[1, 5]]), max_gen_len=4)
    # integers of another integer type are token ids all the same
    as_ints = llama.generate([[1, 5]], max_gen_len=4, temperature=0)[0]
    assert llama.generate([[numpy.int64(1), torch.tensor(5)]], max_gen_len=4, temperature=0)[0] == as_ints


@pytest.mark.parametrize("temperature", [-0.1, -1, math.nan, math.inf, "0.5", None, 100.5, 1e300])
def test_bad_temperature(llama, temperature):
    expected = rf"temperature must be a finite number from 0 to 100 \(0 is greedy\), got {re.escape(repr(temperature))}"
    with pytest.raises(InvalidRequestError, match=expected):
        llama.generate([[1, 5]], max_gen_len=4, temperature=temperature)
    with pytest.raises(InvalidRequestError, match="temperature must be a finite number from 0 to 100"):
        llama.text_completion(["a"], max_gen_len=4, temperature=temperature)


def test_the_hottest_temperature_samples(llama):
    (tokens,), _ = llama.generate([[1, 5]], max_gen_len=4, temperature=100, top_p=1.0, seed=3)
    assert len(tokens) == 4


@pytest.mark.parametrize("top_p", [1.5, -0.2, 1.0000001, math.nan, "0.9"])
def test_bad_top_p(llama, top_p):
    with pytest.raises(InvalidRequestError, match=rf"top_p must be a number from 0 to 1, got {top_p!r}"):
        llama.generate([[1, 5]], max_gen_len=4, top_p=top_p)
    with pytest.raises(InvalidRequestError, match=r"top_p must be a number from 0 to 1"):
        llama.chat_completion([[{"role": "user", "content": "hi"}]], max_gen_len=4, top_p=top_p)


@pytest.mark.parametrize("max_gen_len", [0, -3, 2.0, True])
def test_bad_max_gen_len(llama, max_gen_len):
    with pytest.raises(InvalidRequestError, match=rf"max_gen_len must be an integer >= 1, got {max_gen_len!r}"):
        llama.generate([[1, 5]], max_gen_len=max_gen_len)
    with pytest.raises(InvalidRequestError, match="max_gen_len must be an integer >= 1"):
        llama.text_completion(["a"], max_gen_len=max_gen_len)


@pytest.mark.parametrize("prompts", [["a", 3], [[1, 5]], [None], "a prompt", None])
def test_text_completion_needs_a_list_of_strings(llama, prompts):
    with pytest.raises(InvalidRequestError, match="prompts must be a list of strings"):
        llama.text_completion(prompts, max_gen_len=4)


@pytest.mark.parametrize("dialogs", [{"role": "user", "content": "hi"}, []])
def test_chat_completion_needs_a_non_empty_list_of_dialogs(llama, dialogs):
    with pytest.raises(InvalidRequestError, match="dialogs must be a non-empty list of dialogs"):
        llama.chat_completion(dialogs, max_gen_len=4)


def test_request_errors_leave_the_model_usable(llama, tokenizer):
    prompt = tokenizer.encode("Once upon a time", bos=True, eos=False)
    before, _ = llama.generate([prompt], max_gen_len=8, temperature=0)
    with pytest.raises(InvalidRequestError):
        llama.generate([prompt, []], max_gen_len=8, temperature=0)
    after, _ = llama.generate([prompt], max_gen_len=8, temperature=0)
    assert before == after


def test_top_p_0_keeps_the_most_likely_token_only(llama):
    """As Meta's reference sample_top_p and OpenAI's API take it: at any temperature, the greedy reply."""
    greedy = llama.generate([[1, 5, 9]], max_gen_len=12, temperature=0)[0][0]
    for seed in range(3):
        assert llama.generate([[1, 5, 9]], max_gen_len=12, temperature=1.5, top_p=0, seed=seed)[0][0] == greedy
