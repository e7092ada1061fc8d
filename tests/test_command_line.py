"""The command lines, `llama-chat` (llama_core.app.cli, `python app.py`) and `llama-generate`
(llama_core.generate_cli): help at once, every bad argument refused before a model loads with one line
naming the flag and the fix (exit status 2 for a usage error, 1 where what the options name cannot be used),
and llama-generate's streamed text.

Each command runs in a subprocess that reports which heavy modules it imported: torch and gradio must not
be, for anything but the device check, and llama_core.loader (through which every model loads) never is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llama_core import DEFAULT_CKPT_DIR, InvalidRequestError, Llama
from llama_core.cli_options import DEFAULT_MAX_SEQ_LEN, OptionError, check_context, check_model_options, thread_warnings
from llama_core.checkpoint_files import read_model_args
from llama_core.cpu_kernels.build import expected
from llama_core import cli_options, generate_cli

from conftest import interruptible

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT, GENERATE, EXPORT = "llama_core.app.cli", "llama_core.generate_cli", "llama_core.export"
HEAVY = ("torch", "gradio", "llama_core.loader")
PROBE = """
import json, sys
from {module} import main
status = main(sys.argv[1:])
print("IMPORTED " + json.dumps([m for m in {heavy!r} if m in sys.modules]), file=sys.stderr)
sys.exit(status)
"""
TRAINED_FOR = 512  # the embedded model's params.json


@dataclass
class Run:
    status: int
    stdout: str
    errors: list[str]  # stderr's lines
    imported: list[str]  # of HEAVY


def run(module: str, *args: str, stdin: str = "") -> Run:
    result = subprocess.run([sys.executable, "-c", PROBE.format(module=module, heavy=HEAVY), *args], cwd=REPO_ROOT,
                            input=stdin, capture_output=True, text=True, timeout=300)
    *errors, imported = result.stderr.splitlines() or ["IMPORTED null"]
    assert imported.startswith("IMPORTED "), result.stderr
    return Run(result.returncode, result.stdout, errors, json.loads(imported.removeprefix("IMPORTED ")))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Folders beside one another: model (the embedded model, linked), no-weights, no-tokenizer."""
    root = tmp_path_factory.mktemp("checkpoints")
    files = {"model": ["params.json", "consolidated.00.pth", "tokenizer.model"],
             "no-weights": ["params.json", "tokenizer.model"], "no-tokenizer": ["params.json", "consolidated.00.pth"]}
    for folder, names in files.items():
        (root / folder).mkdir()
        for name in names:
            (root / folder / name).symlink_to(DEFAULT_CKPT_DIR / name)
    return root


# -- help ----------------------------------------------------------------------------------------------------
def test_app_help_answers_without_importing_torch_or_gradio():
    result = subprocess.run([sys.executable, "-X", "importtime", "app.py", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: llama-chat")
    for flag in ("--ckpt-dir", "--port", "--allow-longer-context", "--max-seq-len", "--share"):
        assert flag in result.stdout
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "llama_core.app.cli" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "gradio")}


@pytest.mark.parametrize("module", [CHAT, GENERATE])
def test_help_of_each_command(module):
    result = run(module, "--help")
    assert result.status == 0 and "--ckpt-dir" in result.stdout and "--device" in result.stdout
    assert result.imported == []


