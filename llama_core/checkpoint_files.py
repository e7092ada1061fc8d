"""A checkpoint folder's files, found without reading a tensor: its layout (Meta or Hugging Face), its
config, its weight files and its tokenizer. No torch here, so a command line can check a checkpoint in
milliseconds, before anything heavy is imported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .config import ModelArgs
from .errors import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


def checkpoint_layout(ckpt_dir: Path) -> str:
    """'meta' for a params.json checkpoint, 'hf' for a config.json one. A folder with both files is the layout
    whose weights are there too (a stray params.json beside Hugging Face's files, say).

    Raises:
        CheckpointNotFoundError: no such directory, or neither file in it.
        CheckpointError: both layouts whole in one folder: which to load is the user's to say.
    """
    if not ckpt_dir.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    meta, hf = (ckpt_dir / "params.json").is_file(), (ckpt_dir / "config.json").is_file()
    if meta and hf:
        meta_weights = any(ckpt_dir.glob("consolidated.*.pth"))
        hf_weights = any((ckpt_dir / name).is_file() for pair in HF_WEIGHTS for name in pair)
        if meta_weights and hf_weights:
            raise CheckpointError(f"{ckpt_dir} holds two checkpoints: Meta's layout (params.json, consolidated.*.pth) "
                                  "and Hugging Face's (config.json and its weights); move one of them to a folder "
                                  "of its own")
        return "hf" if hf_weights else "meta"
    if meta:
        return "meta"
    if hf:
        return "hf"
    raise CheckpointNotFoundError(
        f"no params.json (Meta layout) or config.json (Hugging Face layout) in checkpoint directory {ckpt_dir}"
    )


def read_model_args(ckpt_dir: Path) -> ModelArgs:
    """The model's hyper-parameters, from params.json (Meta) or config.json (Hugging Face)."""
    if checkpoint_layout(ckpt_dir) == "meta":
        return ModelArgs.from_meta_params(ckpt_dir / "params.json")
    return ModelArgs.from_hf_config(ckpt_dir / "config.json")


HALF_DTYPES = ("float16", "bfloat16")


def stored_dtype(ckpt_dir: Path) -> Optional[str]:
    """The 16-bit dtype a Hugging Face checkpoint says its weights are stored in (config.json's "torch_dtype",
    or "dtype" as newer transformers write it), else None (Meta's params.json does not say)."""
    if checkpoint_layout(ckpt_dir) != "hf":
        return None
    try:
        config = json.loads((ckpt_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return value if value in HALF_DTYPES else None


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The files holding the weights, in either layout.

    Raises:
        CheckpointNotFoundError: the folder, its config or a weight file is missing.
        CheckpointError: a shard index that cannot be read.
    """
    if checkpoint_layout(ckpt_dir) == "meta":
        return meta_shard_paths(ckpt_dir)
    return hf_weight_files(ckpt_dir)


def meta_shard_paths(ckpt_dir: Path) -> list[Path]:
    """consolidated.00.pth, consolidated.01.pth, ... (one per model-parallel rank Meta trained with)."""
    paths = sorted(ckpt_dir.glob("consolidated.*.pth"))
    if not paths:
        raise CheckpointNotFoundError(f"no consolidated.*.pth weight shard in {ckpt_dir}")
    numbers = [int(m.group(1)) for p in paths if (m := re.fullmatch(r"consolidated\.(\d+)\.pth", p.name))]
    if sorted(numbers) != list(range(len(paths))):
        missing = sorted(set(range(max(numbers, default=0) + 1)) - set(numbers))
        found = ", ".join(p.name for p in paths)
        raise CheckpointNotFoundError(
            f"weight shards in {ckpt_dir} must be numbered from consolidated.00.pth on, none missing; found "
            f"{found}" + (f": consolidated.{missing[0]:02}.pth is missing" if missing else "")
        )
    return paths


PADDED_ROWS = 64  # a model may have up to 1/64 more vocabulary rows than its tokenizer has pieces


def vocabulary_fits(pieces: int, rows: int) -> bool:
    """Whether a model of `rows` vocabulary rows goes with a tokenizer of `pieces` (see check_vocabulary)."""
    return pieces <= rows <= pieces + pieces // PADDED_ROWS


def check_vocabulary(tokenizer: "Tokenizer", args: ModelArgs, ckpt_dir: Path) -> None:
    """Raises CheckpointError unless the model has a vocabulary row for each of the tokenizer's pieces: as many,
    or a few more (a fine-tune's vocabulary padded for an added token or to a round size, 32001 or 32032 rows
    for Llama-2's 32,000 pieces: the rows past the pieces are never drawn). Many more means another tokenizer."""
    pieces, rows = tokenizer.n_words, args.vocab_size
    if not vocabulary_fits(pieces, rows):
        raise CheckpointError(f"tokenizer {tokenizer.model_path} has {pieces} pieces but the model in {ckpt_dir} has "
                              f"vocab_size {rows}: the tokenizer is not the model's (a padded vocabulary may have "
                              f"{pieces} to {pieces + pieces // PADDED_ROWS} rows)")


HF_WEIGHTS = (("model.safetensors.index.json", "model.safetensors"),
              ("pytorch_model.bin.index.json", "pytorch_model.bin"))  # safetensors first, where a folder has both


def hf_weight_files(ckpt_dir: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists; else the same in PyTorch's format
    (pytorch_model.bin, or pytorch_model-0000X-of-0000Y.bin listed by pytorch_model.bin.index.json), as older
    Hugging Face checkpoints and many Llama-2 fine-tunes are stored."""
    for index_name, single_name in HF_WEIGHTS:
        index = ckpt_dir / index_name
        if index.is_file():
            try:
                files = [ckpt_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"cannot read shard index {index}: {exc}") from exc
            for path in files:
                if not path.is_file():
                    raise CheckpointNotFoundError(f"weight shard {path} listed in {index} not found")
            return files
        single = ckpt_dir / single_name
        if single.is_file():
            return [single]
    for (index_name, _), pattern in zip(HF_WEIGHTS, ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin")):
        shards = sorted(path.name for path in ckpt_dir.glob(pattern))
        if shards:
            raise CheckpointNotFoundError(f"{ckpt_dir} holds weight shards ({shards[0]}, ...) but not {index_name}, "
                                          "which lists the tensors in each: copy it from where the shards came from")
    raise CheckpointNotFoundError(f"no model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
                                  f"pytorch_model.bin.index.json in {ckpt_dir}")


def find_tokenizer(ckpt_dir: Path, tokenizer_path: Optional[str | Path] = None) -> Path:
    """tokenizer_path if given, else tokenizer.model in ckpt_dir or its parent (Meta's downloads keep it there).

    Raises:
        CheckpointNotFoundError: no such file.
    """
    if tokenizer_path is not None:
        path = Path(tokenizer_path).expanduser()
        if not path.is_file():
            raise CheckpointNotFoundError(f"tokenizer model not found: {path}")
        return path
    for candidate in (ckpt_dir / "tokenizer.model", ckpt_dir.parent / "tokenizer.model"):
        if candidate.is_file():
            return candidate
    raise CheckpointNotFoundError(
        f"no tokenizer.model in {ckpt_dir} or its parent {ckpt_dir.parent}; pass tokenizer_path"
    )
