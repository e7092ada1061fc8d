"""Loading Llama-2 weights from Meta's layout (params.json + consolidated.NN.pth) or Hugging Face's
(config.json + *.safetensors), into a model built on the meta device so host memory holds one copy."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from .checkpoint_files import checkpoint_layout, hf_weight_files, meta_shard_paths
from .checkpoint_files import read_model_args  # noqa: F401  (its old home: callers may import it from here)
from .config import ModelArgs
from .errors import CheckpointError
from .model import Transformer

# Model-parallel split of Meta's shards: dimension to concatenate along, or None (replicated).
META_SHARD_DIM = {
    "tok_embeddings": 1,
    "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
    "wo": 1, "w2": 1,
}

_HF_NAMES = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", r"layers.\1.attention.wq.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", r"layers.\1.attention.wk.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", r"layers.\1.attention.wv.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
]
# The same table read the other way: Meta's names as patterns, HF's as replacements.
_META_NAMES = [
    (re.escape(meta).replace(re.escape(r"\1"), r"(\d+)"), hf.replace(r"(\d+)", r"\1").replace("\\.", "."))
    for hf, meta in _HF_NAMES
]


def load_model(ckpt_dir: Path, args: ModelArgs, device: torch.device, dtype: torch.dtype,
               progress: bool = False) -> Transformer:
    """Builds the model on the meta device and assigns the checkpoint's tensors, cast to dtype on device;
    with progress, a bar on stderr follows the weights as they are placed."""
    if checkpoint_layout(ckpt_dir) == "meta":
        state_dict = load_meta_state_dict(ckpt_dir)
    else:
        state_dict = load_hf_state_dict(ckpt_dir, args)
    with torch.device("meta"):
        model = Transformer(args)
    check_state_dict(state_dict, model, ckpt_dir)
    with WeightsProgress(model, dtype, progress) as bar:
        state_dict = {name: bar.placed(t.to(device=device, dtype=dtype)) for name, t in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.requires_grad_(False).eval()


class WeightsProgress(tqdm):
    """A progress bar over the bytes of a meta-device model's weights in dtype, advanced by `placed(tensor)`
    as each arrives on its device; silent unless enabled."""

    def __init__(self, model: Transformer, dtype: torch.dtype, enabled: bool) -> None:
        total = sum(t.numel() for t in model.state_dict().values()) * dtype.itemsize
        super().__init__(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                         disable=not enabled)

    def placed(self, tensor: torch.Tensor) -> torch.Tensor:
        self.update(tensor.numel() * tensor.element_size())
        return tensor


def load_meta_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Loads consolidated.NN.pth shards, merging model-parallel ones into a single-device state dict."""
    shard_paths = meta_shard_paths(ckpt_dir)
    shards = [load_torch_file(p) for p in tqdm(shard_paths, desc="loading shards", unit="shard", disable=len(shard_paths) < 2)]
    if len(shards) == 1:
        return {name: t for name, t in shards[0].items() if not name.endswith("rope.freqs")}
    return merge_meta_shards(shards, shard_paths)


def merge_meta_shards(shards: list[dict[str, torch.Tensor]], paths: list[Path]) -> dict[str, torch.Tensor]:
    keys = set(shards[0])
    for shard, path in zip(shards[1:], paths[1:]):
        if set(shard) != keys:
            odd = sorted(set(shard) ^ keys)[:3]
            raise CheckpointError(f"shard {path} does not fit {paths[0]}: differing tensors {odd}")
    merged = {}
    for name in sorted(keys):
        if name.endswith("rope.freqs"):
            continue
        parts = [shard[name] for shard in shards]
        dim = META_SHARD_DIM.get(name.split(".")[-2]) if parts[0].dim() > 1 else None
        if dim is None:
            merged[name] = parts[0]
            continue
        other = [s for i, s in enumerate(parts[0].shape) if i != dim]
        for part, path in zip(parts, paths):
            if [s for i, s in enumerate(part.shape) if i != dim] != other:
                raise CheckpointError(
                    f"shard {path}: tensor {name} has shape {tuple(part.shape)}, which does not fit "
                    f"{tuple(parts[0].shape)} in {paths[0]}"
                )
        merged[name] = torch.cat(parts, dim=dim)
    return merged


def load_hf_state_dict(ckpt_dir: Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Loads Hugging Face safetensors, renames to Meta's names and undoes HF's rotary permutation."""
    from safetensors import SafetensorError, safe_open

    files = hf_weight_files(ckpt_dir)
    raw: dict[str, torch.Tensor] = {}
    for path in tqdm(files, desc="loading shards", unit="shard", disable=len(files) < 2):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    raw[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read weight shard {path}: {exc}") from exc
    if "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw and hf_ties_embeddings(ckpt_dir):
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
    converted = (hf_to_meta(ckpt_dir, key, tensor, args.n_heads, args.n_kv_heads) for key, tensor in raw.items())
    return dict(item for item in converted if item is not None)


def hf_to_meta(ckpt_dir: Path, key: str, tensor: torch.Tensor, n_heads: int, n_kv_heads: int):
    """(Meta name, tensor) for a Hugging Face tensor, with HF's rotary permutation of q and k undone over
    the heads the tensor holds; None for tensors Meta's layout has no place for (rotary inv_freq)."""
    name = hf_to_meta_name(key)
    if name is None:
        if key.endswith("rotary_emb.inv_freq"):
            return None
        raise CheckpointError(f"{ckpt_dir}: unexpected tensor {key} in Hugging Face checkpoint")
    if name.endswith("attention.wq.weight"):
        tensor = unpermute_rotary(tensor, n_heads)
    elif name.endswith("attention.wk.weight"):
        tensor = unpermute_rotary(tensor, n_kv_heads)
    return name, tensor


def meta_to_hf(key: str, tensor: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, tensor) for a tensor of Meta's layout, q and k permuted to HF's rotary layout:
    the inverse of `hf_to_meta`."""
    for meta_pattern, hf_replacement in _META_NAMES:
        if re.fullmatch(meta_pattern, key):
            name = re.sub(meta_pattern, hf_replacement, key)
            break
    else:
        raise CheckpointError(f"tensor {key} has no Hugging Face name (not a Llama-2 weight)")
    if key.endswith("attention.wq.weight"):
        tensor = permute_rotary(tensor, n_heads)
    elif key.endswith("attention.wk.weight"):
        tensor = permute_rotary(tensor, n_kv_heads)
    return name, tensor


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of HF's conversion permute: half-split rotary layout back to Meta's interleaved pairs."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved rotary layout to HF's half-split one (what HF's conversion script does)."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def check_state_dict(state_dict: dict[str, torch.Tensor], model: Transformer, ckpt_dir: Path) -> None:
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir} lacks tensor(s) {missing[:5]} for n_layers={model.args.n_layers}")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {ckpt_dir} has unexpected tensor(s) {unexpected[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"checkpoint {ckpt_dir}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"but the model config expects {tuple(expected[name].shape)}"
            )


def load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, pickle errors, EOFError... for broken files
        raise CheckpointError(f"cannot read weight shard {path} (truncated or not a PyTorch file?): {exc}") from exc
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"weight shard {path} holds a {type(state_dict).__name__}, expected a state dict")
    return state_dict


def hf_to_meta_name(key: str) -> Optional[str]:
    for pattern, replacement in _HF_NAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, replacement, key)
    return None


def hf_ties_embeddings(ckpt_dir: Path) -> bool:
    try:
        return bool(json.loads((ckpt_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False
