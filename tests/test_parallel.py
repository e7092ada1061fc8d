"""Multi-device inference equals one device: tensor parallelism under torchrun (gloo on CPU) and layers
placed over devices by accelerate's device maps; bad layouts are refused with a message naming them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from conftest import MAX_SEQ_LEN, REPO_ROOT, build_llama, load_weights, split_meta_shards, write_meta_checkpoint
from llama_core import CheckpointError, Engine, InvalidRequestError, Llama
from llama_core.checkpoint import TP_SPLIT_DIM, iter_rank_tensors, load_torch_file
from llama_core.distributed.device_map import parse_max_memory
from llama_core.distributed.parallel import check_world_size
from tp_worker import shared_prefix_requests

WORKER = Path(__file__).resolve().parent / "tp_worker.py"
GEN_LEN = 12
TEXTS = ("Once upon a time", "def forward(self, x):", "raise InvalidRequestError(")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text, bos=True, eos=False) for text in TEXTS]


@pytest.fixture(scope="module")
def single_device(meta_ckpt_dir, prompts) -> dict:
    """The reference: one process, one device, the same weights."""
    llama = build_llama(meta_ckpt_dir)
    tokens, logprobs = llama.generate(prompts, GEN_LEN, temperature=0, logprobs=True)
    echo_tokens, echo_logprobs = llama.generate(prompts[:1], 4, temperature=0, logprobs=True, echo=True)
    prefix = shared_prefix_requests(Engine(build_llama(meta_ckpt_dir).loaded, prefix_caching=False), prompts, GEN_LEN)
    return {"tokens": tokens, "logprobs": logprobs, "echo_tokens": echo_tokens, "echo_logprobs": echo_logprobs,
            "prefix": prefix}


def run_torchrun(ckpt_dir: Path, prompts: list[list[int]], out: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(WORKER),
        "--ckpt-dir", str(ckpt_dir), "--prompts", json.dumps(prompts), "--max-gen-len", str(GEN_LEN), "--out", str(out),
    ]
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)


def start_ranks(ckpt_dir: Path, prompts: list[list[int]], out: Path, nproc: int = 2) -> list[subprocess.Popen]:
    """tp_worker.py --after-sigterm in nproc processes joined as torchrun joins them (its variables), without
    torchrun's monitor, so that a test signals or kills each process itself; stderr goes to OUT.rankN.err."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(out.with_suffix(f".rank{rank}.err"), "w") as errors:
            ranks.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--ckpt-dir", str(ckpt_dir), "--prompts", json.dumps(prompts),
                 "--max-gen-len", str(GEN_LEN), "--out", str(out), "--after-sigterm"],
                env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=errors))
    return ranks


@contextlib.contextmanager
def ranks_running(ckpt_dir: Path, prompts: list[list[int]], out: Path):
    """start_ranks, waiting until rank 0 has built its model; none is left running after."""
    ranks = start_ranks(ckpt_dir, prompts, out)
    try:
        deadline = time.monotonic() + 180
        while not out.with_suffix(".ready").exists():
            assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), rank_errors(out)
            time.sleep(0.2)
        yield ranks
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()


def rank_errors(out: Path, rank: Optional[int] = None) -> str:
    return "\n".join(path.read_text() for path in sorted(out.parent.glob(out.stem + ".rank*.err"))
                     if rank is None or path.name.endswith(f".rank{rank}.err"))


def assert_close_logprobs(actual: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for got, want in zip(actual, expected):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0), (got, want)


# -- tensor parallelism -------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["meta_sharded", "meta", "hf", "hf_bin"])
def test_two_ranks_generate_the_single_process_tokens_and_logprobs(layout, ckpt_dirs, prompts, single_device, tmp_path):
    out = tmp_path / "result.json"
    proc = run_torchrun(ckpt_dirs[layout], prompts, out)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["heads_per_rank"] == 2
    assert result["tokens"] == single_device["tokens"]
    assert all(len(t) == GEN_LEN for t in result["tokens"])  # no early EOS: every step was compared
    assert_close_logprobs(result["logprobs"], single_device["logprobs"])
    assert result["echo_tokens"] == single_device["echo_tokens"]
    assert_close_logprobs(result["echo_logprobs"], single_device["echo_logprobs"])
    # The engine on rank 0, serving concurrent requests, drives the other rank just the same.
    assert result["engine_tokens"] == single_device["tokens"]
    assert_close_logprobs(result["engine_logprobs"], single_device["logprobs"])
    assert result["engine_steps"] < sum(len(t) for t in single_device["tokens"])  # the requests shared steps
    # A prompt prefix copied out of a busy slot is copied on every rank: the second request's reply is the
    # one it gets when computing its whole prompt on one device.
    prefix, expected = result["prefix"], single_device["prefix"]
    assert prefix["cached"] == [0, prefix["shared"]] and expected["cached"] == [0, 0]
    assert prefix["tokens"] == expected["tokens"]
    assert_close_logprobs(prefix["logprobs"], expected["logprobs"])


