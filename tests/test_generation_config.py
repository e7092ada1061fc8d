"""A checkpoint's generation_config.json (llama_core.generation_config): its sampling and end-of-sequence ids,
read where present, what cannot be used warned about and left out, never an error; on the loaded model's
ModelInfo, and as llama-generate's defaults where its user gave no --temperature or --top-p."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest

from llama_core import DEFAULT_CKPT_DIR, generate_cli
from llama_core.generation_config import GenerationConfig, read_generation_config


def written(folder: Path, config) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


def test_the_stated_sampling_and_end_tokens_are_read(tmp_path):
    stated = {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "eos_token_id": [2, 32000, 2], "max_length": 4096}
    config = read_generation_config(written(tmp_path, stated))
    assert config == GenerationConfig(temperature=0.7, top_p=0.95, eos_token_ids=(2, 32000))
    assert config.sampling() == {"temperature": 0.7, "top_p": 0.95}
    assert read_generation_config(written(tmp_path, {"eos_token_id": 2})) == GenerationConfig(eos_token_ids=(2,))


def test_do_sample_false_is_greedy_whatever_the_temperature(tmp_path):
    config = read_generation_config(written(tmp_path, {"do_sample": False, "temperature": 0.9, "top_p": 0.6}))
    assert config.sampling() == {"temperature": 0.0, "top_p": 0.6}


def test_a_temperature_is_taken_up_to_the_most_a_request_may_ask(tmp_path):
    from llama_core import generation_config
    from llama_core.serving import requests

    assert generation_config.MAX_TEMPERATURE == requests.MAX_TEMPERATURE
    assert read_generation_config(written(tmp_path, {"temperature": 100})).temperature == 100.0


def test_no_file_or_no_folder_says_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_generation_config(tmp_path) == read_generation_config(None) == GenerationConfig()
        assert GenerationConfig().sampling() == {}


@pytest.mark.parametrize("text, said", [
    ("{not json", "cannot be read as JSON"),
    ("[0.6, 0.9]", "holds a list, not a JSON object"),
    (b"\xff\xfe", "cannot be read as JSON"),
])
def test_a_file_that_is_not_a_json_object_is_ignored_with_a_warning(tmp_path, text, said):
    (tmp_path / "generation_config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.warns(UserWarning, match=said) as caught:
        assert read_generation_config(tmp_path) == GenerationConfig()
    assert len(caught) == 1 and str(tmp_path) in str(caught[0].message)


@pytest.mark.parametrize("field, value, kept", [
    ("temperature", -1, {"top_p": 0.9}), ("temperature", "hot", {"top_p": 0.9}), ("temperature", True, {"top_p": 0.9}),
    ("temperature", 1e9, {"top_p": 0.9}), ("top_p", 1.5, {"temperature": 0.6}), ("top_p", None, {"temperature": 0.6}),
    ("do_sample", "no", {"temperature": 0.6, "top_p": 0.9}),
    ("eos_token_id", "</s>", {"temperature": 0.6, "top_p": 0.9}),
    ("eos_token_id", [2, -1], {"temperature": 0.6, "top_p": 0.9}),
])
def test_a_field_that_cannot_be_used_is_ignored_with_a_warning_naming_it(tmp_path, field, value, kept):
    ckpt_dir = written(tmp_path, {"temperature": 0.6, "top_p": 0.9, field: value})
    if value is None:  # null: as if absent, nothing to say
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert read_generation_config(ckpt_dir).sampling() == kept
        return
    with pytest.warns(UserWarning, match=f"generation_config.json: {field} .*: it is ignored"):
        config = read_generation_config(ckpt_dir)
    assert config.sampling() == kept and config.eos_token_ids == ()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The embedded model in Hugging Face's layout, as llama-export writes it (with a generation_config.json)."""
    from llama_core.export import export_hf

    out = tmp_path_factory.mktemp("exported") / "tiny-shakespeare-hf"
    export_hf(DEFAULT_CKPT_DIR, out)
    return out


