"""A checkpoint's generation_config.json (Hugging Face's; `llama-export` writes one): the sampling its makers
chose and its end-of-sequence tokens, read where the file is present.

    {"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2, ...}

`do_sample: false` means greedy (temperature 0). A file that cannot be read or is not a JSON object, and a
field that cannot be used, are left out with a warning naming the file: the model loads as without them. No
torch here, so a command line reads it while checking its options.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

FILE_NAME = "generation_config.json"
MAX_TEMPERATURE = 100.0  # the most a request may ask (llama_core.serving.requests; the model side imports no serving)


@dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint's generation_config.json says; None (or no ids) where it says nothing usable."""

    temperature: Optional[float] = None  # 0.0 where do_sample is false: greedy
    top_p: Optional[float] = None
    eos_token_ids: tuple[int, ...] = ()  # eos_token_id, one or several

    def sampling(self) -> dict[str, float]:
        """The sampling it states, as SamplingParams' keywords: temperature and top_p where given."""
        return {name: value for name, value in (("temperature", self.temperature), ("top_p", self.top_p))
                if value is not None}


def read_generation_config(ckpt_dir: Optional[str | Path]) -> GenerationConfig:
    """The generation_config.json in ckpt_dir; an empty GenerationConfig where there is none (or no folder).
    Never raises for the file's content: what cannot be used is warned about (UserWarning) and left out."""
    if ckpt_dir is None or not (Path(ckpt_dir) / FILE_NAME).is_file():
        return GenerationConfig()
    path = Path(ckpt_dir) / FILE_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _warn(f"{path} cannot be read as JSON ({exc}): it is ignored")
        return GenerationConfig()
    if not isinstance(config, dict):
        _warn(f"{path} holds a {type(config).__name__}, not a JSON object: it is ignored")
        return GenerationConfig()
    temperature = _number(config, "temperature", MAX_TEMPERATURE, path)
    top_p = _number(config, "top_p", 1.0, path)
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        _warn(f"{path}: do_sample {do_sample!r} is not true or false: it is ignored")
    elif do_sample is False:
        temperature = 0.0
    return GenerationConfig(temperature, top_p, _token_ids(config.get("eos_token_id"), path))


def _number(config: dict[str, Any], name: str, most: float, path: Path) -> Optional[float]:
    """config[name] where it is a finite number from 0 to most; None where absent (or null), or unusable (warned)."""
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= most:
        return float(value)
    _warn(f"{path}: {name} {value!r} is not a number from 0 to {most:g}: it is ignored")
    return None


def _token_ids(value: Any, path: Path) -> tuple[int, ...]:
    """eos_token_id as a tuple of ids: one id, a list of them, or none."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return tuple(dict.fromkeys(ids))
    _warn(f"{path}: eos_token_id {value!r} is not a token id or a list of them: it is ignored")
    return ()


_warned: set[str] = set()


def _warn(message: str) -> None:
    """Warns once a process: llama-generate reads the file while checking its options, then again loading."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
