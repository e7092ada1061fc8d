"""Tensor parallelism over torch.distributed, for `torchrun --nproc_per_node N`.

Megatron's split, as in Meta's model-parallel checkpoints and gpt-fast's tp.py: each rank holds
1/N of the attention heads (rows of wq, wk, wv; columns of wo) and of the SwiGLU hidden units (rows of
w1, w3; columns of w2); embeddings, norms and the output layer are replicated. The partial outputs of
wo and w2 are summed with all-reduce (NCCL on CUDA, gloo on CPU).

Rank 0 drives: it runs the usual engine, and each forward first broadcasts its inputs over
a gloo group, so ranks > 0 run the same forward on the same KV-cache rows; a copy of KV-cache rows
between slots (prefix caching) is broadcast the same way. Only rank 0 samples. At exit rank 0
broadcasts a stop, and every rank leaves the process group.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import (
    META_SHARD_DIM,
    WeightsProgress,
    hf_ties_embeddings,
    hf_to_meta_name,
    load_torch_file,
    check_state_dict,
    hf_to_meta,
)
from ..checkpoint_files import checkpoint_layout, hf_weight_files, meta_shard_paths
from ..config import ModelArgs
from ..errors import CheckpointError, InvalidRequestError
from ..model import Transformer

# Dimension each rank takes its 1/N slice along; every other tensor is replicated.
TP_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}

# Ranks > 0 wait on rank 0 between requests: an idle server must not time out.
_IDLE_TIMEOUT = timedelta(days=365)
_STOP, _FORWARD, _COPY_PREFIX = 0, 1, 2
_OPTIONAL_INPUTS = ("input_pos", "cache_rows", "logit_index")
_control: Optional[dist.ProcessGroup] = None  # gloo group carrying rank 0's calls


# -- joining the job ----------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_distributed(device: str | torch.device = "auto", args: Optional[ModelArgs] = None) -> torch.device:
    """Joins the torchrun job (NCCL on CUDA, gloo on CPU); returns this rank's device, cuda:LOCAL_RANK or cpu.

    Raises:
        InvalidRequestError: not launched by torchrun, a device other than auto/cuda/cpu, too few GPUs,
            or (given the model's args) a process count that does not divide its heads.
    """
    global _control
    if not launched_by_torchrun():
        raise InvalidRequestError(
            "tensor parallelism needs torchrun: launch with `torchrun --nproc_per_node N app.py ...` "
            "(RANK, WORLD_SIZE and LOCAL_RANK are not set)"
        )
    if str(device) not in ("auto", "cuda", "cpu"):
        raise InvalidRequestError(
            f"with tensor parallelism each rank uses cuda:LOCAL_RANK or the cpu: device must be 'auto', 'cuda' "
            f"or 'cpu', got {device!r}"
        )
    if args is not None:
        check_world_size(args, int(os.environ["WORLD_SIZE"]))
    use_cuda = torch.cuda.is_available() if str(device) == "auto" else str(device) == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()} CUDA device(s); "
            "launch at most that many processes per node"
        )
    rank_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(rank_device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if _control is None:
        _control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        if dist.get_rank() == 0:
            atexit.register(shutdown)  # also when rank 0 fails while loading: the others stop waiting
    return rank_device


def check_world_size(args: ModelArgs, world_size: int) -> None:
    """Raises InvalidRequestError unless world_size divides the key/value heads and the SwiGLU width."""
    if args.n_kv_heads % world_size == 0 and args.hidden_dim % world_size == 0:
        return
    fits = [n for n in range(1, args.n_kv_heads + 1) if math.gcd(args.n_kv_heads, args.hidden_dim) % n == 0]
    raise InvalidRequestError(
        f"tensor parallelism over {world_size} processes needs n_kv_heads ({args.n_kv_heads}) and the FFN hidden "
        f"size ({args.hidden_dim}) divisible by {world_size}: use --nproc_per_node in {fits}"
    )


# -- the model on one rank ----------------------------------------------------------------------
def load_model_shard(ckpt_dir: Path, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                     progress: bool = False) -> Transformer:
    """This rank's part of the model: its heads and hidden units, cast to dtype on device, joined by all-reduce
    (with progress, rank 0 shows a bar on stderr as its part arrives)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(args, world)
    with torch.device("meta"):
        model = Transformer(args)
    shard_transformer(model, world)
    with WeightsProgress(model, dtype, progress and rank == 0) as bar:
        state_dict = {
            name: bar.placed(tensor.to(device=device, dtype=dtype).contiguous())
            for name, tensor in iter_rank_tensors(ckpt_dir, args, rank, world)
        }
    check_state_dict(state_dict, model, ckpt_dir)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def shard_transformer(model: Transformer, world_size: int) -> None:
    """Shrinks each block of a meta-device model to one rank's heads and hidden units, in place; with
    world_size > 1 the attention and feed-forward outputs are all-reduced (summed over ranks)."""
    for layer in model.layers:
        attention, feed_forward = layer.attention, layer.feed_forward
        attention.n_heads //= world_size
        attention.n_kv_heads //= world_size
        for module, names in ((attention, ("wq", "wk", "wv", "wo")), (feed_forward, ("w1", "w2", "w3"))):
            for name in names:
                setattr(module, name, _local_linear(getattr(module, name), TP_SPLIT_DIM[name], world_size))
            if world_size > 1:
                module.register_forward_hook(_all_reduce_output)


def _local_linear(linear: nn.Linear, dim: int, world_size: int) -> nn.Linear:
    out_features, in_features = linear.weight.shape
    if dim == 0:
        out_features //= world_size
    else:
        in_features //= world_size
    return nn.Linear(in_features, out_features, bias=False, device="meta", dtype=linear.weight.dtype)


def _all_reduce_output(module: nn.Module, inputs, output: torch.Tensor) -> None:
    dist.all_reduce(output)  # in place: this rank's partial sum becomes the full output


# -- reading one rank's weights -----------------------------------------------------------------
def iter_rank_tensors(ckpt_dir: Path, args: ModelArgs, rank: int, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields each weight (Meta's names) as rank `rank` of `world_size` holds it, reading only that part.

    A Meta checkpoint with world_size shards gives rank r its heads from consolidated.r.pth alone
    (the files are mmap'd; only the pages used are read); other shard counts are resliced. The
    replicated tok_embeddings and output are joined from every shard. Hugging Face safetensors are
    read slice by slice.
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
    from safetensors import SafetensorError, safe_open

    files = hf_weight_files(ckpt_dir)
    try:
        keys = set()
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys.update(f.keys())
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read weight shard {path}: {exc}") from exc
    tied = "lm_head.weight" not in keys and hf_ties_embeddings(ckpt_dir)
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                loaded = [(key, _hf_rank_slice(f, key, rank, world_size)) for key in f.keys()]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read weight shard {path}: {exc}") from exc
        for key, tensor in loaded:
            # HF permutes within each head, so a rank's slice is unpermuted over its own heads.
            item = hf_to_meta(ckpt_dir, key, tensor, args.n_heads // world_size, args.n_kv_heads // world_size)
            if item is None:
                continue
            name, tensor = item
            yield name, tensor
            if tied and name == "tok_embeddings.weight":
                yield "output.weight", tensor


def _hf_rank_slice(f, key: str, rank: int, world_size: int) -> torch.Tensor:
    name = hf_to_meta_name(key) or ""
    split = TP_SPLIT_DIM.get(name.split(".")[-2]) if name else None
    if split is None or world_size == 1:
        return f.get_tensor(key)
    view = f.get_slice(key)
    size = view.get_shape()[split]
    if size % world_size:
        raise CheckpointError(f"tensor {key}: size {size} along dim {split} does not split over {world_size} ranks")
    start, stop = rank * size // world_size, (rank + 1) * size // world_size
    return view[start:stop] if split == 0 else view[:, start:stop]


# -- rank 0 drives, the others follow -----------------------------------------------------------
def lead_or_serve(model: Transformer, device: torch.device) -> None:
    """On rank 0, makes every forward of model (this rank's shard, its caches set up) run on all ranks, and
    returns. On other ranks, runs rank 0's forwards until it stops, leaves the process group and exits the
    process."""
    if dist.get_rank() == 0:
        model.register_forward_pre_hook(_broadcast_call, with_kwargs=True)
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0, whose exit then stops this rank
    serve_forever(model, device)
    shutdown()
    raise SystemExit(0)


@torch.inference_mode()
def serve_forever(model: Transformer, device: torch.device) -> None:
    """Ranks > 0: runs each forward and KV-cache copy rank 0 broadcasts, until it broadcasts the stop."""
    while (call := _receive_call(device)) is not None:
        if "copy_prefix" in call:
            model.copy_cache_prefix(*call["copy_prefix"])
        else:
            model(**call)


def broadcast_copy_prefix(src_row: int, dst_row: int, length: int) -> None:
    """On rank 0: has every other rank copy the same KV-cache rows (Transformer.copy_cache_prefix) before
    its next forward."""
    dist.broadcast(torch.tensor([_COPY_PREFIX, src_row, dst_row, length, 0, 0, 0, 0]), 0, group=_control)


def shutdown() -> None:
    """Stops the ranks > 0 (when called on rank 0) and leaves the process group; later calls do nothing.
    Rank 0 calls it at exit; call it sooner only once nothing runs the model any more."""
    global _control
    if _control is None:
        return
    if dist.get_rank() == 0:
        dist.broadcast(torch.tensor([_STOP, 0, 0, 0, 0, 0, 0, 0]), 0, group=_control)
    dist.barrier(group=_control)
    _control = None
    dist.destroy_process_group()


def _broadcast_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on rank 0: sends the call's inputs (header, then one int64 payload) to every rank."""
    call = dict(zip(("tokens", "input_pos", "cache_rows", "kv_len", "logit_index"), args), **kwargs)
    tokens = call["tokens"]
    batch, seq_len = tokens.shape
    if isinstance(call.get("cache_rows"), slice):
        rows = call["cache_rows"]
        call["cache_rows"] = torch.arange(rows.start, rows.stop)
    if call.get("input_pos") is not None:
        call["input_pos"] = call["input_pos"].expand(batch, seq_len)
    present = [call.get(name) is not None for name in _OPTIONAL_INPUTS]
    tensors = [tokens] + [call[name] for name, has in zip(_OPTIONAL_INPUTS, present) if has]
    payload = torch.cat([t.reshape(-1).to("cpu", torch.long) for t in tensors])
    kv_len = call.get("kv_len")
    header = [_FORWARD, batch, seq_len, -1 if kv_len is None else int(kv_len), *map(int, present), payload.numel()]
    dist.broadcast(torch.tensor(header), 0, group=_control)
    dist.broadcast(payload, 0, group=_control)


def _receive_call(device: torch.device) -> Optional[dict]:
    header = torch.empty(8, dtype=torch.long)
    dist.broadcast(header, 0, group=_control)
    op, batch, seq_len, kv_len, *present, size = header.tolist()
    if op == _STOP:
        return None
    if op == _COPY_PREFIX:
        return {"copy_prefix": (batch, seq_len, kv_len)}  # this header's fields are src_row, dst_row, length
    payload = torch.empty(size, dtype=torch.long)
    dist.broadcast(payload, 0, group=_control)
    payload = payload.to(device)
    call = {"tokens": payload[: batch * seq_len].view(batch, seq_len), "kv_len": None if kv_len < 0 else kv_len}
    offset = batch * seq_len
    for name, has in zip(_OPTIONAL_INPUTS, present):
        if has:
            count = batch * seq_len if name == "input_pos" else batch
            value = payload[offset : offset + count]
            call[name] = value.view(batch, seq_len) if name == "input_pos" else value
            offset += count
    return call