def test_the_loaded_models_info_carries_the_checkpoints_generation_config(exported, tmp_path):
    from llama_core.loader import load

    info = load(exported, max_seq_len=64, max_batch_size=1, device="cpu").info
    assert info.generation_config == GenerationConfig(temperature=0.6, top_p=0.9, eos_token_ids=(2,))
    assert load(None, max_seq_len=64, max_batch_size=1, device="cpu").info.generation_config == GenerationConfig()


@pytest.mark.parametrize("config, flags, expected", [
    ({"do_sample": False}, [], (0.0, 0.9)),  # greedy; top_p SamplingParams' own
    ({"temperature": 0.8, "top_p": 0.5}, [], (0.8, 0.5)),
    ({"temperature": 0.8, "top_p": 0.5}, ["--temperature", "1.2"], (1.2, 0.5)),
    ({"temperature": 0.8, "top_p": 0.5}, ["--temperature", "1.2", "--top-p", "0.7"], (1.2, 0.7)),
    ({}, [], (0.6, 0.9)),
    ("{broken", [], (0.6, 0.9)),
])
def test_generate_samples_as_the_checkpoint_says_where_no_flag_does(exported, tmp_path, monkeypatch, config, flags,
                                                                    expected):
    ckpt_dir = tmp_path / "model"
    ckpt_dir.mkdir()
    for path in exported.iterdir():
        (ckpt_dir / path.name).symlink_to(path)
    (ckpt_dir / "generation_config.json").unlink()
    written(ckpt_dir, config)
    reached = []
    monkeypatch.setattr(generate_cli, "generate", lambda plan, args, params, *rest: reached.append(params) or 0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        status = generate_cli.main(["ROMEO:", "-q", "--device", "cpu", "--ckpt-dir", str(ckpt_dir), *flags],
                                   stdout=io.StringIO())
    assert status == 0 and (reached[0].temperature, reached[0].top_p) == expected


def with_generation_config(exported: Path, folder: Path, config) -> Path:
    """The exported model in folder (its files linked), with generation_config.json holding config."""
    folder.mkdir()
    for path in exported.iterdir():
        if path.name != "generation_config.json":
            (folder / path.name).symlink_to(path)
    return written(folder, config)


def greedy_reply(ckpt_dir: Path, prompt: str, max_new_tokens: int, **controls) -> tuple[list[int], str]:
    """The engine's greedy reply's tokens and its finish reason."""
    from llama_core.loader import load
    from llama_core.serving.engine import Engine

    with Engine(load(ckpt_dir, max_seq_len=64, max_batch_size=1, device="cpu"), seed=0) as engine:
        tokens = engine.tokenizer.encode(prompt, bos=True, eos=False)
        stream = engine.submit(tokens, max_new_tokens, temperature=0, **controls)
        return [chunk.token for chunk in stream], stream.finish_reason


def test_a_reply_ends_at_any_end_id_of_generation_config_as_at_the_tokenizers_eos(exported, tmp_path, capsys):
    """eos_token_id may name ids other than the tokenizer's EOS (Llama-3's [128001, 128009], a fine-tune's end of
    turn): the engine, and so llama-generate, end the reply at any of them, with the finish reason of an EOS."""
    plain, reason = greedy_reply(exported, "ROMEO:", 12)
    assert reason == "length"
    at = next(i for i, token in enumerate(plain) if i >= 2 and token not in plain[:i])  # its first time drawn
    ckpt_dir = with_generation_config(exported, tmp_path / "model", {"eos_token_id": [2, plain[at]]})
    assert greedy_reply(ckpt_dir, "ROMEO:", 12) == (plain[:at], "eos")

    capsys.readouterr()
    status = generate_cli.main(["ROMEO:", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu",
                                "--ckpt-dir", str(ckpt_dir)], stdout=(out := io.StringIO()))
    from llama_core.tokenizer import Tokenizer

    text = Tokenizer(str(ckpt_dir / "tokenizer.model")).decode(plain[:at])
    assert status == 0 and out.getvalue().strip() == text.strip()
    assert f"[{at} tokens," in (said := capsys.readouterr().err) and "finish reason: eos]" in said
