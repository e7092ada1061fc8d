"""Runs the web app from a checkout: the same as the installed `llama-chat` command.

    python app.py                                          # the embedded default model
    python app.py --ckpt-dir ../shared/models/stories260K --port 7861
    python app.py --help
"""

import sys

from llama_core.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
