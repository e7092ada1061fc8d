"""The app's prompts as plain files: the default system prompt, the system prompts offered beside it, and
the chat and completion examples.

A prompts directory holds (see llama_core/prompts/README.md):
  system_prompt.txt        the default system prompt, the whole file (surrounding whitespace stripped)
  system_prompts.txt       other system prompts to choose from, each under a "## Name" line (optional)
  chat_examples.txt        example chat messages, one per block
  completion_examples.txt  example completion prompts, one per block

Blocks are separated by one or more blank lines; a block may span several lines. Lines starting
with '#' are comments and are ignored (in system_prompts.txt, those before the first "## " line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .dialog import SPECIAL_TAGS
from .errors import LlamaError
from .resources import DEFAULT_PROMPTS_DIR

SYSTEM_PROMPT_FILE = "system_prompt.txt"
SYSTEM_PROMPTS_FILE = "system_prompts.txt"
DEFAULT_NAME = "Default"  # the default system prompt's name among the others
CHAT_EXAMPLES_FILE = "chat_examples.txt"
COMPLETION_EXAMPLES_FILE = "completion_examples.txt"

_BLANK_LINES = re.compile(r"\n[ \t]*\n")


class PromptFileError(LlamaError, ValueError):
    """A prompts file is missing, unreadable or malformed; the message names the file."""


@dataclass(frozen=True)
class PromptLibrary:
    system_prompt: str  # default system prompt of the chat
    chat_examples: list[str]  # example user messages
    completion_examples: list[str]  # example completion prompts
    system_prompts: dict[str, str] = field(default_factory=dict)  # name -> text: the default first, as "Default"


def load_prompts(directory: str | Path = DEFAULT_PROMPTS_DIR) -> PromptLibrary:
    """Reads the prompts directory.

    Raises:
        PromptFileError: a file is missing or not UTF-8, the system prompt is empty, or a prompt holds a
            reserved chat tag ([INST], <<SYS>>, ...), which the chat would refuse.
    """
    directory = Path(directory)
    system_prompt = _read(directory / SYSTEM_PROMPT_FILE).strip()
    if not system_prompt:
        raise PromptFileError(f"{directory / SYSTEM_PROMPT_FILE} is empty: it must hold the default system prompt")
    _check_tags(directory / SYSTEM_PROMPT_FILE, [system_prompt])
    others = directory / SYSTEM_PROMPTS_FILE
    named = parse_named(_read(others), others) if others.exists() else {}
    _check_tags(others, list(named.values()))
    return PromptLibrary(
        system_prompt=system_prompt,
        chat_examples=_read_blocks(directory / CHAT_EXAMPLES_FILE),
        completion_examples=_read_blocks(directory / COMPLETION_EXAMPLES_FILE),
        system_prompts={DEFAULT_NAME: system_prompt, **named},
    )


def parse_named(text: str, path: Path) -> dict[str, str]:
    """The prompts of a file of "## Name" lines, each followed by its prompt (blank lines and all, surrounding
    whitespace stripped), by name in the file's order; '#' lines before the first name are comments."""
    found: list[tuple[str, list[str]]] = []  # (name, its lines)
    for line in text.replace("\r\n", "\n").split("\n"):
        if line.startswith("## ") or line.rstrip() == "##":
            name = line[2:].strip()
            if not name:
                raise PromptFileError(f"{path}: a \"## \" line names no system prompt")
            if name == DEFAULT_NAME or any(name == known for known, _ in found):
                raise PromptFileError(f"{path}: the name {name!r} is given twice (\"{DEFAULT_NAME}\" is "
                                      f"{SYSTEM_PROMPT_FILE}'s)")
            found.append((name, []))
        elif found:
            found[-1][1].append(line)
        elif line.strip() and not line.startswith("#"):
            raise PromptFileError(f"{path}: each system prompt comes after a \"## Name\" line; the text "
                                  f"{line.strip()[:40]!r} comes before any")
    named = {name: "\n".join(lines).strip() for name, lines in found}
    for name, prompt in named.items():
        if not prompt:
            raise PromptFileError(f"{path}: the system prompt {name!r} is empty")
    return named


def parse_blocks(text: str) -> list[str]:
    """Splits text into blank-line separated blocks, dropping '#' comment lines and empty blocks."""
    lines = [line for line in text.replace("\r\n", "\n").split("\n") if not line.startswith("#")]
    blocks = _BLANK_LINES.split("\n".join(lines))
    return [block.strip() for block in blocks if block.strip()]


def _read_blocks(path: Path) -> list[str]:
    blocks = parse_blocks(_read(path))
    _check_tags(path, blocks)
    return blocks


def _check_tags(path: Path, prompts: list[str]) -> None:
    for number, prompt in enumerate(prompts, start=1):
        tags = [tag for tag in SPECIAL_TAGS if tag in prompt]
        if tags:
            raise PromptFileError(f"{path}: prompt {number} holds the reserved chat tag {tags[0]}; remove it")


def _read(path: Path) -> str:
    if not path.is_file():
        raise PromptFileError(f"prompts file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"prompts file {path} is not valid UTF-8: {exc}") from exc
    except OSError as exc:
        raise PromptFileError(f"cannot read prompts file {path}: {exc}") from exc