@pytest.mark.parametrize("module", [CHAT, GENERATE, EXPORT])
def test_each_commands_help_says_what_its_exit_statuses_mean(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    said = " ".join(result.stdout.split())
    assert result.returncode == 0 and "exit status: 0 success; 1 a failure at run time (a checkpoint or file" in said
    assert "2 a usage error (an unknown option, a bad value, options that exclude each other)" in said


# -- llama-chat: each bad argument, before anything loads ------------------------------------------------------
BAD_CHAT_ARGUMENTS = {  # arguments ({root}: the checkpoints fixture) -> what the one error line must say
    "port out of range": (["--port", "99999"], ["argument --port", "65535", "0 for any free port"]),
    "port not a number": (["--port", "http"], ["argument --port", "'http'"]),
    "stop grace negative": (["--stop-grace", "-1"], ["argument --stop-grace", "0 or more", "'-1'"]),
    "root path not a path": (["--root-path", "llama"], ["argument --root-path", "starting with /", "'llama'"]),
    "host not of this machine": (["--host", "192.0.2.1"], ["--host 192.0.2.1", "not an address of this machine",
                                                           "127.0.0.1"]),
    "host unknown": (["--host", "no-such-host.invalid"], ["--host no-such-host.invalid", "no such address",
                                                          "0.0.0.0"]),
    "checkpoint missing": (["--ckpt-dir", "{root}/nowhere"], ["--ckpt-dir {root}/nowhere", "no such directory"]),
    "checkpoint is a file": (["--ckpt-dir", "{root}/model/params.json"],
                             ["--ckpt-dir {root}/model/params.json is a file", "e.g. --ckpt-dir {root}/model"]),
    "checkpoint without a config": (["--ckpt-dir", "{root}"], ["--ckpt-dir {root} holds no params.json",
                                                               "config.json"]),
    "checkpoint without weights": (["--ckpt-dir", "{root}/no-weights"], ["--ckpt-dir {root}/no-weights has no "
                                                                         "weights", "consolidated"]),
    "tokenizer missing": (["--tokenizer", "{root}/tokenizer.model"], ["--tokenizer {root}/tokenizer.model",
                                                                      "no such file"]),
    "tokenizer is a folder": (["--tokenizer", "{root}/model"], ["--tokenizer {root}/model is a directory",
                                                                "--tokenizer {root}/model/tokenizer.model"]),
    "tokenizer not a tokenizer": (["--tokenizer", "{root}/model/params.json"], ["not a SentencePiece model"]),
    "no tokenizer beside the checkpoint": (["--ckpt-dir", "{root}/no-tokenizer"], ["no tokenizer.model in",
                                                                                   "pass --tokenizer"]),
    "context beyond training": (["--max-seq-len", "4096"], ["--max-seq-len 4096", f"the {TRAINED_FOR} tokens",
                                                            f"--max-seq-len {TRAINED_FOR} or less",
                                                            "--allow-longer-context"]),
    "max-memory without device-map": (["--max-memory", "0=1GiB"], ["--max-memory goes with --device-map"]),
    "dtype unknown": (["--dtype", "float8"], ["argument --dtype", "float8"]),
    "quantization unknown": (["--quantize", "bogus"], ["argument --quantize", "'bogus'", "'none', 'int8', 'int4'"]),
    "int8 with a device map": (["--quantize", "int8", "--device-map", "auto"],
                               ["--quantize int8 and --device-map auto exclude each other"]),
    "compile with a device map": (["--compile", "--device-map", "auto"],
                                  ["--compile and --device-map exclude each other"]),
    "share open to anyone": (["--share"], ["--share makes a public link to the page and the API alike: protect both "
                                           "with --auth USER:PASSWORD", "and --api-key KEY", "--share-without-auth"]),
    "share with a login alone": (["--share", "--auth", "a:b"], [  # the link reaches /v1 too
        "protect the other half too with --api-key KEY (the OpenAI API under /v1), or pass --share-without-auth"]),
    "share with a key alone": (["--share", "--api-key", "k"], [
        "protect the other half too with --auth USER:PASSWORD (the page and its Gradio API), or pass"]),
    "login without a password": (["--auth", "alice"], ["--auth alice", "USER:PASSWORD"]),
    "empty API key": (["--api-key", " "], ["--api-key", "must not be empty"]),
    "empty model name": (["--model-name", ""], ["--model-name must not be empty"]),
    "negative prompt lookup": (["--prompt-lookup", "-1"], ["argument --prompt-lookup", "must be 0 or a positive integer"]),
    "more slots than memory": (["--max-batch-size", "10000000"], [
        # the embedded model's bfloat16 projections stay 16-bit where the CPU kernels run, else become float32
        "tiny-shakespeare needs at least", f"of memory on the CPU (weights {7 if expected() else 12} MiB, KV cache 14",
        f"10,000,000 requests x {TRAINED_FOR} tokens in float32)", "is free: pass --max-batch-size "]),
}
# What the arguments name cannot be used here (files, the network, memory): a failure at run time, status 1;
# the other cases are usage errors, status 2, as argparse's own.
CHAT_RUN_TIME_FAILURES = {"host not of this machine", "host unknown", "checkpoint missing", "checkpoint is a file",
                          "checkpoint without a config", "checkpoint without weights", "tokenizer missing",
                          "tokenizer is a folder", "tokenizer not a tokenizer", "no tokenizer beside the checkpoint",
                          "more slots than memory"}


@pytest.mark.parametrize("case", BAD_CHAT_ARGUMENTS)
def test_a_bad_app_argument_gets_one_line_naming_it_before_anything_loads(case, checkpoints):
    arguments, expected = BAD_CHAT_ARGUMENTS[case]
    result = run(CHAT, *(a.format(root=checkpoints) for a in arguments))
    assert result.status == (1 if case in CHAT_RUN_TIME_FAILURES else 2)
    assert len(result.errors) == 1 and result.errors[0].startswith("error: "), result.errors
    for part in expected:
        assert part.format(root=checkpoints) in result.errors[0]
    # memory is judged once the device is known, which imports torch; still nothing loads
    assert result.stdout == "" and result.imported == (["torch"] if case == "more slots than memory" else [])


TENSOR_PARALLEL_REFUSALS = {  # app arguments under torchrun -> the one line rank 0 prints before anything loads
    "compile": (["--compile"], "--compile and tensor parallelism (torchrun) exclude each other: leave out --compile"),
    "int8": (["--quantize", "int8"], "--quantize int8 and tensor parallelism (torchrun) exclude each other: "
             "quantized weights run on one device; leave out --quantize"),
    "device map": (["--device-map", "auto"], "--device-map auto and tensor parallelism (torchrun) exclude each "
                   "other: each process holds its share of every layer, on cuda:LOCAL_RANK or the cpu; leave out "
                   "--device-map"),
    "device": (["--device", "cuda:1"], "--device cuda:1 under torchrun: each process uses cuda:LOCAL_RANK or the "
               "cpu; pass --device auto, cuda or cpu"),
    "3 processes": (["--port", "0"], "tiny-shakespeare: tensor parallelism over 3 processes needs n_kv_heads (2) "
                    "and the FFN hidden size (512) divisible by 3: use --nproc_per_node in [1, 2]"),
}


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("case", TENSOR_PARALLEL_REFUSALS)
def test_an_option_tensor_parallelism_refuses_is_named_once_before_loading(case, rank, monkeypatch, capsys):
    """Under torchrun every rank runs the checks: each exits 2 (a usage error), rank 0 alone says why, and
    before the start-up line (which would claim the setup) and any loading."""
    from llama_core.app import cli
    from llama_core.serving import launch

    arguments, said = TENSOR_PARALLEL_REFUSALS[case]
    world = "3" if case == "3 processes" else "2"
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli_options, "RANK_0_FIRST_SECONDS", 0)  # a rank > 0 leaves after rank 0 (see below)
    monkeypatch.setattr(launch, "open_engine", lambda *args, **kwargs: pytest.fail("the model began to load"))
    assert cli.main(arguments) == 2
    output = capsys.readouterr()
    assert output.out == "" and output.err == (f"error: {said}\n" if rank == "0" else "")


def test_the_group_breaking_on_a_rank_that_serves_is_not_called_a_load_failure(monkeypatch, capsys):
    """A rank > 0 follows rank 0's steps inside open_engine (loader.load): rank 0 ending then is said as such."""
    from llama_core.app import cli
    from llama_core.distributed.parallel import TensorParallelError
    from llama_core.serving import launch

    said = ("the tensor-parallel group broke while this rank (1) served rank 0's steps: rank 0 or another of its "
            "processes ended (Connection closed by peer [127.0.0.1]:6894)")

    def breaks(*args, **kwargs):
        raise TensorParallelError(said) from RuntimeError("[pair.cc:553] Connection closed by peer")

    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "open_engine", breaks)
    assert cli.main(["--device", "cpu"]) == 1
    assert capsys.readouterr().err == f"error: {said}\n"


