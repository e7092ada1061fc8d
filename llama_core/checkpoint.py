"""Loading Llama-2 weights from Meta's layout (params.json + consolidated.NN.pth) or Hugging Face's
(config.json + *.safetensors, or the older pytorch_model*.bin), into a model built on the meta device. Tensors
are read one at a time (mmap'd files; Meta's model-parallel shards concatenated tensor by tensor) and each part
of the model is assigned as soon as its weights are in, so loading holds little beyond the model itself."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

from .checkpoint_files import checkpoint_layout, hf_weight_files, meta_shard_paths
from .config import ModelArgs
from .errors import CheckpointError
from .model import Transformer

# Model-parallel split of Meta's shards: dimension to concatenate along, or None (replicated).
META_SHARD_DIM = {
    "tok_embeddings": 1,
    "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
    "wo": 1, "w2": 1,
}

# Dimension a tensor-parallel rank takes its 1/N slice along (llama_core.distributed.parallel); every
# other tensor is replicated.
TP_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}

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


def load_model(ckpt_dir: Path, args: ModelArgs, device: torch.device, dtype: torch.dtype, progress: bool = False,
               assigned: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None,
               projections_as_stored: bool = False) -> Transformer:
    """Builds the model on the meta device and assigns the checkpoint's tensors as they are read, each cast to
    dtype on device; with progress, a bar on stderr follows them. assigned(part) is called on each part of the
    model (a block, the embeddings, the final norm, the output layer) once its weights are in, e.g. to
    quantize it (a module it returns takes the part's place): so a checkpoint quantized while it loads never
    has every weight in full precision at once. With projections_as_stored, a projection's weight stored in
    bfloat16 or float16 is assigned as stored, not cast: for an `assigned` that puts it in a layout of its
    own (the CPU's 16-bit panels) before anything runs."""
    with torch.device("meta"):
        model = Transformer(args)

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        keep = projections_as_stored and tensor.dtype in (torch.bfloat16, torch.float16) and _is_projection(name)
        return bar.placed(name, tensor.to(device=device, dtype=tensor.dtype if keep else dtype))

    with WeightsProgress(model, ckpt_dir, progress) as bar:
        assign_weights(model, iter_rank_tensors(ckpt_dir, args), ckpt_dir, place, assigned)
    return model.requires_grad_(False).eval()


_PROJECTIONS = (*TP_SPLIT_DIM, "output")


def _is_projection(name: str) -> bool:
    module, _, kind = name.rpartition(".")
    return kind == "weight" and module.rpartition(".")[2] in _PROJECTIONS


def assign_weights(model: Transformer, tensors: Iterable[tuple[str, torch.Tensor]], ckpt_dir: Path,
                   place: Callable[[str, torch.Tensor], torch.Tensor],
                   assigned: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None) -> None:
    """Fills a meta-device model (whole, or one rank's shard) from (name, tensor) pairs as they are read,
    place(name, tensor) moving each where it is to live. Each part of the model (a block, the embeddings,
    the final norm, the output layer) is assigned once its last tensor is in and then handed to assigned,
    which may return a module to take its place: only the parts still being read are held outside the model.

    Raises:
        CheckpointError: a tensor the model has no place for, one of the wrong shape or given twice, or
            tensors missing.
    """
    expected = model.state_dict()
    counts = Counter(map(model_part, expected))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in expected:
            raise CheckpointError(f"checkpoint {ckpt_dir} has tensor {stored_name(ckpt_dir, name)}, which the model "
                                  f"config (n_layers={model.args.n_layers}) has no place for")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(_shape_message(ckpt_dir, name, tensor.shape, expected[name].shape))
        if name in seen:
            raise CheckpointError(f"checkpoint {ckpt_dir} holds tensor {stored_name(ckpt_dir, name)} twice")
        seen.add(name)
        part = model_part(name)
        held = pending.setdefault(part, {})
        held[name] = place(name, tensor)
        if len(held) == counts[part]:
            module = model.get_submodule(part)
            module.load_state_dict({key[len(part) + 1:]: t for key, t in pending.pop(part).items()}, strict=True, assign=True)
            replacement = assigned(module) if assigned is not None else None
            if replacement is not None and replacement is not module:
                model.set_submodule(part, replacement)
    missing = sorted(set(expected) - seen, key=_natural_order)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir} lacks tensor(s) {[stored_name(ckpt_dir, n) for n in missing[:5]]} "
                              f"for n_layers={model.args.n_layers}")


def stored_name(ckpt_dir: Path, name: str) -> str:
    """A weight's name as the checkpoint's files store it, for messages: Hugging Face's in its layout
    (model.layers.0.mlp.up_proj.weight for layers.0.feed_forward.w3.weight), else Meta's, the model's own."""
    if checkpoint_layout(ckpt_dir) != "hf":
        return name
    for meta_pattern, hf_replacement in _META_NAMES:
        if re.fullmatch(meta_pattern, name):
            return re.sub(meta_pattern, hf_replacement, name)
    return name