def test_sigterm_to_every_rank_lets_rank_0_finish_its_requests_and_stop_the_others(meta_ckpt_dir, prompts,
                                                                                  single_device, tmp_path):
    """torchrun (stopped by docker, systemd, k8s) sends SIGTERM to every process: ranks > 0 must go on following
    rank 0, which ends its requests in flight and then stops them; nobody prints a traceback."""
    out = tmp_path / "result.json"
    with ranks_running(meta_ckpt_dir, prompts, out) as ranks:
        for process in ranks:
            process.send_signal(signal.SIGTERM)
        statuses = [process.wait(timeout=120) for process in ranks]
    assert statuses == [0, 0], rank_errors(out)
    assert json.loads(out.read_text()) == single_device["tokens"]
    assert "Traceback" not in rank_errors(out) and "Exception ignored" not in rank_errors(out), rank_errors(out)


def test_a_rank_that_died_fails_requests_plainly_and_rank_0_exits_without_a_traceback(meta_ckpt_dir, prompts,
                                                                                      tmp_path):
    out = tmp_path / "result.json"
    with ranks_running(meta_ckpt_dir, prompts, out) as ranks:
        ranks[1].kill()
        ranks[1].wait()
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=120) == 0, rank_errors(out, 0)
    told = json.loads(out.read_text())
    assert told == [{"error": "RequestFailedError: a tensor-parallel process failed; the server is stopping"}] * 3
    assert rank_errors(out, 0) == "", rank_errors(out, 0)  # no "Exception ignored in atexit callback"


def test_rank_0_dying_tells_the_others_the_group_broke(meta_ckpt_dir, prompts, tmp_path):
    """A rank > 0, following rank 0's steps inside Llama.build, says the group broke, not that loading failed."""
    out = tmp_path / "result.json"
    with ranks_running(meta_ckpt_dir, prompts, out) as ranks:
        ranks[0].kill()
        assert ranks[1].wait(timeout=120) != 0
    said = rank_errors(out, 1).strip().splitlines()[-1]
    assert ("TensorParallelError: the tensor-parallel group broke while this rank (1) served rank 0's steps: rank 0 "
            "or another of its processes ended (") in said, said
    assert ".cc:" not in said and "GLHF" not in said, said


def test_three_ranks_for_two_kv_heads_fail_naming_the_count(meta_ckpt_dir, prompts, tmp_path):
    proc = run_torchrun(meta_ckpt_dir, prompts, tmp_path / "result.json", nproc=3)
    assert proc.returncode != 0
    assert "tensor parallelism over 3 processes needs n_kv_heads (2)" in proc.stderr
    assert "--nproc_per_node in [1, 2]" in proc.stderr


def test_each_rank_reads_its_own_meta_shard_and_reslicing_gives_the_same_parts(ckpt_dirs, tiny_args):
    full = load_weights(ckpt_dirs["meta"], tiny_args.vocab_size)
    shard_files = sorted(ckpt_dirs["meta_sharded"].glob("consolidated.*.pth"))
    for rank in range(2):
        from_shards = dict(iter_rank_tensors(ckpt_dirs["meta_sharded"], tiny_args, rank, 2))
        from_single = dict(iter_rank_tensors(ckpt_dirs["meta"], tiny_args, rank, 2))
        from_hf = dict(iter_rank_tensors(ckpt_dirs["hf"], tiny_args, rank, 2))
        from_hf_bin = dict(iter_rank_tensors(ckpt_dirs["hf_bin"], tiny_args, rank, 2))
        own_shard = load_torch_file(shard_files[rank])
        assert set(from_shards) == set(from_single) == set(from_hf) == set(from_hf_bin) == set(full)
        for name, tensor in full.items():
            split = TP_SPLIT_DIM.get(name.split(".")[-2]) if tensor.dim() > 1 else None
            expected = tensor if split is None else tensor.chunk(2, dim=split)[rank]
            for source, parts in (("2 shards", from_shards), ("1 shard", from_single), ("hf", from_hf),
                                  ("hf .bin", from_hf_bin)):
                assert torch.equal(parts[name], expected), f"rank {rank} {name} from {source}"
            if split is not None:  # Meta's model-parallel split is this one: shard r is rank r's part
                assert torch.equal(own_shard[name], expected), name