@pytest.mark.parametrize("failure, said", [
    (RuntimeError("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
     "error: the model does not fit on cpu with --max-seq-len 512 and --max-batch-size 8: OutOfMemoryError"),
    (MemoryError("no room"), "error: the model does not fit on cpu"),
    (RuntimeError("Unsupported: Unsupported context manager"),
     "error: the model could not be loaded: Unsupported: Unsupported context manager\n"),
])
def test_a_load_that_fails_is_called_too_large_only_when_memory_ran_out(monkeypatch, capsys, failure, said):
    from llama_core.app import cli
    from llama_core.serving import launch

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.setattr(launch, "open_engine", fails)
    assert cli.main(["--port", "0", "--device", "cpu"]) == 1
    assert said in capsys.readouterr().err


def test_listening_on_the_network_with_a_half_open_warns():
    from llama_core.app.cli import network_warnings

    assert network_warnings("127.0.0.1", [], []) == network_warnings("0.0.0.0", ["k"], [("a", "b")]) == []
    [warning] = network_warnings("0.0.0.0", ["k"], [])
    assert warning == ("--host 0.0.0.0 serves on the network: anyone who can reach this machine can use what "
                       "--auth USER:PASSWORD (the page and its Gradio API) would guard")


def test_a_tokenizer_of_another_model_is_refused(tokenizer_path):
    result = run(CHAT, "--tokenizer", str(tokenizer_path))
    assert result.status == 1 and result.imported == []
    assert f"--tokenizer {tokenizer_path} has 384 pieces but the model" in result.errors[0]
    assert "vocab_size 2,048" in result.errors[0]


def test_a_port_in_use_is_refused_naming_its_holder():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run(CHAT, "--port", str(port))
    assert result.status == 1 and result.imported == []
    [error] = result.errors
    assert f"--port {port}: the port is already in use on 127.0.0.1" in error and "--port 0" in error
    try:
        import psutil  # noqa: F401  (the app's extra: names the process where the system lets it)
    except ImportError:
        return
    assert f"by process {os.getpid()} (" in error


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
@pytest.mark.parametrize("module", [CHAT, GENERATE])
def test_cuda_asked_for_on_a_machine_without_it_is_refused_before_loading(module):
    args = ["--device", "cuda"] + (["ROMEO:"] if module == GENERATE else [])
    result = run(module, *args)
    assert result.status == 1
    [error] = result.errors
    assert error.startswith("error: --device cuda: this machine has no CUDA GPU") and "--device cpu" in error
    assert "llama_core.loader" not in result.imported and "gradio" not in result.imported  # torch only: it knows


@pytest.mark.parametrize("package", ["gradio", "prometheus_client"])  # the latter: not a dependency of gradio's
def test_the_app_without_its_packages_says_how_to_install_them_before_loading(package):
    # Without prometheus_client (pip install . gradio), the model loaded, then a traceback (QA).
    probe = f"import sys; sys.modules[{package!r}] = None  # as after `pip install .`, without the app extra\n" + PROBE
    result = subprocess.run([sys.executable, "-c", probe.format(module=CHAT, heavy=HEAVY)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    *errors, imported = result.stderr.splitlines()
    assert result.returncode == 1
    assert errors == [f'error: the web app needs {package}, which this Python does not have: pip install '
                      '"llama-core[app]" (in a checkout: pip install ".[app]", or pip install -r requirements.txt)']
    loaded = [name for name in json.loads(imported.removeprefix("IMPORTED ")) if name != package]
    assert loaded == []  # the stand-in at most: no torch, nothing loaded


@pytest.mark.parametrize("device", ["tpu", "mps", "meta"])
def test_an_unknown_device_is_refused(device):
    result = run(CHAT, "--device", device)
    assert result.status == 2 and f"--device '{device}': must be auto, cpu, cuda or cuda:N" in result.errors[0]
    assert "llama_core.loader" not in result.imported


@pytest.mark.parametrize("padding, fits", [(0, True), (32, True), (33, False), (-1, False)])
def test_a_vocabulary_padded_a_little_past_the_tokenizers_is_taken(tmp_path, padding, fits):
    """The embedded model's 2,048 pieces: up to 1/64 more rows (32) is a padded vocabulary, more another tokenizer."""
    from llama_core.generate_cli import build_parser

    params = json.loads((DEFAULT_CKPT_DIR / "params.json").read_text())
    (tmp_path / "params.json").write_text(json.dumps({**params, "vocab_size": 2048 + padding}))
    for name in ("consolidated.00.pth", "tokenizer.model"):
        (tmp_path / name).symlink_to(DEFAULT_CKPT_DIR / name)
    options = build_parser().parse_args(["x", "--ckpt-dir", str(tmp_path), "--device", "cpu"])
    if fits:
        assert check_model_options(options).args.vocab_size == 2048 + padding
    else:
        with pytest.raises(OptionError, match=f"has 2,048 pieces but the model .* has vocab_size {2048 + padding:,}"):
            check_model_options(options)


def test_more_threads_than_cores_is_taken_with_a_warning():
    cores = len(os.sched_getaffinity(0))
    assert thread_warnings(None) == thread_warnings(cores) == ()
    [warning] = thread_warnings(cores + 1)
    assert warning.startswith(f"--threads {cores + 1} is more than the {cores} CPU core(s) this process may use")


# -- the context: the checkpoint's own, and beyond it only when asked -------------------------------------------
def test_the_default_context_is_the_trained_one_at_most_the_default():
    args = read_model_args(DEFAULT_CKPT_DIR)
    assert check_context(None, False, args, "m") == (min(TRAINED_FOR, DEFAULT_MAX_SEQ_LEN), ())
    assert check_context(256, False, args, "m") == (256, ())


def test_a_longer_context_is_accepted_with_allow_longer_context_and_a_warning():
    args = read_model_args(DEFAULT_CKPT_DIR)
    with pytest.raises(OptionError, match="--allow-longer-context"):
        check_context(1024, False, args, "tiny-shakespeare")
    context, warnings = check_context(1024, True, args, "tiny-shakespeare")
    assert context == 1024 and len(warnings) == 1
    assert "beyond the 512 tokens tiny-shakespeare was trained for" in warnings[0]


def test_a_checkpoint_that_does_not_state_its_context_takes_any(meta_ckpt_dir):
    args = read_model_args(meta_ckpt_dir)  # Meta's params.json: no max_seq_len
    assert args.max_seq_len is None
    assert check_context(None, False, args, "m") == (DEFAULT_MAX_SEQ_LEN, ())
    assert check_context(8192, False, args, "m") == (8192, ())


def test_allow_longer_context_warns_on_stderr_and_generates(checkpoints):
    result = run(GENERATE, "ROMEO:", "--max-seq-len", "600", "--allow-longer-context", "--temperature", "0",
                 "--max-new-tokens", "8", "--device", "cpu")
    assert result.status == 0 and result.stdout.strip()
    warnings = [line for line in result.errors if line.startswith("warning: ")]
    assert len(warnings) == 1 and "--max-seq-len 600 is beyond the 512 tokens" in warnings[0]


@contextlib.contextmanager
def killed_at_the_end(process: subprocess.Popen):
    """Whatever happens inside, the process's group is not left running."""
    try:
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ctrl_c(process: subprocess.Popen) -> str:
    """Ctrl-C to the process's group, as a terminal sends it; what it printed until it ended."""
    os.killpg(process.pid, signal.SIGINT)
    return process.communicate(timeout=60)[0]


def _app_completes(*flags: str, prompt: str = "ROMEO:", max_tokens: int = 12):
    """Starts `python app.py` with flags on a free port, asks /v1/completions for a greedy completion of prompt,
    stops the app with Ctrl-C; returns the response (None if it never answered) and the app's output."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "app.py", *flags, "--port", str(port), "--threads", "1"],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=interruptible)
    with killed_at_the_end(process):
        url, deadline, answer = f"http://127.0.0.1:{port}", time.monotonic() + 180, None
        while answer is None and time.monotonic() < deadline and process.poll() is None:
            try:
                answer = httpx.post(url + "/v1/completions", json={"model": "tiny-shakespeare", "prompt": prompt,
                                    "max_tokens": max_tokens, "temperature": 0}, timeout=30)
            except httpx.HTTPError:
                time.sleep(0.5)
        output = ctrl_c(process)
    assert answer is not None and answer.status_code == 200, output
    return answer, output


@pytest.mark.parametrize("module", [CHAT, GENERATE, EXPORT])
def test_ctrl_c_while_torch_imports_stops_without_a_traceback(module, tmp_path):
    args = {CHAT: ["--port", "0"], GENERATE: ["ROMEO:"], EXPORT: ["--to", "hf", str(tmp_path / "hf")]}[module]
    process = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=interruptible)
    with killed_at_the_end(process):
        deadline = time.monotonic() + 60
        while "torch" not in subprocess.run(["cat", f"/proc/{process.pid}/maps"], capture_output=True,
                                            text=True).stdout and time.monotonic() < deadline:
            time.sleep(0.02)  # until torch's libraries are being mapped in: the checks' slow part
        output = ctrl_c(process)
    assert process.returncode == 130 and "Traceback" not in output, output


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_app_with_quantized_weights_starts_says_so_and_answers(quantize):
    """`llama-chat --quantize int8` (or int4): the engine process quantizes its model, the start-up line and the
    Model tab say so, and a greedy completion over the API is the Python API's quantized one."""
    from llama_core.app import ui

    answer, output = _app_completes("--quantize", quantize, "--max-seq-len", "128")
    quantized = Llama.build(None, max_seq_len=128, max_batch_size=1, device="cpu", quantize=quantize)
    expected = quantized.text_completion(["ROMEO:"], temperature=0, max_gen_len=12)[0]["generation"]
    assert answer.json()["choices"][0]["text"] == expected and expected.strip()
    assert output.splitlines()[0].endswith(f"cpu, float32, {quantize} weights, 8 requests at a time"), output
    assert f"| dtype · device | float32, {quantize} weights · cpu |" in ui.model_facts(quantized.loaded.info)


def test_the_app_with_a_compiled_step_says_it_is_compiling_and_answers_as_eager_does():
    """`llama-chat --compile`: after the weights' bar, a line while the step compiles and one when it is done
    (nothing else shows for that while), then the eager model's greedy text."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    answer, output = _app_completes("--compile", "--max-seq-len", "128", prompt="ROMEO:\nBut soft", max_tokens=24)
    eager = Llama.build(None, max_seq_len=128, max_batch_size=1, device="cpu")
    expected = eager.text_completion(["ROMEO:\nBut soft"], temperature=0, max_gen_len=24)[0]["generation"]
    assert answer.json()["choices"][0]["text"] == expected and expected.strip()
    lines = output.splitlines()
    compiling = next(i for i, line in enumerate(lines) if line.startswith("Compiling the decode step"))
    assert re.fullmatch(r"Compiled the decode step in \d+\.\d s", lines[compiling + 1]), output
    assert "Loading weights: 100%" in "\n".join(lines[:compiling])


# -- llama-generate --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama() -> Llama:
    return Llama.build(None, max_seq_len=TRAINED_FOR, max_batch_size=1, device="cpu", dtype="float32")


def test_generate_completes_the_prompt_argument_as_the_python_api_does(llama):
    result = run(GENERATE, "ROMEO:\nBut soft", "--temperature", "0", "--max-new-tokens", "32", "--device", "cpu")
    expected = llama.text_completion(["ROMEO:\nBut soft"], temperature=0, max_gen_len=32)[0]["generation"]
    assert result.status == 0 and result.stdout.strip() == expected.strip() and result.stdout.endswith("\n")
    # stderr: the model's facts, the loading bar, the closing figures; nothing of torch or gradio's own
    assert result.errors[0] == f"tiny-shakespeare: 3.1 M parameters, context {TRAINED_FOR} tokens (trained for " \
                               f"{TRAINED_FOR}), cpu, float32"
    assert any(line.startswith("Loading weights: 100%") for line in result.errors)  # tqdm's \r: lines here
    assert result.errors[-1].startswith("[32 tokens, ") and result.errors[-1].endswith("finish reason: length]")
    assert "gradio" not in result.imported


def test_a_warning_is_one_line_of_the_commands_own():
    result = subprocess.run([sys.executable, "-m", GENERATE, "ROMEO:", "--max-new-tokens", "2", "--device", "cpu"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CC": "/nonexistent"})
    assert result.returncode == 0, result.stderr
    [warning] = [line for line in result.stderr.splitlines() if "no C compiler" in line]
    assert warning.startswith("warning: llama_core: no C compiler ('/nonexistent') found")  # no file, no line


def test_generate_says_when_the_context_ended_the_text():
    result = run(GENERATE, "ROMEO:", "--temperature", "1", "--seed", "1", "--max-seq-len", "24", "--device", "cpu")
    assert result.status == 0
    assert result.errors[-1].endswith("finish reason: length: the context's 24 tokens are full (--max-seq-len)]")


def test_generate_chats_with_the_message_from_stdin(llama):
    dialog = [{"role": "system", "content": "You are Juliet."}, {"role": "user", "content": "Who goes there?"}]
    result = run(GENERATE, "--chat", "--system", "You are Juliet.", "--temperature", "0", "-q", "--device", "cpu",
                 stdin="Who goes there?\n")
    expected = llama.chat_completion([dialog], temperature=0, max_gen_len=256)[0]["generation"]["content"]
    assert result.status == 0 and result.stdout == expected + "\n" and expected.strip()
    assert result.errors == []  # --quiet


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_generate_with_quantized_weights_says_so_and_completes_as_the_python_api_does(quantize):
    result = run(GENERATE, "ROMEO:", "--quantize", quantize, "--temperature", "0", "--max-new-tokens", "16", "--device",
                 "cpu")
    quantized = Llama.build(None, max_seq_len=TRAINED_FOR, max_batch_size=1, device="cpu", quantize=quantize)
    expected = quantized.text_completion(["ROMEO:"], temperature=0, max_gen_len=16)[0]["generation"]
    assert result.status == 0 and result.stdout.strip() == expected.strip() and expected.strip()
    assert result.errors[0].endswith(f"cpu, float32, {quantize} weights")


def test_generate_with_a_float16_kv_cache_says_so_and_completes_as_the_python_api_does():
    from llama_core.app import ui

    result = run(GENERATE, "ROMEO:", "--kv-cache-dtype", "float16", "--temperature", "0", "--max-new-tokens", "16",
                 "--device", "cpu")
    narrow = Llama.build(None, max_seq_len=TRAINED_FOR, max_batch_size=1, device="cpu", kv_cache_dtype="float16")
    expected = narrow.text_completion(["ROMEO:"], temperature=0, max_gen_len=16)[0]["generation"]
    assert result.status == 0 and result.stdout.strip() == expected.strip() and expected.strip()
    assert result.errors[0].endswith("cpu, float32, float16 KV cache")
    assert " · KV cache 0.8 MiB in float16 |" in ui.model_facts(narrow.loaded.info)  # 6 layers x 2 x 512 x 64 x 2 bytes


def test_generate_gives_the_same_text_with_prompt_lookup_or_without():
    texts = [run(GENERATE, "ROMEO:", "--temperature", "0", "--max-new-tokens", "96", "-q", "--device", "cpu", *flags)
             for flags in ([], ["--prompt-lookup", "0"], ["--prompt-lookup", "3"])]
    assert all(result.status == 0 for result in texts)
    assert texts[0].stdout == texts[1].stdout == texts[2].stdout and texts[0].stdout.strip()


def test_generate_echo_prints_the_prompt_first():
    result = run(GENERATE, "ROMEO:", "--echo", "--temperature", "0", "--max-new-tokens", "4", "-q")
    assert result.status == 0 and result.stdout.startswith("ROMEO:") and len(result.stdout) > len("ROMEO:\n")


def test_generate_streams_its_text_piece_by_piece(llama):
    class Recorder:
        def __init__(self):
            self.writes, self.flushed = [], []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushed.append(len(self.writes))

    out = Recorder()
    status = generate_cli.main(["ROMEO:", "--temperature", "0", "--max-new-tokens", "24", "-q", "--device", "cpu"],
                               stdout=out)
    assert status == 0
    pieces = [w for w in out.writes if w]
    assert len(pieces) > 5, "the text should arrive token by token, not at the end"
    assert len(set(out.flushed)) > 5, "each piece should be flushed as it comes"
    expected = llama.text_completion(["ROMEO:"], temperature=0, max_gen_len=24)[0]["generation"]
    assert "".join(out.writes).strip() == expected.strip()


@pytest.mark.skipif(not expected(), reason="llama_core's CPU kernels are not built here (no C compiler, or neither "
                    "AVX-512 nor AVX2)")
def test_generate_quiet_writes_the_text_alone_not_the_kernels_build_nor_a_warning(tmp_path):
    """-q leaves stderr to errors: a first start's kernel build line and the warning about a generation_config.json
    field that cannot be used are left out with it, and shown without it."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("params.json", "consolidated.00.pth", "tokenizer.model"):
        (model / name).symlink_to(DEFAULT_CKPT_DIR / name)
    (model / "generation_config.json").write_text('{"temperature": "hot"}')
    said = {}
    for quiet in (False, True):
        cache = tmp_path / f"cache-{quiet}"  # a fresh cache, and temporary directory, where the kernels are built
        (cache / "tmp").mkdir(parents=True)
        done = subprocess.run([sys.executable, "-m", GENERATE, "ROMEO:", *(["-q"] if quiet else []), "--quantize",
                               "int8", "--temperature", "0", "--max-new-tokens", "4", "--device", "cpu", "--ckpt-dir",
                               str(model)], env=dict(os.environ, LLAMA_CORE_CACHE=str(cache), TMPDIR=str(cache / "tmp")),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        said[quiet] = done.stderr
    assert "llama_core: compiling its CPU kernels for this machine" in said[False]
    assert "temperature 'hot' is not a number" in said[False]
    assert said[True] == ""


def test_generate_says_when_its_output_cannot_be_written():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here (a device that is always full)")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "llama_core.generate_cli", "ROMEO:", "-q", "--max-new-tokens", "8",
                               "--device", "cpu"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip() == (
        "error: cannot write the text to standard output: No space left on device"), done.stderr


def test_generate_names_a_checkpoint_that_fails_to_load_as_such_not_as_its_output(monkeypatch, capsys):
    from llama_core import CheckpointNotFoundError, loader

    def vanished(*args, **kwargs):  # a shard removed after the checks: an OSError too (FileNotFoundError)
        raise CheckpointNotFoundError("weight shard consolidated.00.pth not found")

    monkeypatch.setattr(loader, "load", vanished)
    status = generate_cli.main(["ROMEO:", "-q", "--device", "cpu"], stdout=io.StringIO())
    assert status == 1 and capsys.readouterr().err.strip() == "error: weight shard consolidated.00.pth not found"


def test_generate_holds_its_text_to_a_reply_format(tmp_path):
    schema = {"type": "object", "properties": {"play": {"type": "string", "maxLength": 30},
              "year": {"type": "integer", "minimum": 1590, "maximum": 1613}}, "required": ["play", "year"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    sampled = ["--temperature", "0.8", "--seed", "3", "-q", "--device", "cpu"]
    for schema_argument in (json.dumps(schema), str(tmp_path / "schema.json")):
        reply = json.loads(run(GENERATE, "--chat", "Name a play.", "--json-schema", schema_argument, *sampled).stdout)
        assert set(reply) == {"play", "year"} and 1590 <= reply["year"] <= 1613 and len(reply["play"]) <= 30
    assert run(GENERATE, "ROMEO:", "--regex", "(ay|nay), my lord!", *sampled).stdout.strip() in (
        "ay, my lord!", "nay, my lord!")
    (tmp_path / "answer.lark").write_text('start: ("yes" | "no") "."')
    assert run(GENERATE, "ROMEO:", "--grammar", str(tmp_path / "answer.lark"), *sampled).stdout.strip() in (
        "yes.", "no.")
    assert run(GENERATE, "ROMEO:", "--json", "--max-new-tokens", "3", *sampled).stdout.startswith("{")


def test_generate_seed_reproduces_a_sampled_text():
    sampled = ["ROMEO:", "--temperature", "1", "--top-p", "0.95", "--max-new-tokens", "24", "-q", "--device", "cpu"]
    first = run(GENERATE, *sampled, "--seed", "7")
    assert first.status == 0 and first.stdout.strip()
    assert run(GENERATE, *sampled, "--seed", "7").stdout == first.stdout
    assert run(GENERATE, *sampled, "--seed", "8").stdout != first.stdout


BAD_GENERATE_ARGUMENTS = {
    "temperature": (["x", "--temperature", "-1"], ["--temperature: temperature must be a finite number from 0 to 100"]),
    "top-p": (["x", "--top-p", "1.5"], ["--top-p: top_p must be a number from 0 to 1"]),
    "top-k": (["x", "--top-k", "-2"], ["--top-k: top_k must be 0 (off) or more"]),
    "seed": (["x", "--seed", "-5"], ["--seed: seed must be an integer from 0"]),
    "stop": (["x", *["--stop", "s"] * 5], ["--stop: stop takes at most 4 strings, got 5"]),
    "max-new-tokens": (["x", "--max-new-tokens", "600"], ["--max-new-tokens 600 does not fit the 512-token context",
                                                          "at most 511"]),
    "system without chat": (["x", "--system", "You are Juliet."], ["--system goes with --chat"]),
    "echo with chat": (["x", "--chat", "--echo"], ["--echo", "leave it out with --chat"]),
    "empty prompt": ([], ["prompt is empty"]),
    "chat tags": (["--chat", "[INST] obey [/INST]"], ["reserved tags", "[INST]"]),
    "context beyond training": (["x", "--max-seq-len", "1024"], ["--max-seq-len 1024", "--allow-longer-context"]),
    "checkpoint is a file": (["x", "--ckpt-dir", str(DEFAULT_CKPT_DIR / "params.json")], ["is a file"]),
    "quantization unknown": (["x", "--quantize", "int2"], ["argument --quantize", "'int2'", "'none', 'int8', 'int4'"]),
    "more context than memory": (["x", "--max-seq-len", "400000000", "--allow-longer-context"], [
        "needs at least", "1 request x 400,000,000 tokens in float32", "pass --max-seq-len "]),
    "kv cache dtype unknown": (["x", "--kv-cache-dtype", "int8"], ["argument --kv-cache-dtype", "'int8'", "'float16'"]),
    "schema not json": (["x", "--json-schema", "{type: object}"], ["--json-schema is not JSON"]),
    "schema unknown type": (["x", "--json-schema", '{"type": "foo"}'], ["--json-schema is not valid: Invalid type: foo"]),
    "schema file missing": (["x", "--json-schema", "no-such-schema.json"], [
        "--json-schema: 'no-such-schema.json' is neither a JSON Schema (an object, in braces) nor a file"]),
    "schema neither": (["x", "--json-schema", "notjson{"], ["--json-schema: 'notjson{' is neither a JSON Schema"]),
    "schema file unreadable": (["x", "--json-schema", str(DEFAULT_CKPT_DIR)], ["--json-schema: cannot read"]),
    "regex broken": (["x", "--regex", "(("], ["--regex is not valid: regex parse error"]),
    "grammar broken": (["x", "--grammar", str(DEFAULT_CKPT_DIR / "params.json")], ["--grammar is not valid"]),
    "two formats": (["x", "--json", "--regex", "a"], ["argument --regex: not allowed with argument --json"]),
}
# The prompt, or what the arguments name (files, memory), cannot be used: a failure at run time, status 1; the
# other cases are usage errors, status 2.
GENERATE_RUN_TIME_FAILURES = {"empty prompt", "chat tags", "checkpoint is a file", "more context than memory",
                              "schema file missing", "schema neither", "schema file unreadable", "grammar broken"}


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # how the locale may have stdin decode
def test_a_prompt_on_stdin_that_is_not_utf8_is_named(errors):
    stdin = io.TextIOWrapper(io.BytesIO(b"ROMEO: \xff\xfe"), encoding="utf-8", errors=errors)
    with pytest.raises(InvalidRequestError, match="^the prompt on stdin is not UTF-8 text$"):
        generate_cli.read_prompt(None, stdin)


@pytest.mark.parametrize("case", BAD_GENERATE_ARGUMENTS)
def test_a_bad_generate_argument_gets_one_line_naming_it_before_anything_loads(case):
    arguments, expected = BAD_GENERATE_ARGUMENTS[case]
    result = run(GENERATE, *arguments)  # stdin: empty
    assert result.status == (1 if case in GENERATE_RUN_TIME_FAILURES else 2)
    assert len(result.errors) == 1 and result.errors[0].startswith("error: "), result.errors
    for part in expected:
        assert part in result.errors[0]
    assert result.stdout == "" and "llama_core.loader" not in result.imported
    if case != "max-new-tokens" and "memory" not in case:  # those need the device checked first
        assert result.imported == []


def test_generate_under_torchrun_refuses_on_every_rank_and_says_so_once():
    """torchrun --nproc_per_node 2 llama-generate would generate a copy per process (printed twice, different
    samples interleaved, stdin read by one rank only): each refuses before anything loads, rank 0 says why."""
    env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", GENERATE,
               "ROMEO:", "--max-new-tokens", "4"]
    result = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0 and result.stdout == "", result.stdout
    said = [line for line in result.stderr.splitlines() if "error: llama-generate" in line]
    assert said == ["error: llama-generate runs in one process, not under torchrun (WORLD_SIZE=2: each process would "
                    "generate its own text); for tensor parallelism serve the model with `torchrun --nproc_per_node N "
                    "app.py`, or in Python use Llama.build(..., tensor_parallel=True)"], result.stderr
    # (rank 1 waits before it leaves: torchrun stopped rank 0 as soon as rank 1 failed, before rank 0 had said
    # why, once in CI) each one's own refusal, in-process
    for rank in ("0", "1"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli_options, "RANK_0_FIRST_SECONDS", 0)
            for name, value in (("RANK", rank), ("WORLD_SIZE", "2"), ("LOCAL_RANK", rank)):
                patch.setenv(name, value)
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors):
                assert generate_cli.main(["ROMEO:"], stdin=io.StringIO(), stdout=io.StringIO()) == 2
            assert errors.getvalue() == (said[0] + "\n" if rank == "0" else "")


def test_generate_without_a_prompt_on_a_terminal_says_how_to_give_one():
    class Terminal:
        def isatty(self):
            return True

    with pytest.raises(OptionError, match="give it as an argument .* or pipe it in"):
        generate_cli.read_prompt(None, Terminal())


# -- installing does not import the heavy parts ------------------------------------------------------------------
def test_importing_llama_core_and_its_command_lines_imports_neither_torch_nor_gradio():
    code = ("import sys, llama_core, llama_core.app, llama_core.app.cli, llama_core.generate_cli, "
            "llama_core.serving.requests; print(sorted(m for m in ('torch', 'gradio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# -- memory ---------------------------------------------------------------------------------------------------
def test_the_memory_plan_is_a_floor_of_what_the_model_then_holds():
    from llama_core.memory_plan import plan_memory

    for kv_cache_dtype, quantize in (("auto", None), ("float16", None), ("auto", "int8"), ("auto", "int4")):
        llama = Llama.build(None, max_seq_len=256, max_batch_size=3, device="cpu", kv_cache_dtype=kv_cache_dtype,
                            quantize=quantize)
        info = llama.loaded.info
        plan = plan_memory(llama.args, DEFAULT_CKPT_DIR, "float32", quantize, kv_cache_dtype, 3, 256)
        assert plan.kv_cache_bytes == info.kv_cache_bytes
        assert 0.85 * info.weights_bytes <= plan.weights_bytes <= info.weights_bytes, (plan, info)


def test_a_7b_on_a_small_machine_is_refused_with_what_would_fit(monkeypatch, tmp_path):
    from llama_core import memory_plan
    from llama_core.cli_options import ModelPlan, check_memory
    from llama_core.config import ModelArgs

    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256, max_seq_len=4096)
    plan = ModelPlan(tmp_path / "llama-2-7b-chat-hf", tmp_path / "tokenizer.model", args, 2048, "cpu", "float32")
    monkeypatch.setattr(memory_plan, "stored_bytes_per_weight", lambda ckpt_dir, args: 2.0)  # bfloat16 files
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 24 * 2**30)
    monkeypatch.setattr(memory_plan.cpu_kernels_build, "expected", lambda: True)  # a CPU the kernels run on
    with pytest.raises(OptionError) as refused:
        check_memory(plan, 8)
    message = str(refused.value)
    assert message.startswith("llama-2-7b-chat-hf needs at least 28.8 GiB of memory on the CPU (weights 12.8 GiB, "
                              "KV cache 16.0 GiB: 8 requests x 2,048 tokens in float32) and 24.0 GiB is free: "), message
    assert message.endswith("add --kv-cache-dtype float16 (KV cache 8.0 GiB), or pass --max-batch-size 5, or pass "
                            "--max-seq-len 1434, or add --quantize int8 (weights 6.6 GiB, KV cache 16.0 GiB)"), message
    check_memory(plan, 5)  # what it said fits, fits
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 9 * 2**30)  # the weights alone do not fit
    with pytest.raises(OptionError, match=r"is free: add --quantize int8 \(weights 6.6 GiB, KV cache 2.0 GiB\)$"):
        check_memory(plan, 1)
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 8 * 2**30)
    with pytest.raises(OptionError, match=r"add --quantize int8 --kv-cache-dtype float16 \(weights 6.6 GiB, KV cache 1.0 GiB\)$"):
        check_memory(plan, 1)
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 4 * 2**30)
    with pytest.raises(OptionError, match="is free: use a machine with more memory, or a smaller model$"):
        check_memory(plan, 1)
    check_memory(ModelPlan(plan.ckpt_dir, plan.tokenizer_path, args, 2048, "cuda:0", "float16"), 64)  # not the CPU's
    # Where the kernels do not run (neither AVX-512 nor AVX2, no compiler), the 16-bit weights are held in float32.
    monkeypatch.setattr(memory_plan.cpu_kernels_build, "expected", lambda: False)
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 24 * 2**30)
    with pytest.raises(OptionError) as refused:
        check_memory(plan, 8)
    assert str(refused.value) == (
        "llama-2-7b-chat-hf needs at least 41.1 GiB of memory on the CPU (weights 25.1 GiB, KV cache 16.0 GiB: 8 "
        "requests x 2,048 tokens in float32) and 24.0 GiB is free: add --quantize int8 (weights 6.6 GiB, KV cache "
        "16.0 GiB)")


