"""`llama-generate`: one completion, or one chat reply, streamed to stdout as the model writes it.

    llama-generate "ROMEO:" --max-new-tokens 64
    echo "Who goes there?" | llama-generate --chat --system "You are Juliet."
    llama-generate --ckpt-dir ~/llama/llama-2-7b-chat --chat "What is a KV cache?" --temperature 0
    llama-generate --chat "Name a play and its year." --json-schema '{"type": "object", "properties": ...}'

The prompt is the argument, or stdin read whole when there is none (or it is -). Only the generated text
goes to stdout; the model's summary, the loading bar and the closing figures go to stderr (none with
--quiet). Arguments are checked before the model loads, as `llama-chat` checks them: a bad one prints a
line naming the flag and the fix. The exit status is 0 when the text is written, 2 for a usage error (a bad
option or value, as argparse's own), 1 for a failure at run time (a checkpoint or file missing or unreadable,
bad weights, too little memory, a prompt the model cannot take), 130 on Ctrl-C. It runs one process:
under torchrun with more than one it refuses (status 2; rank 0 says so), since each would generate alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from typing import Iterator, Optional, TextIO

from .cli_options import (EXIT_FAILURE, EXIT_STATUS_EPILOG, EXIT_USAGE, ArgumentParser, ModelPlan, OptionError,
                          ResourceError, add_model_options, after_rank_0, check_memory, check_model_options,
                          exit_status, plain_warnings, positive_int)
from .dialog import SPECIAL_TAGS, Dialog, has_special_tags
from .errors import InvalidRequestError, LlamaError
from .generation_config import GenerationConfig, read_generation_config
from .grammar import Grammar
from .serving import requests  # the request checks: no torch
from .serving.requests import SamplingParams


def build_parser() -> ArgumentParser:
    """llama-generate's arguments: the prompt, the sampling controls and the model options."""
    p = ArgumentParser(prog="llama-generate", description="Complete a text, or answer one chat message, with a "
                       "Llama-2 model; the text streams to stdout.", epilog=EXIT_STATUS_EPILOG)
    p.add_argument("prompt", nargs="?", help="the text to continue, or with --chat the user's message "
                   "(default: stdin, read whole; - also reads stdin)")
    p.add_argument("--chat", action="store_true", help="answer the prompt as a chat message, in Llama-2's "
                   "chat format")
    p.add_argument("--system", help="with --chat: the system prompt (default: none)")
    p.add_argument("--echo", action="store_true", help="print the prompt before its completion (not with --chat)")
    p.add_argument("-q", "--quiet", action="store_true", help="only the generated text: nothing on stderr but errors")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, help="0 is greedy (default: the checkpoint's "
                          "generation_config.json, else 0.6)")
    sampling.add_argument("--top-p", type=float, help="keep the most likely tokens holding this much probability "
                          "(default: the checkpoint's generation_config.json, else 0.9)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 is off")
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this share of the "
                          "most likely one; 0 is off")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1 discourages tokens already "
                          "in the prompt or text; 1 is off")
    sampling.add_argument("--max-new-tokens", type=positive_int, help="most tokens to generate (default: 256, "
                          "or less where the context is shorter)")
    sampling.add_argument("--stop", action="append", help="end the text before this string; up to 4 times")
    sampling.add_argument("--seed", type=int, help="the same seed and settings give the same text (default: random)")
    output = p.add_argument_group("reply format (at most one)").add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="the text is a JSON object")
    output.add_argument("--json-schema", metavar="SCHEMA", help="the text is JSON following this JSON Schema: its "
                        "text, or a file holding it")
    output.add_argument("--regex", metavar="PATTERN", help="the text matches this regular expression, whole")
    output.add_argument("--grammar", metavar="FILE", help="the text follows this Lark grammar (its rule start)")
    model = p.add_argument_group("model")
    add_model_options(model)
    model.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's own choice)")
    return p


def main(argv: Optional[list[str]] = None, stdin: Optional[TextIO] = None, stdout: Optional[TextIO] = None) -> int:
    """Generates once. Returns the exit status: 0; 2 for a usage error (a bad option or value); 1 for a failure
    at run time (what the options name, loading, the prompt, generating or writing the text); 130 on Ctrl-C."""
    plain_warnings()
    try:
        return _run(argv, stdin, stdout)
    except KeyboardInterrupt:  # Ctrl-C before generating (torch importing, the model loading): no traceback
        print(file=sys.stderr)
        return 130


