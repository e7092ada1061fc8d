"""The socket the web server takes over (llama_core.app.address.listen_socket): its connections send small
writes at once, so a response's pieces never wait for the client's delayed ACK (40 ms on Linux)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from llama_core.app.address import listen_socket


def test_connections_of_the_listen_socket_have_nagle_off():
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport):
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one():
        server = await asyncio.get_running_loop().create_server(Record, sock=sock)  # as uvicorn serves it
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.read()  # until the server closes it
            writer.close()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0


def test_a_port_holders_command_line_is_named_without_its_secrets():
    from llama_core.app.address import without_secrets

    args = ["python", "app.py", "--api-key", "sk-one", "--auth=amy:pw", "--api-key=sk-two", "--auth", "bo:pw", "--port",
            "7860"]
    assert without_secrets(args) == ["python", "app.py", "--api-key", "***", "--auth=***", "--api-key=***", "--auth",
                                     "***", "--port", "7860"]
    # argparse takes a flag shortened (--au for --auth): its value was printed as typed
    assert without_secrets(["app.py", "--au", "bo:pw", "--api=sk-3", "--ap", "sk-4", "--port", "7860"]) == [
        "app.py", "--au", "***", "--api=***", "--ap", "***", "--port", "7860"]


def test_a_server_on_an_ipv6_address_gives_its_url_bracketed():
    import socket

    from llama_core.app.web_server import BackgroundServer

    if not socket.has_ipv6:
        pytest.skip("this machine has no IPv6")
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"::1 cannot be bound here: {exc}")
    with sock:
        server = BackgroundServer(None, sock)
        assert server.url == f"http://[::1]:{sock.getsockname()[1]}/"


@pytest.mark.parametrize("access_log", [False, True])
def test_the_access_log_prints_a_line_per_request_only_when_asked(capfd, access_log):
    import httpx
    from fastapi import FastAPI

    from llama_core.app.web_server import BackgroundServer

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    server = BackgroundServer(app, listen_socket("127.0.0.1", 0), access_log=access_log).start()
    try:
        assert httpx.get(server.url + "ping").status_code == 200
        assert httpx.get(server.url + "nowhere").status_code == 404
    finally:
        server.stop()
    printed = capfd.readouterr().out
    lines = [line for line in printed.splitlines() if '"GET /' in line]
    assert len(lines) == (2 if access_log else 0), printed
    if access_log:
        assert '"GET /ping HTTP/1.1" 200' in lines[0] and '"GET /nowhere HTTP/1.1" 404' in lines[1]
