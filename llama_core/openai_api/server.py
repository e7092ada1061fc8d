"""Serving an ASGI app (the API, with the web page mounted in it) with uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one), bound before anything slow starts, so a port
    in use is reported at once.

    Raises:
        OSError: the address is in use or cannot be bound here; its message says which.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once after a previous run
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving `app` on a bound socket in a daemon thread; `stop()` ends it."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "warning") -> None:
        self.sock = sock
        self.config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, ws="none")
        self.server = uvicorn.Server(self.config)
        self.thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.sock.getsockname()[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        """Starts serving; returns once the server answers (or raises RuntimeError after timeout seconds)."""
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="web-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the web server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def wait(self) -> None:
        """Blocks until the server stops (Ctrl-C stops it)."""
        try:
            while self.thread is not None and self.thread.is_alive():
                self.thread.join(0.5)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.sock.close()