def test_mismatched_meta_shards_are_refused_naming_the_shard(tiny_args, tiny_state_dict, tmp_path):
    shards = split_meta_shards(tiny_state_dict, 2)
    del shards[1]["layers.1.feed_forward.w2.weight"]
    ckpt = write_meta_checkpoint(tmp_path / "broken", tiny_args, shards, None, tiny_args.vocab_size)
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth does not fit .*layers\.1\.feed_forward\.w2"):
        list(iter_rank_tensors(ckpt, tiny_args, 0, 2))


def test_world_size_must_divide_kv_heads_and_ffn_width(tiny_args):
    check_world_size(tiny_args, 2)
    with pytest.raises(InvalidRequestError, match=r"over 4 processes needs n_kv_heads \(2\).*in \[1, 2\]"):
        check_world_size(tiny_args, 4)


def test_tensor_parallel_outside_torchrun_says_how_to_launch(meta_ckpt_dir, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidRequestError, match="torchrun --nproc_per_node"):
        build_llama(meta_ckpt_dir, tensor_parallel=True)
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        build_llama(meta_ckpt_dir, tensor_parallel=True, device_map="auto", device="auto")
    with pytest.raises(InvalidRequestError, match="compile and tensor_parallel exclude each other"):
        build_llama(meta_ckpt_dir, tensor_parallel=True, compile=True)


def test_compile_with_a_device_map_is_refused(meta_ckpt_dir, tiny_args):
    with pytest.raises(InvalidRequestError, match="compile and device_map exclude each other"):
        build_llama(meta_ckpt_dir, device_map=per_layer_map(tiny_args.n_layers), device="auto", compile=True)


# -- device maps ----------------------------------------------------------------------------------
def per_layer_map(n_layers: int, device="cpu") -> dict:
    return {"tok_embeddings": device, **{f"layers.{i}": device for i in range(n_layers)}, "norm": device,
            "output": device}


@pytest.mark.parametrize("device_map", ["explicit", "auto"])
def test_device_map_outputs_equal_the_single_device_model(device_map, ckpt_dirs, tiny_args, prompts, single_device):
    reference = build_llama(ckpt_dirs["meta"])
    layout = "hf" if device_map == "explicit" else "meta_sharded"  # both read tensor by tensor, not merged first
    device_map = per_layer_map(tiny_args.n_layers) if device_map == "explicit" else "auto"
    placed = build_llama(ckpt_dirs[layout], device="auto", device_map=device_map)
    # accelerate's hooks run every block, and each layer's KV cache sits on its device.
    assert all(hasattr(layer, "_hf_hook") for layer in placed.model.layers)
    assert all(layer.attention.kv_cache.k_cache.device.type == "cpu" for layer in placed.model.layers)
    tokens = torch.tensor([prompts[0]])
    with torch.inference_mode():
        assert torch.equal(placed.model(tokens, kv_len=tokens.shape[1]), reference.model(tokens, kv_len=tokens.shape[1]))
    got_tokens, got_logprobs = placed.generate(prompts, GEN_LEN, temperature=0, logprobs=True)
    assert got_tokens == single_device["tokens"] and got_logprobs == single_device["logprobs"]
    with placed.serve() as engine:
        streams = [engine.submit(p, GEN_LEN, temperature=0) for p in prompts]
        assert [[c.token for c in s] for s in streams] == single_device["tokens"]


@pytest.mark.parametrize(
    "device_map, message",
    [
        ("everywhere", "device_map must be one of auto, balanced, balanced_low_0, sequential"),
        ({"tok_embeddings": "cpu", "layers": "cpu", "norm": "cpu"}, "leaves output without a device"),
        ({"": "cpu", "layers.0.attention": "cpu"}, "'layers.0.attention' splits a transformer block"),
        ({"": "cpu", "layers.7": "cpu"}, "'layers.7' is not a module of this model"),
        ({"": "cpu", "layers.1": "cpu"}, "places 'layers.1' twice"),
        ({"": "disk"}, "'disk' is not supported"),
        ({"": "tpu"}, "got 'tpu'"),
        ({"": f"cuda:{torch.cuda.device_count()}"}, f"this machine has {torch.cuda.device_count()} CUDA device"),
        ({"": torch.cuda.device_count()}, f"this machine has {torch.cuda.device_count()} CUDA device"),
        ({"": -1}, "must be a CUDA index, 'cuda:N' or 'cpu', got -1"),
    ],
)
def test_bad_device_map_is_refused_naming_it(device_map, message, meta_ckpt_dir):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_llama(meta_ckpt_dir, device="auto", device_map=device_map)


