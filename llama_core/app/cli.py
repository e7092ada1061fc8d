"""`llama-chat` (and `python app.py` in a checkout): serve a Llama-2 model in the web app.

Order of work, so that a mistake is reported in a second rather than after the model has loaded:
parse the arguments (no torch or gradio imported: `--help` answers at once), check the address, the
checkpoint, the tokenizer, the context and the prompts (files only), then the device and dtype (imports
torch), and only then load the model, with a progress bar, and start the web server. A bad argument
prints one line naming the flag and the fix. The exit status is 0 after a clean stop, 2 for a usage error (a bad
option or value, options that exclude each other), 1 for a failure at run time (a checkpoint, tokenizer or
prompts file missing or unusable, a port in use, too little memory, a model that fails to load or a model
process that fails), 130 on Ctrl-C before serving.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

from ..cli_options import (EXIT_FAILURE, EXIT_STATUS_EPILOG, ArgumentParser, OptionError, ResourceError,
                           add_model_options, after_rank_0, check_memory, check_model_options, exit_status,
                           non_negative_int, non_negative_seconds, plain_warnings, positive_int)
from ..errors import LlamaError
from ..prompt_library import load_prompts
from .address import listen_socket, port_number, root_path

API_KEYS_VARIABLE = "LLAMA_API_KEYS"  # comma-separated keys, beside any --api-key
AUTH_VARIABLE = "LLAMA_AUTH"  # comma-separated user:password pairs, beside any --auth


def build_parser() -> ArgumentParser:
    """llama-chat's arguments: the model options, the engine's, and where to serve."""
    p = ArgumentParser(prog="llama-chat", description="Serve a Llama-2 model in a web app: chat, completion, "
                       "the model's facts, and a streaming API.", epilog=EXIT_STATUS_EPILOG)
    add_model_options(p)
    p.add_argument("--max-batch-size", type=positive_int, default=8,
                   help="most requests decoded together; more wait in a queue (default: 8)")
    p.add_argument("--max-waiting", type=non_negative_int, default=64,
                   help="requests that may wait for a slot when all are busy; beyond them a new request is refused "
                   "at once as busy (503 on the API) rather than left to time out (default: 64)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt whole, instead of reusing the KV cache of the prefix it shares with "
                   "an earlier request (a chat's earlier turns, a shared system prompt)")
    p.add_argument("--device-map", choices=["auto", "balanced", "balanced_low_0", "sequential"],
                   help="spread whole layers over several GPUs with accelerate (CPU memory as a last resort) "
                   "instead of --device; for models larger than one GPU")
    p.add_argument("--max-memory", help="with --device-map: the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--compile", action="store_true", help="decode with a step compiled by torch.compile: CUDA "
                   "graphs on GPU (compiled while the model loads); on CPU it measured slower than the default")
    p.add_argument("--threads", type=positive_int, help="CPU threads for torch (default on CPU: one fewer than "
                   "the cores, leaving one to the web server; elsewhere torch's own choice)")
    p.add_argument("--single-process", action="store_true", help="run the model in the web server's process "
                   "(default: a process of its own, so the web server's Python never holds up a decode step; "
                   "under torchrun the model always runs in rank 0's process)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=7860, help="port to listen on; 0 takes any free one "
                   "(default: 7860)")
    p.add_argument("--share", action="store_true", help="also ask Gradio for a public share link (needs internet; "
                   "without it the app still serves locally); needs --auth (the page) and --api-key (the OpenAI "
                   "API), since the link is public and reaches both")
    p.add_argument("--share-without-auth", action="store_true",
                   help="allow --share without --auth and --api-key: anyone with the link can use what they would "
                   "guard")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on the OpenAI-compatible API (/v1); repeat for several "
                   f"keys, or list them in ${API_KEYS_VARIABLE}, comma-separated")
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASSWORD",
                   help=f"require this login on the web page and its Gradio API; repeat for several users, or list "
                   f"them in ${AUTH_VARIABLE}, comma-separated")
    p.add_argument("--model-name", help="the model's id in the OpenAI-compatible API (default: the checkpoint "
                   "folder's name)")
    p.add_argument("--stop-grace", type=non_negative_seconds, default=10.0, metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM, the seconds requests in flight get to end before those left end with "
                   "an error; new ones are refused at once (default: 10)")
    p.add_argument("--root-path", type=root_path, metavar="PATH",
                   help="behind a reverse proxy that serves the app at a sub-path, that path (e.g. /llama), or the "
                   "public URL of the app: the page asks for its files and events there (default: the "
                   "GRADIO_ROOT_PATH environment variable, else /)")
    p.add_argument("--access-log", action="store_true", help="print a line per HTTP request (client, method, path, "
                   "status: refusals and failed logins show), as uvicorn writes them")
    return p


def access_options(args) -> tuple[list[str], list[tuple[str, str]]]:
    """(API keys, (user, password) logins) from the flags and the environment.

    Raises:
        OptionError: an empty key, a login without a user or password, or --share that would be open to all.
    """
    keys = list(args.api_key) + [k for k in os.environ.get(API_KEYS_VARIABLE, "").split(",") if k.strip()]
    if any(not key.strip() for key in keys):
        raise OptionError("--api-key: a key must not be empty")
    logins = []
    for pair in list(args.auth) + [p for p in os.environ.get(AUTH_VARIABLE, "").split(",") if p.strip()]:
        user, colon, password = pair.partition(":")
        if not colon or not user.strip() or not password:
            raise OptionError(f"--auth {pair.split(':')[0]}...: give a login as USER:PASSWORD, both non-empty")
        logins.append((user.strip(), password))
    open_halves = _unguarded(keys, logins)
    if args.share and open_halves and not args.share_without_auth:  # the link forwards the whole port
        raise OptionError("--share makes a public link to the page and the API alike: protect "
                          + ("both with " if len(open_halves) == 2 else "the other half too with ")
                          + " and ".join(open_halves) + ", or pass --share-without-auth to share it open to anyone")
    if args.model_name is not None and not args.model_name.strip():
        raise OptionError("--model-name must not be empty")
    return [key.strip() for key in keys], logins


def _unguarded(keys: list[str], logins: list[tuple[str, str]]) -> list[str]:
    """The flags that would guard what is open: the page and its Gradio API (--auth), the OpenAI API (--api-key)."""
    return [flag for flag, given in (("--auth USER:PASSWORD (the page and its Gradio API)", logins),
                                     ("--api-key KEY (the OpenAI API under /v1)", keys)) if not given]


def network_warnings(host: str, keys: list[str], logins: list[tuple[str, str]]) -> list[str]:
    """A warning where the app listens beyond this machine with a half of it open to whoever reaches it."""
    open_halves = _unguarded(keys, logins)
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.") or not open_halves:
        return []
    return [f"--host {host} serves on the network: anyone who can reach this machine can use what "
            f"{' and '.join(open_halves)} would guard"]


APP_PACKAGES = ("gradio", "fastapi", "uvicorn", "pydantic", "prometheus_client")  # the app extra's (pyproject.toml)


def check_app_packages() -> None:
    """Raises ResourceError, before anything loads, where the app's packages are not installed (`pip install .`
    installs the library alone)."""
    missing = [name for name in APP_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ResourceError(f"the web app needs {', '.join(missing)}, which this Python does not have: "
                          "pip install \"llama-core[app]\" (in a checkout: pip install \".[app]\", or "
                          "pip install -r requirements.txt)")


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the app until Ctrl-C. Returns the exit status: 0; 2 for a usage error (before anything loads); 1 for
    a failure at run time (what the options name, a model that does not fit its device or fails to load, a
    model process that fails); 130 for Ctrl-C before serving."""
    plain_warnings()
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before the app serves (torch importing, the model loading): no traceback
        return 130


