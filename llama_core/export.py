"""Exporting a checkpoint to Hugging Face's layout, for transformers, llama.cpp's converter and the like.

    llama-export --to hf OUT_DIR [--ckpt-dir DIR] [--tokenizer FILE] [--dtype float16]
                 [--max-position-embeddings 4096] [--force]
    python -m llama_core.export --to hf OUT_DIR

The input is either layout (Meta's params.json + consolidated.NN.pth, or Hugging Face's own, in safetensors or
the older pytorch_model*.bin); the embedded model when --ckpt-dir is left out. OUT_DIR receives config.json,
model.safetensors (HF's tensor names, q and k in HF's rotary layout), generation_config.json (the checkpoint's own
where it has one) and a copy of tokenizer.model.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from .checkpoint_files import check_vocabulary, checkpoint_layout, find_tokenizer, read_model_args
from .cli_options import (EXIT_FAILURE, EXIT_STATUS_EPILOG, ArgumentParser, check_checkpoint, check_tokenizer,
                          exit_status, positive_int)
from .errors import LlamaError

# What max_position_embeddings says when the checkpoint does not state its context (Meta's params.json):
# Llama-2's 4,096 tokens, as Hugging Face's own convert_llama_weights_to_hf writes for Llama-2.
ASSUMED_CONTEXT = 4096
DTYPES = ("float32", "bfloat16", "float16")
# Files of a checkpoint that --force removes from OUT_DIR, so no stale one decides its layout or weights.
STALE = ("params.json", "consolidated.*.pth", "model-*-of-*.safetensors", "model.safetensors.index.json",
         "pytorch_model*.bin", "pytorch_model.bin.index.json")


class ExportError(LlamaError, ValueError):
    """An export that cannot be done as asked: the output folder is taken, or is the checkpoint itself."""


@dataclass(frozen=True)
class Exported:
    """What `export_hf` wrote."""

    out_dir: Path
    dtype: str  # the weights' dtype in model.safetensors
    parameter_count: int
    max_position_embeddings: int
    context_assumed: bool  # the checkpoint did not state its context: max_position_embeddings is ASSUMED_CONTEXT


def export_hf(ckpt_dir: Path, out_dir: Path, dtype: Optional[str] = None,
              max_position_embeddings: Optional[int] = None, force: bool = False,
              tokenizer_path: Optional[Path] = None) -> Exported:
    """Writes the checkpoint in ckpt_dir (Meta or Hugging Face layout) to out_dir in Hugging Face's layout,
    which `LlamaForCausalLM.from_pretrained(out_dir)` and this package's loader both read.

    Args:
        ckpt_dir: the checkpoint folder, with its tokenizer.model there or in its parent.
        out_dir: the folder to write; created if missing.
        dtype: "float32", "bfloat16" or "float16"; None: the dtype the embeddings are stored in, for all.
        max_position_embeddings: the context to state in config.json; None takes the checkpoint's, or
            ASSUMED_CONTEXT (Llama-2's) where it does not state one.
        force: write into an out_dir that holds files; files of another checkpoint there are removed.
        tokenizer_path: the SentencePiece tokenizer.model; None finds it beside the checkpoint.

    Returns:
        What was written, see `Exported`.

    Raises:
        CheckpointNotFoundError, CheckpointError: the checkpoint or its tokenizer is missing or unusable.
        ExportError: out_dir is a file, holds files (without force), or is ckpt_dir.
    """
    import torch

    from .checkpoint import check_state_dict, iter_rank_tensors, meta_to_hf
    from .model import Transformer
    from .tokenizer import Tokenizer

    ckpt_dir, out_dir = Path(ckpt_dir).expanduser(), Path(out_dir).expanduser()
    checkpoint_layout(ckpt_dir)  # a folder holding neither layout fails here, before anything is written
    check_out_dir(out_dir, ckpt_dir, force)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_position_embeddings is not None and (isinstance(max_position_embeddings, bool)
                                                or not isinstance(max_position_embeddings, int)
                                                or max_position_embeddings < 1):
        raise ExportError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")
    tokenizer_path = find_tokenizer(ckpt_dir, tokenizer_path)
    tokenizer = Tokenizer(tokenizer_path)
    args = read_model_args(ckpt_dir)
    if args.vocab_size == -1:
        args.vocab_size = tokenizer.n_words
    check_vocabulary(tokenizer, args, ckpt_dir)
    state = dict(iter_rank_tensors(ckpt_dir, args))
    with torch.device("meta"):
        check_state_dict(state, Transformer(args), ckpt_dir)
    weights_dtype = getattr(torch, dtype) if dtype else state["tok_embeddings.weight"].dtype

    hf_state, storages = {}, set()
    for key, tensor in state.items():
        name, tensor = meta_to_hf(key, tensor, args.n_heads, args.n_kv_heads)
        tensor = tensor.to(weights_dtype).contiguous()
        if tensor.untyped_storage().data_ptr() in storages:  # tied embeddings: safetensors stores no shared memory
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        hf_state[name] = tensor

    context = max_position_embeddings or args.max_seq_len or ASSUMED_CONTEXT
    dtype_name = str(weights_dtype).removeprefix("torch.")
    out_dir.mkdir(parents=True, exist_ok=True)
    if force:
        for pattern in STALE:
            for stale in out_dir.glob(pattern):
                stale.unlink()
    from safetensors.torch import save_file

    write_json(out_dir / "config.json", hf_config(args, context, tokenizer, dtype_name))
    save_file(hf_state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a private temporary file: give the weights the permissions of the config.
    (out_dir / "model.safetensors").chmod((out_dir / "config.json").stat().st_mode & 0o777)
    write_json(out_dir / "generation_config.json", stated_generation_config(ckpt_dir, tokenizer, context))
    if tokenizer_path.resolve() != (out_dir / "tokenizer.model").resolve():
        shutil.copyfile(tokenizer_path, out_dir / "tokenizer.model")
    return Exported(out_dir, dtype_name, args.parameter_count, context,
                    context_assumed=max_position_embeddings is None and args.max_seq_len is None)


def check_out_dir(out_dir: Path, ckpt_dir: Path, force: bool) -> None:
    """Refuses an out_dir that is a file, is the checkpoint itself, or holds files (unless force)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output {out_dir} is a file, not a folder: pass a new or empty folder")
    if out_dir.is_dir() and out_dir.resolve() == ckpt_dir.resolve():
        raise ExportError(f"output folder {out_dir} is the checkpoint being exported: pass another folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"output folder {out_dir} is not empty: pass a new or empty folder, or --force to "
                          "write into it (replacing its checkpoint files)")


def hf_config(args, max_position_embeddings: int, tokenizer, dtype: str) -> dict:
    """A LlamaForCausalLM config.json for a model of shape args (vocab_size known)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def stated_generation_config(ckpt_dir: Path, tokenizer, max_position_embeddings: int) -> dict:
    """The checkpoint's own generation_config.json (a fine-tune's sampling defaults and end-of-turn tokens), as
    it is, where it has a readable one; else generation_config's."""
    try:
        stated = json.loads((ckpt_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stated = None
    return stated if isinstance(stated, dict) else generation_config(tokenizer, max_position_embeddings)


def generation_config(tokenizer, max_position_embeddings: int) -> dict:
    """Sampling defaults as this package's (temperature 0.6, top-p 0.9), as Meta's Llama-2 models ship them."""
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "max_length": max_position_embeddings,
    }


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def build_parser() -> ArgumentParser:
    """llama-export's arguments."""
    p = ArgumentParser(prog="llama-export", description="Write a Llama-2 checkpoint (Meta or Hugging Face layout) "
                       "in Hugging Face's layout: config.json, model.safetensors, generation_config.json, "
                       "tokenizer.model.", epilog=EXIT_STATUS_EPILOG)
    p.add_argument("--to", required=True, choices=("hf",), help="the layout to write: hf (Hugging Face)")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write; new or empty, unless --force")
    p.add_argument("--ckpt-dir", type=Path, metavar="DIR", help="checkpoint to export, Meta or Hugging Face "
                   "layout (default: the embedded model)")
    p.add_argument("--tokenizer", type=Path, metavar="FILE", help="SentencePiece tokenizer.model (default: in the "
                   "checkpoint directory, then its parent)")
    p.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default: as stored)")
    p.add_argument("--max-position-embeddings", type=positive_int, metavar="N", help="the context config.json states "
                   f"(default: the checkpoint's; {ASSUMED_CONTEXT}, Llama-2's, where it does not state one)")
    p.add_argument("--force", action="store_true", help="write into a folder that holds files, replacing the "
                   "checkpoint files there")
    return p