def model_part(name: str) -> str:
    """The part of the model a weight belongs to: "layers.N" for a block's, else its top-level module
    ("tok_embeddings", "norm", "output"): the units that are assigned, quantized and placed whole."""
    head, *rest = name.split(".")
    return f"{head}.{rest[0]}" if head == "layers" else head


def _natural_order(name: str) -> list:
    return [int(piece) if piece.isdigit() else piece for piece in name.split(".")]


class WeightsProgress(tqdm):
    """A progress bar over the bytes the checkpoint's files hold for a meta-device model's weights (the whole
    model, or one rank's shard), as stored: 2 per element of a bfloat16 or float16 file, whatever dtype they
    load in, so its size is the files' on disk. Advanced by `placed(name, tensor)` as each weight arrives on its
    device; silent unless enabled (the files' indexes are then not read)."""

    def __init__(self, model: Transformer, ckpt_dir: Path, enabled: bool) -> None:
        self.itemsizes = stored_itemsizes(ckpt_dir) if enabled else {}
        total = sum(t.numel() * self.itemsizes.get(name, 0) for name, t in model.state_dict().items())
        super().__init__(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                         disable=not enabled)

    def placed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.update(tensor.numel() * self.itemsizes.get(name, 0))  # as stored, whatever it is cast to
        return tensor


def stored_itemsizes(ckpt_dir: Path) -> dict[str, int]:
    """Each weight's bytes per element in the checkpoint's files (Meta's names), from the files' indexes alone;
    an output layer tied to the embeddings and not stored has none (it is not read)."""
    if checkpoint_layout(ckpt_dir) == "meta":  # the shards store a tensor alike
        return {name: t.element_size() for name, t in load_torch_file(meta_shard_paths(ckpt_dir)[0]).items()}
    itemsizes = {}
    for path in hf_weight_files(ckpt_dir):
        stored = ({key: t.element_size() for key, t in load_torch_file(path).items()} if path.suffix == ".bin"
                  else _safetensors_itemsizes(path))
        itemsizes.update((hf_to_meta_name(key), size) for key, size in stored.items() if hf_to_meta_name(key))
    return itemsizes


def _safetensors_itemsizes(path: Path) -> dict[str, int]:
    """Bytes per element of each tensor of a safetensors file, from its header: an 8-byte length, then JSON
    giving each tensor's shape and byte range."""
    try:
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        return {key: (entry["data_offsets"][1] - entry["data_offsets"][0]) // max(1, math.prod(entry["shape"]))
                for key, entry in header.items() if key != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"cannot read weight shard {path}: its header is not safetensors' ({exc})") from exc


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


