"""Serving an ASGI app (the API, with the web page mounted in it) with uvicorn in a background thread, on a
socket bound beforehand (llama_core.app.address.listen_socket)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

import uvicorn


class BackgroundServer:
    """uvicorn serving `app` on a listening socket in a daemon thread; `stop()` ends it and closes the socket.

    before_stop: functions run in the server's event loop when it is asked to stop, e.g. to end streams
    that would otherwise hold it open (Gradio's heartbeats end when its app's stop_event is set)."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "warning",
                 before_stop: tuple[Callable[[], None], ...] = (), access_log: bool = False) -> None:
        """access_log: a line per request on standard output (client, method, path, status), as uvicorn writes
        them; other server messages stay at log_level."""
        self.sock = sock
        self.config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, ws="none",
                                     access_log=access_log)
        if access_log:
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self.server = uvicorn.Server(self.config)
        self.before_stop = list(before_stop)
        self.thread: Optional[threading.Thread] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        bound = self.sock.getsockname()[0]
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(bound, bound)  # a wildcard: this machine
        return f"http://[{host}]:{self.port}/" if ":" in host else f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        """Starts serving; returns once the server answers (or raises RuntimeError after timeout seconds)."""
        self.thread = threading.Thread(target=self._run, name="web-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the web server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:  # end the app's own background tasks (Gradio's queue) before the loop goes
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def wait(self) -> None:
        """Blocks until the server stops (Ctrl-C stops it)."""
        try:
            while self.thread is not None and self.thread.is_alive():
                self.thread.join(0.5)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            for function in self.before_stop:
                try:
                    self.loop.call_soon_threadsafe(function)
                except RuntimeError:  # the loop has just closed
                    pass
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.sock.close()