def _run(argv: Optional[list[str]], stdin: Optional[TextIO], stdout: Optional[TextIO]) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad argument (2), already printed
        return stop.code
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1:  # under torchrun each process would generate a copy of its own
        if os.environ.get("RANK", "0") == "0":  # every rank refuses; one says so
            print(f"error: llama-generate runs in one process, not under torchrun (WORLD_SIZE={world_size}: each "
                  "process would generate its own text); for tensor parallelism serve the model with `torchrun "
                  "--nproc_per_node N app.py`, or in Python use Llama.build(..., tensor_parallel=True)",
                  file=sys.stderr)
        after_rank_0()
        return EXIT_USAGE
    with only_errors(args.quiet):
        return _checked_run(args, stdin, stdout)


@contextlib.contextmanager
def only_errors(quiet: bool) -> Iterator[None]:
    """With quiet, no warnings (a checkpoint's generation_config.json that cannot be used, say) and no lines logged
    below ERROR by llama_core (the CPU kernels' build) while it lasts: only errors reach stderr."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("llama_core")
    level = logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def _checked_run(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    try:
        if args.system is not None and not args.chat:
            raise OptionError("--system goes with --chat: add --chat, or leave out --system")
        if args.echo and args.chat:
            raise OptionError("--echo shows a completion's prompt: leave it out with --chat")
        params = check_sampling_options(args)
        request = check_request(read_prompt(args.prompt, stdin), args.chat, args.system)
        plan = check_model_options(args)  # the device last: it imports torch
        params = checkpoint_sampling(params, args, read_generation_config(plan.ckpt_dir))
        check_memory(plan, 1)
        max_new_tokens = check_max_new_tokens(args.max_new_tokens, plan.max_seq_len)
    except LlamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)
    status = None if args.quiet else sys.stderr
    if status is not None:
        for line in [plan.summary(), *(f"warning: {w}" for w in plan.warnings)]:
            print(line, file=status, flush=True)
    return generate(plan, args, params, max_new_tokens, request, stdout, status)


def check_sampling_options(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as one SamplingParams, each judged by llama_core's own checks; SamplingParams' own
    defaults for --temperature and --top-p where not given (see checkpoint_sampling)."""
    given = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                 repetition_penalty=args.repetition_penalty, stop=args.stop, seed=args.seed)
    given = {name: value for name, value in given.items() if name not in ("temperature", "top_p") or value is not None}
    for name, value in given.items():
        try:
            SamplingParams(**{name: value})
        except LlamaError as exc:
            raise OptionError(f"--{name.replace('_', '-')}: {exc}") from exc
    return SamplingParams(**given, grammar=check_output_options(args))


def checkpoint_sampling(params: SamplingParams, args: argparse.Namespace, config: GenerationConfig) -> SamplingParams:
    """params with the checkpoint's generation_config.json temperature and top_p (greedy where its do_sample is
    false) for those of --temperature and --top-p not given."""
    stated = {name: value for name, value in config.sampling().items() if getattr(args, name) is None}
    return dataclasses.replace(params, **stated) if stated else params


def check_output_options(args: argparse.Namespace) -> Optional[Grammar]:
    """The grammar --json, --json-schema, --regex or --grammar holds the text to, or None."""
    try:
        if args.json:
            return Grammar.json()
        if args.json_schema is not None:
            text = args.json_schema
            if not text.lstrip().startswith("{"):
                if not os.path.exists(text):
                    raise ResourceError(f"--json-schema: {text!r} is neither a JSON Schema (an object, in braces) "
                                        "nor a file")
                return _from_file(Grammar.json_text, _read(text, "--json-schema"), "--json-schema")
            return Grammar.json_text(text, name="--json-schema")
        if args.regex is not None:
            return Grammar.regex(args.regex, name="--regex")
        if args.grammar is not None:
            return _from_file(Grammar.lark, _read(args.grammar, "--grammar"), "--grammar")
    except OptionError:
        raise
    except LlamaError as exc:
        raise OptionError(str(exc)) from exc
    return None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ResourceError(f"{flag}: cannot read {path!r}: {exc}") from None


def _from_file(build, text: str, flag: str) -> Grammar:
    """build(text, name=flag), where text is a file's: a file that does not hold a grammar is a failure at run
    time (status 1), as a checkpoint that does not load is, not a usage error."""
    try:
        return build(text, name=flag)
    except LlamaError as exc:
        raise ResourceError(str(exc)) from exc