def main(argv: Optional[list[str]] = None, stdout: Optional[TextIO] = None) -> int:
    """Exports once. Returns the exit status: 0; 2 for a usage error (argparse's: an unknown option or a bad
    value); 1 for a failure at run time (a checkpoint missing or unusable, an output folder that is taken, a
    write that failed); 130 on Ctrl-C."""
    try:
        return _run(argv, stdout)
    except KeyboardInterrupt:  # Ctrl-C (torch importing, the weights being read or written): no traceback
        print(file=sys.stderr)
        return 130


def _run(argv: Optional[list[str]], stdout: Optional[TextIO]) -> int:
    stdout = stdout or sys.stdout
    options = build_parser().parse_args(argv)
    try:
        ckpt_dir = check_checkpoint(options.ckpt_dir)
        tokenizer_path, _ = check_tokenizer(ckpt_dir, options.tokenizer)
        exported = export_hf(ckpt_dir, options.out_dir, options.dtype, options.max_position_embeddings,
                             options.force, tokenizer_path)
    except LlamaError as exc:  # ResourceError, ExportError, or a checkpoint whose tensors do not fit its config
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except OSError as exc:
        print(f"error: could not write {options.out_dir}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if exported.context_assumed:
        print(f"note: {ckpt_dir.name} does not state its context; config.json says max_position_embeddings "
              f"{ASSUMED_CONTEXT} (Llama-2's): pass --max-position-embeddings N if it was trained for another",
              file=sys.stderr)
    print(f"wrote {exported.out_dir} (Hugging Face layout): {exported.parameter_count:,} parameters in "
          f"{exported.dtype}, context {exported.max_position_embeddings:,}", file=stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