def test_bad_max_memory_is_refused_naming_it(meta_ckpt_dir):
    with pytest.raises(InvalidRequestError, match="max_memory for 'cpu' must be a size like '20GiB'.*'lots'"):
        build_llama(meta_ckpt_dir, device="auto", device_map="auto", max_memory={"cpu": "lots"})
    with pytest.raises(InvalidRequestError, match="does not fit in max_memory"):
        build_llama(meta_ckpt_dir, device="auto", device_map="sequential", max_memory={"cpu": "100KB"})
    with pytest.raises(InvalidRequestError, match="goes with a device_map strategy"):
        build_llama(meta_ckpt_dir, device="auto", max_memory={"cpu": "1GiB"})
    with pytest.raises(InvalidRequestError, match="leave device as 'auto', got 'cpu'"):
        build_llama(meta_ckpt_dir, device="cpu", device_map="auto")


def test_max_memory_is_read_from_the_command_line_form():
    assert parse_max_memory("cpu=2GiB") == {"cpu": 2 * 2**30}
    missing = torch.cuda.device_count()  # a GPU index this machine lacks: said so, as for cuda:N
    for key in (str(missing), f"cuda:{missing}"):
        with pytest.raises(InvalidRequestError, match=rf"but this machine has {missing} CUDA device\(s\)"):
            parse_max_memory(f"{key}=20GiB")
    with pytest.raises(InvalidRequestError, match="'0:20GiB' must look like 0=20GiB"):
        parse_max_memory("0:20GiB")


# -- GPUs -----------------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_two_gpus
def test_auto_device_map_spreads_layers_over_gpus(ckpt_dirs, tiny_args, prompts, single_device):
    # Tiny caps make the "balanced" strategy use both GPUs for the tiny model.
    placed = build_llama(ckpt_dirs["meta"], device="auto", dtype="float32", device_map="auto",
                         max_memory={0: "300KB", 1: "300KB", "cpu": "1GiB"})
    devices = {layer.attention.kv_cache.k_cache.device for layer in placed.model.layers}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
    tokens, logprobs = placed.generate(prompts, GEN_LEN, temperature=0, logprobs=True)
    assert tokens == single_device["tokens"]
    assert_close_logprobs(logprobs, single_device["logprobs"])


@needs_gpu
def test_layers_offloaded_to_cpu_run_on_the_gpu(ckpt_dirs, tiny_args, prompts, single_device):
    layer_map = per_layer_map(tiny_args.n_layers, 0) | {"layers.1": "cpu"}
    placed = build_llama(ckpt_dirs["meta"], device="auto", dtype="float32", device_map=layer_map)
    assert placed.model.layers[1].attention_norm.weight.device.type == "meta"  # kept in host memory by accelerate
    assert placed.model.layers[1].attention.kv_cache.k_cache.device == torch.device("cuda", 0)
    tokens, logprobs = placed.generate(prompts, GEN_LEN, temperature=0, logprobs=True)
    assert tokens == single_device["tokens"]
    assert_close_logprobs(logprobs, single_device["logprobs"])


def test_offloaded_layers_run_with_their_kv_cache_on_the_execution_device(ckpt_dirs, tiny_args, tokenizer, prompts,
                                                                           single_device, tmp_path):
    """accelerate's offload leaves weights on the meta device between calls (here to disk, the offload a
    CPU-only machine has; --device-map offloads to CPU memory the same way): the KV cache and the
    Llama's input device must follow the hooks' execution device, not the weights."""
    from accelerate import dispatch_model

    from llama_core.checkpoint import load_model

    model = load_model(ckpt_dirs["meta"], tiny_args, torch.device("cpu"), torch.float32)
    model.fuse_projections()
    placement = per_layer_map(tiny_args.n_layers) | {"tok_embeddings": "disk", "layers.1": "disk"}
    dispatch_model(model, device_map=placement, main_device="cpu", offload_dir=tmp_path, force_hooks=True)
    assert model.layers[1].attention_norm.weight.device.type == "meta"
    assert model.tok_embeddings.weight.device.type == "meta"
    placed = Llama.from_model(model, tokenizer, MAX_SEQ_LEN, 4, seed=0)
    assert placed.device == torch.device("cpu")
    assert placed.model.layers[1].attention.kv_cache.k_cache.device == torch.device("cpu")
    tokens, logprobs = placed.generate(prompts, GEN_LEN, temperature=0, logprobs=True)
    assert tokens == single_device["tokens"]
    assert_close_logprobs(logprobs, single_device["logprobs"])
