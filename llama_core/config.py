"""Model hyper-parameters, read from Meta's params.json or Hugging Face's config.json."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from .errors import CheckpointError, CheckpointNotFoundError

DEFAULT_MAX_SEQ_LEN = 2048  # context allocated when none is asked for and the model allows it


def default_context(trained: Optional[int]) -> int:
    """The context allocated when none is asked for: the model's trained one (where its config states it), at
    most DEFAULT_MAX_SEQ_LEN."""
    return min(DEFAULT_MAX_SEQ_LEN, trained or DEFAULT_MAX_SEQ_LEN)


@dataclass
class ModelArgs:
    dim: int = 4096  # width of the residual stream
    n_layers: int = 32  # transformer blocks
    n_heads: int = 32  # query heads
    n_kv_heads: Optional[int] = None  # key/value heads (grouped-query attention); None means n_heads
    vocab_size: int = -1  # -1: filled in from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None  # scales the SwiGLU hidden size (Llama-2 70B: 1.3)
    hidden_dim: Optional[int] = None  # SwiGLU hidden size; None derives it by Meta's rule
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # rotary embedding base
    max_seq_len: Optional[int] = None  # longest context the model was trained for; None: its config does not say

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if value is None and name in ("hidden_dim", "max_seq_len"):  # derived, or not stated
                continue
            if not _is_int(value) or value < 1:
                raise CheckpointError(f"model config field '{name}' must be a positive integer, got {value!r}")
        if not _is_int(self.vocab_size) or (self.vocab_size < 1 and self.vocab_size != -1):
            raise CheckpointError(f"model config field 'vocab_size' must be a positive integer (or -1: the "
                                  f"tokenizer's), got {self.vocab_size!r}")
        for name in ("ffn_dim_multiplier", "norm_eps", "rope_theta"):
            value = getattr(self, name)
            if value is None and name == "ffn_dim_multiplier":
                continue
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"model config field '{name}' must be a positive number, got {value!r}")
            setattr(self, name, float(value))
        if self.dim % self.n_heads:
            raise CheckpointError(f"model config: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(
                f"model config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"model config: head dimension {self.head_dim} must be even for rotary embeddings")
        if self.hidden_dim is None:
            hidden = int(2 * (4 * self.dim) / 3)
            if self.ffn_dim_multiplier is not None:
                hidden = int(self.ffn_dim_multiplier * hidden)
            self.hidden_dim = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def parameter_count(self) -> int:
        """Weights of a model of this shape (vocab_size known): what it holds before anything is loaded."""
        if self.vocab_size < 1:
            raise CheckpointError("model config: vocab_size is not known yet (read it from the tokenizer)")
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)  # wq, wo; wk, wv
        block = attention + 3 * self.dim * self.hidden_dim + 2 * self.dim  # + SwiGLU w1, w2, w3 + two norms
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim  # embeddings, output, final norm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta_params(cls, path: Path) -> "ModelArgs":
        """Reads Meta's params.json; unknown keys are ignored."""
        raw = _read_json(path)
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"{path}: missing field(s) {', '.join(missing)}")
        if raw.get("use_scaled_rope"):
            raise CheckpointError(f"{path}: use_scaled_rope (Llama 3.1's rotary scaling) is not supported "
                                  "(Llama-2 uses none)")
        known = {f.name for f in fields(cls)}
        return _build(cls, {k: v for k, v in raw.items() if k in known}, path)

    @classmethod
    def from_hf_config(cls, path: Path) -> "ModelArgs":
        """Reads a Hugging Face LlamaForCausalLM config.json."""
        raw = _read_json(path)
        mapping = {
            "hidden_size": "dim",
            "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads",
            "num_key_value_heads": "n_kv_heads",
            "vocab_size": "vocab_size",
            "intermediate_size": "hidden_dim",
            "rms_norm_eps": "norm_eps",
            "rope_theta": "rope_theta",
            "max_position_embeddings": "max_seq_len",
        }
        _refuse_unsupported(raw, path)  # first: another architecture's config lacks Llama's fields too
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size") if k not in raw]
        if missing:
            raise CheckpointError(f"{path}: missing field(s) {', '.join(missing)}")
        nested = raw["rope_parameters"].get("rope_theta") if isinstance(raw.get("rope_parameters"), dict) else None
        if raw.get("rope_theta") is None:
            raw["rope_theta"] = 10000.0 if nested is None else nested
        elif nested is not None and nested != raw["rope_theta"]:  # which one transformers reads depends on its version
            raise CheckpointError(f"{path}: rope_theta is {raw['rope_theta']!r}, but rope_parameters.rope_theta is "
                                  f"{nested!r}: keep the one the model was trained with")
        return _build(cls, {ours: raw[theirs] for theirs, ours in mapping.items() if raw.get(theirs) is not None}, path)


def _refuse_unsupported(raw: dict[str, Any], path: Path) -> None:
    """Raises CheckpointError for a config.json field that makes a model other than Llama-2's architecture:
    loaded anyway, such a model would run, but compute something else."""
    def refuse(what: str) -> None:
        raise CheckpointError(f"{path}: {what} is not supported (llama_core runs Llama-2's architecture)")

    if raw.get("model_type", "llama") != "llama":
        refuse(f"model_type {raw['model_type']!r}")
    architectures = raw.get("architectures")
    if isinstance(architectures, list) and any(str(name).lower() != "llamaforcausallm" for name in architectures):
        refuse(f"architectures {architectures!r}")  # (early conversions spelled it LLaMAForCausalLM)
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act {raw['hidden_act']!r} (Llama-2's SwiGLU uses silu)")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name):
            refuse(f"{name} true (Llama-2's projections have no biases)")
    if raw.get("sliding_window") is not None:
        refuse(f"sliding_window {raw['sliding_window']!r}")
    if raw.get("rope_scaling"):
        refuse(f"rope_scaling {raw['rope_scaling']!r} (Llama-2 uses none)")
    rope = raw.get("rope_parameters")
    if rope is not None and (not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default"):
        refuse(f"rope_parameters {rope!r} (Llama-2's rotary embeddings are rope_type 'default')")
    head_dim, width, heads = raw.get("head_dim"), raw.get("hidden_size"), raw.get("num_attention_heads")
    if head_dim is not None and _is_int(width) and _is_int(heads) and heads > 0 and head_dim != width // heads:
        refuse(f"head_dim {head_dim!r} other than hidden_size / num_attention_heads ({width // heads})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointNotFoundError(f"model config not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"model config {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _build(cls, values: dict[str, Any], path: Path) -> ModelArgs:
    try:
        return cls(**values)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except TypeError as exc:
        raise CheckpointError(f"{path}: invalid model config: {exc}") from exc
