"""`llama-chat` (and `python app.py` in a checkout): serve a Llama-2 model in the web app.

The arguments are parsed before anything heavy is imported: `--help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from ..resources import DEFAULT_CKPT_DIR, PACKAGE_DIR

DEFAULT_MAX_SEQ_LEN = 2048


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llama-chat",
                                description="Serve a Llama-2 model in a web app: chat, completion, and an API.")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint directory, Meta or Hugging Face layout "
                   f"(default: the embedded model, {DEFAULT_CKPT_DIR.relative_to(PACKAGE_DIR.parent)})")
    p.add_argument("--tokenizer", type=Path, help="SentencePiece tokenizer.model (default: in the checkpoint "
                   "directory, then its parent)")
    p.add_argument("--max-seq-len", type=_positive_int, help="context length in tokens, prompt and reply together "
                   f"(default: the model's own, at most {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--max-batch-size", type=_positive_int, default=8,
                   help="most requests decoded together; more wait in a queue (default: 8)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype; auto is bfloat16 on CUDA, float32 on CPU (default: auto)")
    p.add_argument("--device-map", choices=["auto", "balanced", "balanced_low_0", "sequential"],
                   help="spread whole layers over several GPUs with accelerate (CPU memory as a last resort) "
                   "instead of --device; for models larger than one GPU")
    p.add_argument("--max-memory", help="with --device-map: the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--compile", action="store_true", help="decode with static shapes under torch.compile (CUDA "
                   "graphs on GPU): faster steps after a slow first request while it compiles")
    p.add_argument("--threads", type=_positive_int, help="CPU threads for torch (default on CPU: one fewer than "
                   "the cores, leaving one to the web server; elsewhere torch's own choice)")
    p.add_argument("--single-process", action="store_true", help="run the model in the web server's process "
                   "(default: a process of its own, so the web server's Python never holds up a decode step; "
                   "under torchrun the model always runs in rank 0's process)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default: 7860)")
    p.add_argument("--share", action="store_true", help="also ask Gradio for a public share link (needs internet; "
                   "without it the app still serves locally)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the app until Ctrl-C; the exit status: 0, or 2 for a bad argument or a model that does not fit."""
    args = parse_args(argv)
    from ..errors import LlamaError
    from ..prompt_library import load_prompts
    from ..serving.launch import open_engine

    try:
        prompts = load_prompts()
        engine = open_engine(args.ckpt_dir, args.tokenizer, args.max_seq_len, args.max_batch_size, args.device,
                             args.dtype, args.device_map, args.max_memory, args.compile, args.threads,
                             args.single_process)
    except LlamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"device map {args.device_map!r}" if args.device_map else f"device {args.device!r}"
        print(f"error: the model does not fit on {where} with max_seq_len {args.max_seq_len or 'the default'} and "
              f"max_batch_size {args.max_batch_size}: {reason}", file=sys.stderr)
        return 2
    try:
        from . import server, ui

        demo = ui.build_demo(engine, prompts)
        try:
            server.serve(demo, args.host, args.port, args.share)
        except OSError as exc:
            print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 2
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