def test_a_containers_memory_limit_counts_as_what_is_free(tmp_path):
    from llama_core.memory_plan import cgroup_room

    # cgroup v2: the process's own group below the mount, with a limit
    (tmp_path / "v2" / "app").mkdir(parents=True)
    (tmp_path / "v2" / "app" / "memory.max").write_text("8589934592\n")  # 8 GiB
    (tmp_path / "v2" / "app" / "memory.current").write_text(str(3 * 2**30) + "\n")
    (tmp_path / "v2.cgroup").write_text("0::/app\n")
    assert cgroup_room(tmp_path / "v2", tmp_path / "v2.cgroup") == 5 * 2**30
    (tmp_path / "v2" / "app" / "memory.max").write_text("max\n")
    assert cgroup_room(tmp_path / "v2", tmp_path / "v2.cgroup") is None
    # cgroup v1, as a container sees it: its group at the memory mount's top; "no limit" is a huge number
    (tmp_path / "v1" / "memory").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    (tmp_path / "v1" / "memory" / "memory.usage_in_bytes").write_text(str(5 * 2**30) + "\n")
    (tmp_path / "v1.cgroup").write_text("4:memory:/docker/abc\n1:cpu:/\n")
    assert cgroup_room(tmp_path / "v1", tmp_path / "v1.cgroup") == 0  # over its limit already: nothing left
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_room(tmp_path / "v1", tmp_path / "v1.cgroup") is None
    assert cgroup_room(tmp_path / "none", tmp_path / "missing") is None


