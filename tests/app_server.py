"""Runs the app's interface (llama_core.app.ui) in-process on a free port for the app and browser tests.

The model is the embedded default (llama_core/models/tiny-shakespeare) when it exists, else ../shared's stories260K;
tests skip when neither is there.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from llama_core import DEFAULT_CKPT_DIR, load  # noqa: E402
from llama_core.app import server, streaming, ui  # noqa: E402
from llama_core.app.address import listen_socket  # noqa: E402
from llama_core.checkpoint_files import read_model_args  # noqa: E402
from llama_core.openai_api.metrics import MeteredEngine  # noqa: E402
from llama_core.prompt_library import load_prompts  # noqa: E402
from llama_core.serving import Engine  # noqa: E402
from llama_core.serving.engine_process import EngineProcess  # noqa: E402

STORIES_DIR = REPO_ROOT.parent / "shared" / "models" / "stories260K"
MAX_SEQ_LEN = 256  # short contexts keep the tests fast on CPU
DRAFT_PRICE = 0.1  # fixed: how far each step drafts does not follow the machine's timings


def model_dir() -> Optional[Path]:
    """None for the embedded default model, else the fallback checkpoint; skips if there is neither."""
    if (DEFAULT_CKPT_DIR / "params.json").is_file() or (DEFAULT_CKPT_DIR / "config.json").is_file():
        return None
    if (STORIES_DIR / "params.json").is_file():
        return STORIES_DIR
    pytest.skip(f"no model: neither the embedded default {DEFAULT_CKPT_DIR} nor {STORIES_DIR} exists")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_build(max_seq_len: int = MAX_SEQ_LEN, max_batch_size: int = 8) -> dict:
    """`load`'s options for the test model on the CPU, its context at most max_seq_len."""
    ckpt_dir = model_dir()
    trained_for = read_model_args(ckpt_dir or DEFAULT_CKPT_DIR).max_seq_len or max_seq_len
    return dict(ckpt_dir=ckpt_dir, max_seq_len=min(max_seq_len, trained_for), max_batch_size=max_batch_size,
                device="cpu", dtype="float32")


@contextlib.contextmanager
def serve_app(max_seq_len: int = MAX_SEQ_LEN, max_batch_size: int = 8, engine_process: bool = True,
              api_keys: tuple[str, ...] = (), auth: Optional[list[tuple[str, str]]] = None, port: int = 0,
              ) -> Iterator[tuple[Engine | EngineProcess, str]]:
    """Yields (engine, local URL) of the app serving the test model (its context at most max_seq_len): the page,
    its Gradio API and the OpenAI-compatible API; closes both afterwards. The engine runs in a process of its
    own, as `llama-chat` runs it, unless engine_process is False (`--single-process`). port 0: a free one."""
    build = engine_build(max_seq_len, max_batch_size)
    engine = (EngineProcess(dict(build, seed=0), threads=1, draft_price=DRAFT_PRICE) if engine_process
              else Engine(load(**build), seed=0, draft_price=DRAFT_PRICE)).start()
    try:
        served = MeteredEngine(engine)  # as llama-chat serves it: the page's replies and the API's in /metrics
        demo = ui.build_demo(served, load_prompts())
        running = server.launch(demo, served, listen_socket("127.0.0.1", port), api_keys=api_keys, auth=auth)
        try:
            yield engine, running.local_url
        finally:
            running.stop()
    finally:
        engine.shutdown()


def clients_sent(monkeypatch) -> list[Optional[str]]:
    """The `client` of each chat and completion the app's interface starts from now on, in order."""
    sent = []
    for name in ("stream_chat", "stream_completion"):
        real = getattr(streaming, name)
        monkeypatch.setattr(streaming, name, lambda *args, _real=real, **kwargs: sent.append(kwargs["client"]) or
                            _real(*args, **kwargs))
    return sent
