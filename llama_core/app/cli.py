"""`llama-chat` (and `python app.py` in a checkout): serve a Llama-2 model in the web app.

Order of work, so that a mistake is reported in a second rather than after the model has loaded:
parse the arguments (no torch or gradio imported: `--help` answers at once), check the address, the
checkpoint, the tokenizer, the context and the prompts (files only), then the device and dtype (imports
torch), and only then load the model, with a progress bar, and start the web server. A bad argument
prints one line naming the flag and the fix, and the exit status is 2.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from ..cli_options import ArgumentParser, OptionError, add_model_options, check_model_options, positive_int
from ..errors import LlamaError
from ..prompt_library import load_prompts
from .address import check_listen_address, port_number


def build_parser() -> ArgumentParser:
    """llama-chat's arguments: the model options, the engine's, and where to serve."""
    p = ArgumentParser(prog="llama-chat", description="Serve a Llama-2 model in a web app: chat, completion, "
                       "the model's facts, and a streaming API.")
    add_model_options(p)
    p.add_argument("--max-batch-size", type=positive_int, default=8,
                   help="most requests decoded together; more wait in a queue (default: 8)")
    p.add_argument("--device-map", choices=["auto", "balanced", "balanced_low_0", "sequential"],
                   help="spread whole layers over several GPUs with accelerate (CPU memory as a last resort) "
                   "instead of --device; for models larger than one GPU")
    p.add_argument("--max-memory", help="with --device-map: the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--compile", action="store_true", help="decode with static shapes under torch.compile (CUDA "
                   "graphs on GPU): faster steps after a slow first request while it compiles")
    p.add_argument("--threads", type=positive_int, help="CPU threads for torch (default on CPU: one fewer than "
                   "the cores, leaving one to the web server; elsewhere torch's own choice)")
    p.add_argument("--single-process", action="store_true", help="run the model in the web server's process "
                   "(default: a process of its own, so the web server's Python never holds up a decode step; "
                   "under torchrun the model always runs in rank 0's process)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=7860, help="port to listen on; 0 takes any free one "
                   "(default: 7860)")
    p.add_argument("--share", action="store_true", help="also ask Gradio for a public share link (needs internet; "
                   "without it the app still serves locally)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the app until Ctrl-C. Returns the exit status: 0, or 2 for a bad argument (before anything
    loads) or a model that does not fit its device."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad argument (2), already printed
        return stop.code
    try:
        port = check_listen_address(args.host, args.port)
        prompts = load_prompts()
        if args.max_memory is not None and args.device_map is None:
            raise OptionError("--max-memory goes with --device-map: add --device-map auto, or leave out --max-memory")
        plan = check_model_options(args, args.device_map)
        if args.max_memory is not None:
            check_max_memory(args.max_memory)
    except LlamaError as exc:  # OptionError, or a prompts file that cannot be used
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"{plan.summary()}, {args.max_batch_size} requests at a time", flush=True)
        for warning in plan.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)

    from ..serving.launch import open_engine

    try:
        engine = open_engine(plan.ckpt_dir, plan.tokenizer_path, plan.max_seq_len, args.max_batch_size, args.device,
                             args.dtype, args.device_map, args.max_memory, args.compile, args.threads,
                             args.single_process, progress=True)
    except LlamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"error: the model does not fit on {plan.device} with --max-seq-len {plan.max_seq_len} and "
              f"--max-batch-size {args.max_batch_size}: {reason}; lower them, or use a smaller --dtype", file=sys.stderr)
        return 2
    try:
        from . import server, ui

        demo = ui.build_demo(engine, prompts)
        try:
            server.serve(demo, args.host, port, args.share)
        except OSError:  # the port was free when checked, and taken while the model loaded
            print(f"error: --port {port}: another program took the port on {args.host} while the model loaded; "
                  "pass another --port, or --port 0 for any free one", file=sys.stderr)
            return 2
    finally:
        engine.shutdown()
    return 0


def check_max_memory(text: str) -> None:
    """--max-memory's syntax (imports torch with llama_core.distributed)."""
    from ..distributed.device_map import parse_max_memory

    try:
        parse_max_memory(text)
    except LlamaError as exc:
        raise OptionError(f"--max-memory {text}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
