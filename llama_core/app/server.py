"""Serving the app over HTTP: one FastAPI app holding the OpenAI-compatible API (/v1, /health, /metrics), with the
Gradio interface mounted at /, run by uvicorn on the socket the command line bound; and a share link."""

from __future__ import annotations

import inspect
import os
import secrets
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, get_type_hints

import gradio as gr
from gradio import networking
from starlette.requests import Request
from starlette.routing import Mount

from ..openai_api import create_api
from ..openai_api.cors import API_PATHS
from .body_limit import MAX_BODY_BYTES, PAGE_BODY_BYTES, SMALL_BODY_BYTES, BodyLimit
from .logins import LoginCheck
from .page_head import PageHead
from .ui import CSS, PAGE_HEAD, PAGE_JS, THEME
from .web_server import BackgroundServer

# Sessions whose state Gradio keeps (its default, 10,000, lets the web process grow by ~140 KB for each
# API call that brings no session of its own, 1.4 GB in all). The oldest are dropped beyond this; a page
# that comes back after that starts a fresh session (its conversations live in the browser).
SESSION_CAPACITY = 256

# Gradio rebuilds the traffic summary of its /monitoring page (a pandas table of up to 10,000 past events)
# after each event, by default after every one, in a worker thread that holds the interpreter lock: ~1 ms
# per event on a fresh server, ~7.5 ms once it keeps 10,000, time the web server's event loop waits. Every
# this many events instead (the environment's GRADIO_ANALYTICS_CACHE_FREQUENCY, if set, wins).
MONITORING_SUMMARY_EVERY = 1000
STOP_GRACE_SECONDS = 10.0  # what requests in flight get to end once the app is told to stop

# Events the Gradio queue holds waiting before it answers "queue full" (the engine bounds its own waiting
# requests; this bounds what piles up in front of it), and the largest upload it takes (an imported
# conversation is at most 2 MB).
QUEUE_SIZE = 256
MAX_UPLOAD_BYTES = 4 * 1024 * 1024


@dataclass
class RunningApp:
    """The app being served: its web server, where to reach it, and its share link if one was made."""

    server: BackgroundServer
    local_url: str
    share_url: Optional[str] = None

    def stop(self) -> None:
        self.server.stop()


def web_app(demo: gr.Blocks, engine: Any, api_keys: Sequence[str] = (), auth: Optional[list[tuple[str, str]]] = None,
            model_name: Optional[str] = None, root_path: Optional[str] = None) -> tuple[Any, Any]:
    """(the FastAPI app to serve, the mounted Gradio app): the API's routes on `engine` first, then the page
    at / behind `auth` (user, password) pairs when given; root_path: where a reverse proxy serves it (the
    page's own links), if not at /."""
    api = create_api(engine, model_name, api_keys)
    page = mount_page(api, demo, auth, root_path)
    api.add_middleware(PageHead, html=PAGE_HEAD)  # the page's head script before Gradio's (page_head.py)
    api.add_middleware(BodyLimit, limit_for=body_limit_for(page))
    return api, page


def body_limit_for(page: Any) -> Callable[[dict], int]:
    """The largest body each request may send (BodyLimit): MAX_BODY_BYTES to the API, PAGE_BODY_BYTES to the
    page's routes (its events carry the conversations), but SMALL_BODY_BYTES to the page's
    routes from a browser or client not logged in where the page asks for a login, and to Gradio's routes that
    take a few ids (/cancel, /reset). Gradio checks a login after it has read and parsed the body (and /cancel
    checks none): an 8 MiB body of nested lists sent there with no login held the event loop, every user's
    page and API, for seconds. The API's paths check their key before reading a body (openai_api.keys)."""
    few_ids = ("/gradio_api/cancel", "/gradio_api/reset")

    def limit_for(scope: dict) -> int:
        path = scope.get("path", "")
        if path.startswith(API_PATHS):
            return MAX_BODY_BYTES
        if path.rstrip("/") in few_ids:
            return SMALL_BODY_BYTES
        if page.auth is None:
            return PAGE_BODY_BYTES
        cookies = Request(scope).cookies  # the headers alone: nothing of the body is read
        token = cookies.get(f"access-token-{page.cookie_id}") or cookies.get(f"access-token-unsecure-{page.cookie_id}")
        return PAGE_BODY_BYTES if page.tokens.get(token) is not None else SMALL_BODY_BYTES

    return limit_for