def iter_rank_tensors(ckpt_dir: Path, args: ModelArgs, rank: int = 0, world_size: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields each weight (Meta's names) as rank `rank` of `world_size` holds it (the whole weight by default),
    reading only that part, one tensor at a time: a block's tensors come one after another.

    A Meta checkpoint with world_size shards gives rank r its heads from consolidated.r.pth alone
    (the files are mmap'd; only the pages used are read); other shard counts are resliced. The
    replicated tok_embeddings and output are joined from every shard. Hugging Face safetensors are
    read slice by slice, and its .bin files mmap'd.
    """
    if checkpoint_layout(ckpt_dir) == "meta":
        yield from _meta_tensors(ckpt_dir, rank, world_size)
    else:
        yield from _hf_tensors(ckpt_dir, args, rank, world_size)


def _meta_tensors(ckpt_dir: Path, rank: int, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    paths = meta_shard_paths(ckpt_dir)
    shards = [load_torch_file(p) for p in paths]  # mmap'd: this reads the index of each file, not its weights
    for shard, path in zip(shards[1:], paths[1:]):
        if set(shard) != set(shards[0]):
            odd = sorted(set(shard) ^ set(shards[0]))[:3]
            raise CheckpointError(f"shard {path} does not fit {paths[0]}: differing tensors {odd}")
    for name in sorted(shards[0]):
        if name.endswith("rope.freqs"):
            continue
        parts = [shard[name] for shard in shards]
        along = META_SHARD_DIM.get(name.split(".")[-2]) if parts[0].dim() > 1 else None
        if along is None:
            parts, along = parts[:1], 0
        for part, path in zip(parts, paths):
            if [s for i, s in enumerate(part.shape) if i != along] != [s for i, s in enumerate(parts[0].shape) if i != along]:
                raise CheckpointError(
                    f"shard {path}: tensor {name} has shape {tuple(part.shape)}, which does not fit "
                    f"{tuple(parts[0].shape)} in {paths[0]}"
                )
        yield name, _rank_part(name, parts, along, rank, world_size)


def _rank_part(name: str, parts: list[torch.Tensor], along: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank's slice of cat(parts, along), touching only the parts it overlaps."""
    split = TP_SPLIT_DIM.get(name.split(".")[-2]) if parts[0].dim() > 1 else None
    if split is None:
        return parts[0] if len(parts) == 1 else torch.cat(parts, along)
    if split != along:
        parts, along = [torch.cat(parts, along)], split
    total = sum(p.shape[along] for p in parts)
    if total % world_size:
        raise CheckpointError(f"tensor {name}: size {total} along dim {along} does not split over {world_size} ranks")
    start, stop = rank * total // world_size, (rank + 1) * total // world_size
    pieces, offset = [], 0
    for part in parts:
        low, high = max(start, offset), min(stop, offset + part.shape[along])
        if low < high:
            pieces.append(part.narrow(along, low - offset, high - low))
        offset += part.shape[along]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, along)


def _hf_tensors(ckpt_dir: Path, args: ModelArgs, rank: int, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    files = hf_weight_files(ckpt_dir)
    # Only a config that ties the embeddings has the files' names read twice: is lm_head stored anyway?
    tied = hf_ties_embeddings(ckpt_dir) and not any("lm_head.weight" in _hf_file_keys(path) for path in files)
    for path in files:
        for key, tensor in _hf_file_tensors(path, rank, world_size):
            # HF permutes within each head, so a rank's slice is unpermuted over its own heads.
            item = hf_to_meta(ckpt_dir, key, tensor, args.n_heads // world_size, args.n_kv_heads // world_size)
            if item is None:
                continue
            name, tensor = item
            yield name, tensor
            if tied and name == "tok_embeddings.weight":
                yield "output.weight", tensor


def _hf_file_keys(path: Path) -> list[str]:
    if path.suffix == ".bin":
        return list(load_torch_file(path))  # mmap'd: this reads the file's index, not its weights
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read weight shard {path}: {exc}") from exc


def _hf_file_tensors(path: Path, rank: int, world_size: int) -> list[tuple[str, torch.Tensor]]:
    """(HF name, rank's part) for each tensor of one weight file: safetensors read slice by slice, or a PyTorch
    .bin file (pytorch_model*.bin) mmap'd, so that only the pages of the rank's parts are read."""
    if path.suffix == ".bin":
        return [(key, _rank_slice(tensor, _hf_split_dim(key, world_size), rank, world_size, key))
                for key, tensor in load_torch_file(path).items()]
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return [(key, _hf_rank_slice(f, key, rank, world_size)) for key in f.keys()]
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read weight shard {path}: {exc}") from exc


def _hf_split_dim(key: str, world_size: int) -> Optional[int]:
    """The dimension a rank takes its part of this HF tensor along; None: the whole tensor."""
    name = hf_to_meta_name(key) or ""
    split = TP_SPLIT_DIM.get(name.split(".")[-2]) if name else None
    return None if world_size == 1 else split


def _rank_slice(tensor, split: Optional[int], rank: int, world_size: int, key: str):
    """Rank's part of tensor (a torch tensor, or a safetensors slice) along split; the whole where None."""
    if split is None:
        return tensor
    shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
    size = shape[split]
    if size % world_size:
        raise CheckpointError(f"tensor {key}: size {size} along dim {split} does not split over {world_size} ranks")
    start, stop = rank * size // world_size, (rank + 1) * size // world_size
    return tensor[start:stop] if split == 0 else tensor[:, start:stop]


def _hf_rank_slice(f, key: str, rank: int, world_size: int) -> torch.Tensor:
    split = _hf_split_dim(key, world_size)
    return f.get_tensor(key) if split is None else _rank_slice(f.get_slice(key), split, rank, world_size, key)


def check_state_dict(state_dict: dict[str, torch.Tensor], model: Transformer, ckpt_dir: Path) -> None:
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir} lacks tensor(s) {[stored_name(ckpt_dir, n) for n in missing[:5]]} "
                              f"for n_layers={model.args.n_layers}")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {ckpt_dir} has unexpected tensor(s) {unexpected[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(_shape_message(ckpt_dir, name, tensor.shape, expected[name].shape))


def _shape_message(ckpt_dir: Path, name: str, shape: Sequence[int], expected: Sequence[int]) -> str:
    """A tensor of the wrong shape; where it is a whole fraction of the shape expected along one dimension, as a
    model-parallel shard of Meta's is, the hint that shards are missing."""
    message = (f"checkpoint {ckpt_dir}: tensor {stored_name(ckpt_dir, name)} has shape {tuple(shape)}, but the model "
               f"config expects {tuple(expected)}")
    split = [(have, want) for have, want in zip(shape, expected) if have != want]
    if len(shape) == len(expected) and len(split) == 1 and split[0][0] and split[0][1] % split[0][0] == 0:
        parts = split[0][1] // split[0][0]
        message += (f": 1/{parts} of it, as in one of {parts} model-parallel shards; are consolidated.NN.pth "
                    "files missing?")
    return message


def load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch weight file's state dict, mmap'd (only the pages used are read), or read whole where the file
    is in torch.save's legacy format, which cannot be mmap'd; tensors only (weights_only), so no code in the
    file runs.

    Raises:
        CheckpointError: a file that cannot be read, or that holds no state dict.
    """
    try:
        try:
            state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:
            if "_use_new_zipfile_serialization" not in str(exc):
                raise
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, pickle errors, EOFError... for broken files
        raise CheckpointError(f"cannot read weight shard {path} (truncated or not a PyTorch file?): {exc}") from exc
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"weight shard {path} holds a {type(state_dict).__name__}, expected a state dict")
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"weight shard {path} holds {name!r}, a {type(value).__name__}, where a tensor "
                                  "was expected")
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