def check_max_new_tokens(max_new_tokens: Optional[int], max_seq_len: int) -> Optional[int]:
    """--max-new-tokens, which must leave room for a prompt in the context (None: the default)."""
    if max_new_tokens is not None and max_new_tokens >= max_seq_len:
        raise OptionError(f"--max-new-tokens {max_new_tokens} does not fit the {max_seq_len:,}-token context with a "
                          f"prompt: pass at most {max_seq_len - 1}, or a larger --max-seq-len")
    return max_new_tokens


def read_prompt(prompt: Optional[str], stdin: TextIO) -> str:
    """The prompt argument, or stdin read whole for none or '-'."""
    if prompt is not None and prompt != "-":
        return prompt
    if stdin.isatty():
        raise OptionError("no prompt: give it as an argument (llama-generate \"ROMEO:\"), or pipe it in "
                          "(echo \"ROMEO:\" | llama-generate)")
    try:
        text = stdin.read()
        text.encode("utf-8")  # undecodable bytes read as lone surrogates where the locale escapes them
    except UnicodeError:
        raise InvalidRequestError("the prompt on stdin is not UTF-8 text") from None
    return text


def check_request(prompt: str, chat: bool, system: Optional[str]) -> str | Dialog:
    """The prompt (completion) or dialog (chat) to run, checked as the app checks its requests.

    Raises:
        InvalidRequestError: an empty prompt, or a chat message or system prompt holding the reserved tags.
    """
    if not chat:
        return requests.completion_prompt(prompt)
    dialog = requests.chat_dialog(prompt.strip(), [], system or "")
    if has_special_tags(dialog):
        raise InvalidRequestError(f"the chat refuses a message or system prompt holding its reserved tags "
                          f"({', '.join(SPECIAL_TAGS)}): take them out")
    return dialog


def generate(plan: ModelPlan, args: argparse.Namespace, params: SamplingParams, max_new_tokens: Optional[int],
             request: str | Dialog, stdout: TextIO, status: Optional[TextIO]) -> int:
    """Loads the model and streams the text to stdout, the loading bar and closing figures to status (None:
    silent). Returns the exit status."""
    import torch

    from .loader import load
    from .serving.engine import Engine
    from .serving.streams import stream_chat, stream_completion

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = None
    try:
        engine = Engine(load(plan.ckpt_dir, plan.tokenizer_path, plan.max_seq_len, 1, args.device, args.dtype,
                             progress=status is not None, quantize=plan.quantize,
                             kv_cache_dtype=plan.kv_cache_dtype, fixes_as="flags"), prompt_lookup=args.prompt_lookup)
        # The engine's loop is not started: reading the stream runs its steps in this thread.
        if args.chat:
            stream = stream_chat(engine, request, max_new_tokens=max_new_tokens, params=params)
        else:
            stream = stream_completion(engine, request, max_new_tokens=max_new_tokens, params=params)
        text = request if args.echo else ""
        _emit(stdout, text)
        try:
            for chunk in stream:
                _emit(stdout, chunk.text)
                text += chunk.text
        finally:
            stream.cancel()  # after the end, nothing; after Ctrl-C or a closed pipe, the engine stops the request
        _emit(stdout, "" if text.endswith("\n") else "\n")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Unwritable as exc:  # the reader left (| head): quietly; a full disk, say: saying so
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail
        if not isinstance(exc.__cause__, BrokenPipeError):
            print(f"error: cannot write the text to standard output: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except LlamaError as exc:  # weights that fail to load, a prompt too long for the context, the engine failing
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (MemoryError, torch.cuda.OutOfMemoryError) as exc:  # the CPU's, or the GPU's: one line, no traceback
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"error: out of memory on {plan.device}: {reason}; lower --max-seq-len, or add --quantize int8",
              file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if engine is not None:
            engine.close()
    if status is not None:
        reason = stream.finish_reason
        if reason == "length" and stream.prompt_tokens + stream.generated_tokens >= stream.max_seq_len:
            reason += f": the context's {stream.max_seq_len} tokens are full (--max-seq-len)"
        print(f"[{stream.generated_tokens} tokens, {stream.tokens_per_second:.1f} tokens/s, finish reason: "
              f"{reason}]", file=status)
    return 0


class _Unwritable(Exception):
    """Standard output cannot be written (its reader left, a full disk): the text's own failure, told apart from
    an OSError of the model's loading."""


def _emit(stdout: TextIO, text: str) -> None:
    try:
        stdout.write(text)
        stdout.flush()
    except OSError as exc:
        raise _Unwritable(exc.strerror or str(exc)) from exc


if __name__ == "__main__":
    sys.exit(main())
