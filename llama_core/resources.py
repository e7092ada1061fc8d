"""Where the files shipped inside the package lie: the embedded default model and the app's prompts.

They are package data (see pyproject.toml), so they sit beside the code both in a checkout and in an
installed package, and `Llama.build()` with no checkpoint works from any directory. Importing this module
costs nothing: no torch.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_CKPT_DIR = PACKAGE_DIR / "models" / "tiny-shakespeare"  # trained by scripts/train_tiny.py
DEFAULT_PROMPTS_DIR = PACKAGE_DIR / "prompts"