def _run(argv: Optional[list[str]]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad argument (2), already printed
        return stop.code
    under_torchrun = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))  # as
    # llama_core.distributed.parallel.launched_by_torchrun says, without importing torch
    try:
        if under_torchrun:
            check_tensor_parallel_options(args)
        check_app_packages()
        api_keys, logins = access_options(args)
        # Rank 0 serves; under torchrun the other ranks only replay its steps.
        sock = listen_socket(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
        prompts = load_prompts()
        if args.max_memory is not None and args.device_map is None:
            raise OptionError("--max-memory goes with --device-map: add --device-map auto, or leave out --max-memory")
        if args.compile and args.device_map is not None:
            raise OptionError("--compile and --device-map exclude each other: the compiled step runs a model on one "
                              "device; leave out one of them")
        plan = check_model_options(args, args.device_map)
        if under_torchrun:
            check_world_size(plan, int(os.environ["WORLD_SIZE"]))
        check_memory(plan, args.max_batch_size, args.compile)
        if args.max_memory is not None:
            check_max_memory(args.max_memory)
    except LlamaError as exc:  # OptionError, or a prompts file that cannot be used
        if not isinstance(exc, TensorParallelOptionError) or os.environ.get("RANK") == "0":  # the same on each rank:
            print(f"error: {exc}", file=sys.stderr)  # said once
        else:
            after_rank_0()
        return exit_status(exc)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        parallel = f", tensor parallel over {os.environ['WORLD_SIZE']} processes" if under_torchrun else ""
        print(f"{plan.summary()}{parallel}, {args.max_batch_size} requests at a time", flush=True)
        for warning in [*plan.warnings, *network_warnings(args.host, api_keys, logins)]:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if plan.device.startswith("cuda") and not args.compile and "RANK" not in os.environ:
            print("note: --compile decodes with CUDA graphs (a 7B model on an H100: 184 tokens/s for one request); "
                  "it compiles while the model loads", flush=True)

    from ..serving.launch import open_engine

    try:
        engine = open_engine(plan.ckpt_dir, plan.tokenizer_path, plan.max_seq_len, args.max_batch_size, args.device,
                             args.dtype, args.device_map, args.max_memory, args.compile, args.threads,
                             args.single_process, progress=True, prefix_caching=not args.no_prefix_caching,
                             max_waiting=args.max_waiting, quantize=plan.quantize,
                             kv_cache_dtype=plan.kv_cache_dtype, prompt_lookup=args.prompt_lookup, fixes_as="flags")
    except LlamaError as exc:  # a checkpoint that fails to load, a model too large for the GPU's free memory, or
        # on a rank > 0 under torchrun (which serves rank 0's steps inside open_engine) the group breaking
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() or "OutOfMemoryError" in reason:
            print(f"error: the model does not fit on {plan.device} with --max-seq-len {plan.max_seq_len} and "
                  f"--max-batch-size {args.max_batch_size}: {reason}; lower them, or use a smaller --dtype",
                  file=sys.stderr)
        else:  # a failure of another kind (not the sizes: lowering them would not help)
            print(f"error: the model could not be loaded: {reason}", file=sys.stderr)
        return EXIT_FAILURE
    from ..openai_api.metrics import MeteredEngine
    from .server import EngineFailedError, serve
    from .ui import build_demo

    served = MeteredEngine(engine)  # the page's replies and the API's, counted together at /metrics
    try:
        serve(build_demo(served, prompts), served, sock, args.share, api_keys, logins, args.model_name,
              args.stop_grace, args.access_log, args.root_path)
    except EngineFailedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        engine.shutdown()
        if sock is not None:
            sock.close()
    return 0


class TensorParallelOptionError(OptionError):
    """An option that does not go with tensor parallelism (torchrun): every rank finds it, rank 0 says it."""


def check_tensor_parallel_options(args) -> None:
    """Under torchrun, before anything loads: refuses the options the tensor-parallel loader would refuse on
    each rank once the model is being loaded."""
    refused = [("--compile", args.compile, ""),
               (f"--quantize {args.quantize}", args.quantize != "none", "quantized weights run on one device"),
               (f"--device-map {args.device_map}", args.device_map is not None,
                "each process holds its share of every layer, on cuda:LOCAL_RANK or the cpu")]
    for flag, given, why in refused:
        if given:
            raise TensorParallelOptionError(f"{flag} and tensor parallelism (torchrun) exclude each other: "
                                            f"{why + '; ' if why else ''}leave out {flag.split()[0]}")
    if args.device not in ("auto", "cuda", "cpu"):
        raise TensorParallelOptionError(f"--device {args.device} under torchrun: each process uses cuda:LOCAL_RANK "
                                        "or the cpu; pass --device auto, cuda or cpu")


def check_world_size(plan, world_size: int) -> None:
    """Refuses a torchrun process count that does not divide the model's key/value heads and FFN width (read from
    its config, before anything loads)."""
    from ..distributed.parallel import check_world_size as check

    try:
        check(plan.args, world_size)
    except LlamaError as exc:
        raise TensorParallelOptionError(f"{plan.name}: {exc}") from exc


def check_max_memory(text: str) -> None:
    """--max-memory's syntax (imports torch with llama_core.distributed)."""
    from ..distributed.device_map import parse_max_memory

    try:
        parse_max_memory(text)
    except LlamaError as exc:
        raise OptionError(f"--max-memory {text}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