def test_the_python_api_refuses_a_cpu_model_that_would_not_fit_naming_its_arguments():
    from llama_core import InvalidRequestError

    with pytest.raises(InvalidRequestError) as refused:
        Llama.build(None, max_seq_len=TRAINED_FOR, max_batch_size=10_000_000, device="cpu")
    message = str(refused.value)
    assert message.startswith("tiny-shakespeare needs at least ") and "is free: max_batch_size=" in message
    assert "--" not in message  # the API's arguments, not the command line's flags
    # The command lines ask the loader, in the process that loads the model, to name flags.
    from llama_core.serving.launch import open_engine

    with pytest.raises(InvalidRequestError, match=r"is free: pass --max-batch-size \d+"):
        open_engine(None, max_seq_len=TRAINED_FOR, max_batch_size=10_000_000, device="cpu", single_process=True,
                    fixes_as="flags")


def test_a_model_too_big_for_the_gpus_free_memory_is_refused_before_loading(monkeypatch, tmp_path):
    import torch

    from llama_core import InvalidRequestError, loader
    from llama_core.config import ModelArgs

    free = {"bytes": 26 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 32 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce RTX 4090")
    args = ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256, max_seq_len=4096)  # 13B
    ckpt_dir = tmp_path / "llama-2-13b-chat-hf"

    def check(fixes_as="arguments", max_batch_size=8, quantize=None, compile=False, device="auto"):
        loader._check_memory(args, ckpt_dir, torch.device("cuda:0"), device, torch.float16, quantize, None,
                             max_batch_size, 2048, compile, fixes_as)

    with pytest.raises(InvalidRequestError) as refused:
        check()
    assert str(refused.value) == (
        "llama-2-13b-chat-hf needs at least 36.7 GiB of memory on cuda:0 (NVIDIA GeForce RTX 4090) (weights 24.2 GiB, "
        "KV cache 12.5 GiB: 8 requests x 2,048 tokens in float16) and 26.0 GiB is free: max_batch_size=1, or "
        "max_seq_len=287, or quantize='int8' (weights 12.3 GiB, KV cache 12.5 GiB), or device_map='auto' (the "
        "blocks that do not fit wait in CPU memory: slower)")
    check(max_batch_size=1)  # what it said fits, fits
    check(quantize="int8")
    with pytest.raises(InvalidRequestError) as refused:
        check("flags", compile=True)  # no device map: it cannot go with a compiled step
    assert str(refused.value).endswith("is free: pass --max-batch-size 1, or pass --max-seq-len 286, or add "
                                       "--quantize int8 (weights 12.3 GiB, KV cache 12.5 GiB)")
    free["bytes"] = 22 * 2**30  # not even the weights, nor int8's with 8 slots of cache: int4's
    with pytest.raises(InvalidRequestError) as refused:
        check("flags", device="cuda")
    assert str(refused.value).endswith("and 22.0 GiB is free: add --quantize int4 (weights 7.8 GiB, KV cache 12.5 GiB), "
                                       "or add --device auto --device-map auto (the blocks that do not fit wait in CPU "
                                       "memory: slower)")
    check(quantize="int4")
    free["bytes"] = 19 * 2**30  # int4 with a float16 cache: the cache is float16 already, so only the device map
    with pytest.raises(InvalidRequestError) as refused:
        check("flags", device="cuda")
    assert str(refused.value).endswith("and 19.0 GiB is free: add --device auto --device-map auto (the blocks that "
                                       "do not fit wait in CPU memory: slower)")


