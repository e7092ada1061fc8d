"""A Gradio app with the app's /complete route and no model: each call streams canned text, its first piece at
once, the rest after the time the app takes per token. It is mounted and queued as the app mounts its own
page (llama_core.app.server.mount_page), so `scripts/bench_serving.py --gradio-floor` serving it in place of
the app measures what Gradio itself costs a request: its queue, its two requests, its event stream.

    python scripts/gradio_floor_app.py --port 7861
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import AsyncIterator, Optional

import gradio as gr
from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core.app.address import listen_socket  # noqa: E402
from llama_core.app.server import mount_page  # noqa: E402
from llama_core.app.web_server import BackgroundServer  # noqa: E402

SECONDS_PER_TOKEN = 0.0015  # the app's step with 8 requests on the embedded model, one thread (docs/benchmarks.md)


def build_demo() -> gr.Blocks:
    async def complete(prompt: str, temperature: float, top_p: float, max_new_tokens: int, echo: bool,
                       show_probabilities: bool, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0, stop: Optional[list[str]] = None,
                       seed: Optional[int] = None, output_format: str = "text",
                       output_grammar: str = "") -> AsyncIterator[tuple[str, list[dict], dict]]:
        yield "x", [], {"generated_tokens": 1}
        await asyncio.sleep(SECONDS_PER_TOKEN * (max_new_tokens - 1))
        yield "x" * max_new_tokens, [], {"generated_tokens": max_new_tokens}

    with gr.Blocks() as demo:
        gr.api(complete, api_name="complete", concurrency_limit=None)
    return demo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=7861)
    a = p.parse_args()
    api = FastAPI()
    page = mount_page(api, build_demo())
    server = BackgroundServer(api, listen_socket("127.0.0.1", a.port), before_stop=(page.stop_event.set,)).start()
    print(f"Running on local URL: {server.url}", flush=True)
    server.wait()
    server.stop()


if __name__ == "__main__":
    main()
