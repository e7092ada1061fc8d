"""Whether the app can listen where it was asked to, checked before the model loads: --host names an
address of this machine, and --port is free there (or, for --port 0, which free port to take)."""

from __future__ import annotations

import argparse
import errno
import re
import socket
from typing import Optional

from ..cli_options import ResourceError

HOST_FIX = "use 127.0.0.1 (this machine only) or 0.0.0.0 (every network it is on)"


def port_number(text: str) -> int:
    """argparse type for --port: 0 (any free port) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, or 0 for any free port; got {text!r}")
    return int(text)


def root_path(text: str) -> str:
    """argparse type for --root-path: the sub-path a reverse proxy serves the app at ("/llama"), or the whole
    public URL of it ("https://example.org/llama"); without its last "/"."""
    if not (text.startswith("/") or re.match(r"https?://[^/\s]+(/|$)", text)) or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be a path starting with / (e.g. /llama) or a URL starting with "
                                         f"http:// or https://; got {text!r}")
    return text.rstrip("/")


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: any free one), for the web server to take over once the model
    has loaded: bound first, so that a taken port is reported before anything slow starts, and nobody can
    take it in the meantime (connections wait in its backlog until the server runs).

    Raises:
        ResourceError: host is not an address of this machine, or the port is taken or needs privileges.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ResourceError(f"--host {host}: no such address ({exc}); {HOST_FIX}") from exc
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a socket
    # made so; without it a response's second write waits for the client's delayed ACK, 40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by a closed server is free
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise _bind_error(host, port, exc) from exc
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> ResourceError:
    if exc.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        by = f" by {holder}" if holder else ""
        return ResourceError(f"--port {port}: the port is already in use on {host}{by}; stop that program, pick "
                           "another port, or pass --port 0 to take any free one")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ResourceError(f"--host {host}: not an address of this machine, so the app cannot listen there; {HOST_FIX}")
    if exc.errno == errno.EACCES:
        return ResourceError(f"--port {port}: listening on a port below 1024 needs administrator rights; pick a port "
                           "from 1024 up (the default is 7860), or --port 0 for any free one")
    return ResourceError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); {HOST_FIX}, and a free port")


def port_holder(port: int) -> Optional[str]:
    """'process 1234 (python app.py ...)' listening on port, where this user may see it; else None.

    Uses psutil (installed with the app) rather than reading /proc by hand, so that it also works
    on macOS and Windows where the system lets it.
    """
    try:
        import psutil
    except ImportError:
        return None
    try:
        pids = {c.pid for c in psutil.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
        if not pids:
            return None
        pid = min(pids)
        command = " ".join(without_secrets(psutil.Process(pid).cmdline())) or psutil.Process(pid).name()
    except (psutil.Error, OSError):  # another user's process, or a system that needs privileges to ask
        return None
    return f"process {pid} ({command[:80]})"


SECRET_FLAGS = ("--api-key", "--auth")


def without_secrets(args: list[str]) -> list[str]:
    """A command line with the values of SECRET_FLAGS (any spelling argparse takes: `--api-key KEY`,
    `--api-key=KEY`, shortened `--api KEY`) shown as ***, for a message that names another process."""
    shown: list[str] = []
    value_next = False
    for arg in args:
        name, equals, _ = arg.partition("=")
        secret = name.startswith("--") and len(name) > 2 and any(flag.startswith(name) for flag in SECRET_FLAGS)
        if value_next:
            shown.append("***")
        elif secret and equals:
            shown.append(f"{name}=***")
        else:
            shown.append(arg)
        value_next = secret and not equals and not value_next
    return shown