def mount_page(api: Any, demo: gr.Blocks, auth: Optional[list[tuple[str, str]]] = None,
               root_path: Optional[str] = None) -> Any:
    """Mounts demo at / of the FastAPI app `api`, its queue set up as the app serves it (bounded sessions,
    miscounted values named, the monitoring summary rebuilt seldom, the login check on the event loop, logins
    slowed for guessing); returns the mounted Gradio app."""
    demo.state_session_capacity = SESSION_CAPACITY
    name_miscounted_values(demo)
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(MONITORING_SUMMARY_EVERY))  # read by queue()
    demo.queue(max_size=QUEUE_SIZE)
    logins = LoginCheck(auth).check if auth else None  # one wrong guess a second (logins.py)
    gr.mount_gradio_app(api, demo, path="/", auth=logins, theme=THEME, css=CSS, js=PAGE_JS,
                        max_file_size=MAX_UPLOAD_BYTES, root_path=root_path)
    # Gradio checks that a file a request names was uploaded to it only once the app "has launched", which
    # launch() marks and mounting does not: unmarked, the import button read any path on this machine.
    demo.has_launched = True
    page = next(route.app for route in api.routes if isinstance(route, Mount))
    check_logins_on_the_loop(page)
    return page


def check_logins_on_the_loop(page: Any) -> int:
    """Has the mounted Gradio app's login check, a plain function that its routes depend on, run on the event
    loop: FastAPI runs such a function in a worker thread, one thread hop per call of the API (/call/complete,
    its event stream, /queue/join), which with 8 clients streaming cost ~5 ms before a request reached the
    queue. The check only reads the request's cookies. Returns how many checks were moved (0 where Gradio
    has none of this kind)."""
    moved = {}
    for route in page.routes:
        for dependency in getattr(getattr(route, "dependant", None), "dependencies", ()):
            check = dependency.call
            if (getattr(check, "__name__", "") == "login_check" and not inspect.iscoroutinefunction(check)
                    and check not in moved):
                moved[check] = _on_the_loop(check)
    page.dependency_overrides.update(moved)
    return len(moved)


def _on_the_loop(check: Any) -> Any:
    async def on_the_loop(**kwargs: Any) -> Any:
        return check(**kwargs)

    on_the_loop.__signature__ = inspect.signature(check)  # FastAPI resolves the check's own dependencies
    return on_the_loop


def name_miscounted_values(demo: gr.Blocks) -> None:
    """Makes demo answer a call that sends fewer values than its route takes (raw HTTP: POST
    /gradio_api/call/chat with a short "data" list), or more to a public API route, with a message naming the
    route, its parameters in order and the count, in place of Gradio's, which speaks of JavaScript event
    handlers (and which lets extra values pass: its page may send them, a client of the API has miscounted)."""
    gradio_check = demo.validate_inputs  # called before each event's function, whichever door it came in by

    def validate_inputs(block_fn: Any, inputs: list[Any]) -> None:
        wanted = len(block_fn.inputs)
        if len(inputs) < wanted or (len(inputs) > wanted and block_fn.api_visibility == "public"):
            raise gr.Error(miscounted_values_message(block_fn, len(inputs)), print_exception=False)
        gradio_check(block_fn, inputs)

    demo.validate_inputs = validate_inputs


