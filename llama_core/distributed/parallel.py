"""Tensor parallelism over torch.distributed, for `torchrun --nproc_per_node N`.

Megatron's split, as in Meta's model-parallel checkpoints and gpt-fast's tp.py: each rank holds
1/N of the attention heads (rows of wq, wk, wv; columns of wo) and of the SwiGLU hidden units (rows of
w1, w3; columns of w2); embeddings, norms and the output layer are replicated. The partial outputs of
wo and w2 are summed with all-reduce (NCCL on CUDA, gloo on CPU).

Rank 0 drives: it runs the usual engine, and each forward first broadcasts its inputs over
a gloo group, so ranks > 0 run the same forward on the same KV-cache rows; a copy of KV-cache rows
between slots (prefix caching) is broadcast the same way. Only rank 0 samples. At exit rank 0
broadcasts a stop, and every rank leaves the process group. Ranks > 0 ignore SIGINT and SIGTERM (torchrun
sends its SIGTERM to every process): rank 0 leads the stop, letting requests in flight end first.

A collective that fails (a process of the group ended) raises TensorParallelError, which says so without
the backend's internals; the group is then left as it is (nothing more is sent over it).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import TP_SPLIT_DIM, WeightsProgress, assign_weights, iter_rank_tensors
from ..config import ModelArgs
from ..errors import InvalidRequestError, LlamaError
from ..model import Transformer

# Ranks > 0 wait on rank 0 between requests: an idle server must not time out.
_IDLE_TIMEOUT = timedelta(days=365)
_STOP, _FORWARD, _COPY_PREFIX = 0, 1, 2
_OPTIONAL_INPUTS = ("input_pos", "cache_rows", "logit_index")
_control: Optional[dist.ProcessGroup] = None  # gloo group carrying rank 0's calls
_broken = False  # a collective failed: a process of the group ended, so nothing more is sent over it


class TensorParallelError(LlamaError, RuntimeError):
    """A collective of the tensor-parallel group failed: another of its processes ended (or its connection
    broke), so the model cannot run any more; the backend's own error is its __cause__."""


def _collective(op, *args, **kwargs) -> None:
    """Runs a torch.distributed collective; a failure (the backend's RuntimeError) is a TensorParallelError."""
    global _broken
    try:
        op(*args, **kwargs)
    except RuntimeError as exc:
        _broken = True
        rank = dist.get_rank() if dist.is_initialized() else -1
        if rank > 0:
            message = (f"the tensor-parallel group broke while this rank ({rank}) served rank 0's steps: rank 0 or "
                       f"another of its processes ended ({backend_reason(exc)})")
        else:
            message = f"a tensor-parallel process failed: {backend_reason(exc)}"
        raise TensorParallelError(message) from exc


def backend_reason(exc: BaseException) -> str:
    """A backend error's first line without gloo's source location and sign-off ("[.../pair.cc:553] Connection
    closed by peer [127.0.0.1]:6894. This is typically caused by ... GLHF! 🏖️" is "Connection closed by peer
    [127.0.0.1]:6894")."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    line = re.split(r"\.\s+This is typically caused", line)[0]  # gloo's advice to read the other logs, and its
    return re.sub(r"\s*GLHF!.*$", "", line).strip() or type(exc).__name__  # sign-off


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
    with WeightsProgress(model, ckpt_dir, progress and rank == 0) as bar:
        assign_weights(model, iter_rank_tensors(ckpt_dir, args, rank, world), ckpt_dir,
                       lambda name, tensor: bar.placed(name, tensor.to(device=device, dtype=dtype).contiguous()))
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
    _collective(dist.all_reduce, output)  # in place: this rank's partial sum becomes the full output


# -- rank 0 drives, the others follow -----------------------------------------------------------
def lead_or_serve(model: Transformer, device: torch.device) -> None:
    """On rank 0, makes every forward of model (this rank's shard, its caches set up) run on all ranks, and
    returns. On other ranks, runs rank 0's forwards until it stops, leaves the process group and exits the
    process."""
    if dist.get_rank() == 0:
        model.register_forward_pre_hook(_broadcast_call, with_kwargs=True)
        return
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (the terminal's) and torchrun's SIGTERM (docker's, systemd's) reach every rank: rank 0 ends its
        # requests in flight and then broadcasts the stop, which ends this rank; torchrun kills what is left
        # after its own grace.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    _collective(dist.broadcast, torch.tensor([_COPY_PREFIX, src_row, dst_row, length, 0, 0, 0, 0]), 0, group=_control)


def shutdown() -> None:
    """Stops the ranks > 0 (when called on rank 0) and leaves the process group; later calls do nothing.
    Rank 0 calls it at exit; call it sooner only once nothing runs the model any more. Where the group is broken
    (a process already ended, killed or failed) there is no one to stop: it returns quietly."""
    global _control
    if _control is None:
        return
    group, _control = _control, None
    if _broken:
        return
    try:
        if dist.get_rank() == 0:
            _collective(dist.broadcast, torch.tensor([_STOP, 0, 0, 0, 0, 0, 0, 0]), 0, group=group)
        _collective(dist.barrier, group=group)
    except TensorParallelError:
        return  # the others ended already; leaving the group would wait on them
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
    _collective(dist.broadcast, torch.tensor(header), 0, group=_control)
    _collective(dist.broadcast, payload, 0, group=_control)


def _receive_call(device: torch.device) -> Optional[dict]:
    header = torch.empty(8, dtype=torch.long)
    _collective(dist.broadcast, header, 0, group=_control)
    op, batch, seq_len, kv_len, *present, size = header.tolist()
    if op == _STOP:
        return None
    if op == _COPY_PREFIX:
        return {"copy_prefix": (batch, seq_len, kv_len)}  # this header's fields are src_row, dst_row, length
    payload = torch.empty(size, dtype=torch.long)
    _collective(dist.broadcast, payload, 0, group=_control)
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