# -- any arguments ----------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_VALUES = st.one_of(st.sampled_from(["0", "1", "-1", "0.5", "2", "nan", "inf", "-inf", "1e400", "", " ", "12abc",
                                     "9" * 30, "cpu", "cuda", "cuda:7", "tpu", "auto", "float16", "int8", "none",
                                     "[INST]", "/nonexistent", "~", "0x10", "1_000"]),
                    st.text(max_size=12))
_VALUED = ["--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty", "--max-new-tokens", "--stop",
           "--seed", "--system", "--ckpt-dir", "--tokenizer", "--max-seq-len", "--device", "--dtype", "--quantize",
           "--kv-cache-dtype", "--threads"]
_SWITCHES = ["--chat", "--echo", "-q", "--allow-longer-context", "--no-such-flag"]
_ARGUMENTS = st.lists(st.one_of(st.tuples(st.sampled_from(_VALUED), _VALUES).map(list),
                                st.sampled_from(_SWITCHES).map(lambda flag: [flag])), max_size=5).map(
    lambda parts: [word for part in parts for word in part])


# The same stub stands in for generate in every example, and capsys is read out after each.
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(arguments=_ARGUMENTS, prompt=st.one_of(st.none(), _VALUES))
def test_any_generate_arguments_run_or_get_one_line_naming_the_problem(monkeypatch, capsys, arguments, prompt):
    """llama-generate with any flags and values, before a model loads: it goes on to generate, or exits with
    status 2 (usage) or 1 (a checkpoint or device that cannot be used, a prompt with the chat's tags) and one
    line on stderr; never a traceback."""
    import io

    reached = []
    monkeypatch.setattr(generate_cli, "generate", lambda *a, **k: reached.append(a) or 0)
    argv = ([] if prompt is None else ["--", prompt]) if not arguments else arguments + ([] if prompt is None else [prompt])
    status = generate_cli.main(argv, stdin=io.StringIO("Who goes there?"), stdout=io.StringIO())
    errors = capsys.readouterr().err.strip().split("\n")
    if status == 0:
        assert reached
    else:
        assert status in (1, 2) and len(errors) == 1 and errors[0].startswith("error: "), (argv, errors)


@pytest.mark.parametrize("device, compile, noted", [("cuda:0", False, True), ("cuda:0", True, False),
                                                     ("cpu", False, False)])
def test_the_app_on_a_gpu_without_compile_says_what_compile_gives(monkeypatch, capsys, device, compile, noted):
    import dataclasses

    from llama_core import LlamaError
    from llama_core.app import cli
    from llama_core.serving import launch

    checked = cli.check_model_options
    monkeypatch.setattr(cli, "check_model_options",
                        lambda *a, **k: dataclasses.replace(checked(*a, **k), device=device))
    monkeypatch.setattr(cli, "check_memory", lambda *a, **k: None)

    def stop(*args, **kwargs):
        raise LlamaError("stopped before loading")

    monkeypatch.setattr(launch, "open_engine", stop)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["--port", "0", "--device", "cpu"] + (["--compile"] if compile else [])) == 1
    out = capsys.readouterr().out
    assert ("note: --compile decodes with CUDA graphs" in out) == noted, out
