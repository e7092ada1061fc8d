"""Serving the app's interface over HTTP: in background threads (`launch`), or until Ctrl-C (`serve`)."""

from __future__ import annotations

import contextlib
import io
import sys
import time
from typing import TYPE_CHECKING, Optional

from .ui import CSS, THEME

if TYPE_CHECKING:
    import gradio as gr


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: Optional[int] = 7860, share: bool = False) -> None:
    """Starts serving demo in background threads; its URLs are then demo.local_url and demo.share_url.
    Prints nothing, but one warning line when a share link was asked for and Gradio can't make one (no
    internet): it then keeps serving locally.

    Raises:
        OSError: the address cannot be served on (a port taken since it was checked, say).
    """
    options = dict(server_name=host, server_port=port, prevent_thread_lock=True, theme=THEME, css=CSS, quiet=True)
    demo.queue()
    gradio_says = io.StringIO()
    try:
        with contextlib.redirect_stdout(gradio_says):  # Gradio prints its share link and, offline, advice
            demo.launch(share=share, **options)
    except Exception:
        if not share:
            raise
        if not demo.is_running:  # a share failure that Gradio raised before serving
            demo.launch(**options)
    if share and not demo.share_url:
        print(f"warning: could not create a Gradio share link (no internet access?); serving locally at "
              f"{demo.local_url}", file=sys.stderr)


def serve(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False) -> None:
    """Serves demo until Ctrl-C, printing where: the local URL, and the public one when asked for."""
    launch(demo, host, port, share)
    try:
        print(f"Running on local URL: {demo.local_url}", flush=True)
        if demo.share_url:
            print(f"Running on public URL: {demo.share_url}", flush=True)
        while demo.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("Stopping.", flush=True)
    finally:
        demo.close(verbose=False)