def miscounted_values_message(block_fn: Any, received: int) -> str:
    """'the /chat route takes 13 values (message, history, ...), got 2: send exactly these, in this order'."""
    wanted = len(block_fn.inputs)
    try:
        parameters = list(inspect.signature(block_fn.fn).parameters.values())
    except (TypeError, ValueError):  # no function, or one inspect cannot read
        parameters = []
    try:
        hints = get_type_hints(block_fn.fn)
    except Exception:  # noqa: BLE001 - hints that do not resolve: no parameter is left out for them
        hints = {}
    # Gradio gives a gr.Request parameter the request itself: it is no value of the route's
    parameters = [p for p in parameters if hints.get(p.name) not in (gr.Request, Optional[gr.Request])]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = len(parameters) == wanted and all(p.kind in positional for p in parameters)
    names = f" ({', '.join(p.name for p in parameters)})" if named else ""
    what = f"the /{block_fn.api_name} route" if block_fn.api_name else f"the event {block_fn.name}"
    return f"{what} takes {wanted} values{names}, got {received}: send exactly these, in this order"


def launch(demo: gr.Blocks, engine: Any, sock: Any, share: bool = False, api_keys: Sequence[str] = (),
           auth: Optional[list[tuple[str, str]]] = None, model_name: Optional[str] = None,
           access_log: bool = False, root_path: Optional[str] = None) -> RunningApp:
    """Starts serving the page and the API on the listening socket `sock` in background threads. With share,
    also asks Gradio for a public link; when that fails (no internet), prints one warning line and serves
    locally."""
    api, page = web_app(demo, engine, api_keys, auth, model_name, root_path)
    server = BackgroundServer(api, sock, before_stop=(page.stop_event.set,), access_log=access_log).start()
    running = RunningApp(server, server.url)
    if share:
        running.share_url = share_link(server.port)
        if running.share_url is None:
            warn_no_share_link(running.local_url)
    return running


def warn_no_share_link(local_url: str) -> None:
    print(f"warning: could not create a Gradio share link (no internet access?); serving locally at {local_url}",
          file=sys.stderr, flush=True)


def share_link(port: int) -> Optional[str]:
    """A public https link to the local port through Gradio's share servers, or None if none could be made."""
    try:
        url = networking.setup_tunnel(local_host="127.0.0.1", local_port=port, share_token=secrets.token_urlsafe(32),
                                      share_server_address=None, share_server_tls_certificate=None)
    except Exception:  # no internet, a blocked download of Gradio's tunnel client, a refused server...
        return None
    return "https://" + url.split("://", 1)[-1]


def serve(demo: gr.Blocks, engine: Any, sock: Any, share: bool = False, api_keys: Sequence[str] = (),
          auth: Optional[list[tuple[str, str]]] = None, model_name: Optional[str] = None,
          stop_grace: float = STOP_GRACE_SECONDS, access_log: bool = False, root_path: Optional[str] = None) -> None:
    """Serves until Ctrl-C or SIGTERM, printing where: the page, the API, and the public link when made. On
    stopping, new requests are refused, those in flight get up to stop_grace seconds to end, and those still
    running then end with an error their clients read (not a dropped connection)."""
    running = launch(demo, engine, sock, False, api_keys, auth, model_name, access_log, root_path)
    stopping = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        print(f"Running on local URL: {running.local_url}", flush=True)
        print(f"OpenAI-compatible API: {running.local_url}v1{' (API key required)' if api_keys else ''}", flush=True)
        asking = None  # serving already: Gradio's share server may take its 30 s to answer, or not answer, and
        if share:      # a stop meanwhile is not kept waiting
            print("Asking Gradio for a public share link (up to 30 s)...", flush=True)
            links: list[Optional[str]] = []
            asking = threading.Thread(target=lambda: links.append(share_link(running.server.port)), daemon=True)
            asking.start()
        while not stopping.wait(0.2) and running.server.thread.is_alive():
            if getattr(engine, "state", "running") == "failed":  # its process died, and restarting did not help
                raise EngineFailedError("the model process could not be kept running; see the errors above")
            if asking is not None and not asking.is_alive():
                asking, running.share_url = None, links[0] if links else None
                if running.share_url:
                    print(f"Running on public URL: {running.share_url}", flush=True)
                else:
                    warn_no_share_link(running.local_url)
    except KeyboardInterrupt:
        pass
    finally:
        print("Stopping.", flush=True)
        drain = getattr(engine, "drain", None)
        if drain is not None:
            drain(stop_grace)
        running.stop()


class EngineFailedError(RuntimeError):
    """The engine's process died more often in a row than it may be restarted: the app stops."""
