"""Running the server: bind (loopback unless a key guards it), warm up, serve with uvicorn, drain on SIGTERM.

SIGTERM or Ctrl-C: uvicorn stops listening, lets the requests in flight (queued ones included) finish for up to
`drain_s` seconds, cancels what is left, then the app stops the worker; `serve` returns normally (the command
exits 0).
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from runtime.errors import NpumoeError
from runtime.serving.app import AnyEngine, create_app

DRAIN_S = 30.0
# How long an idle connection stays open. Longer than HTTP clients keep one in their pools (httpx, under the openai and
# anthropic SDKs: 5 s), so a client's pool drops it first: uvicorn's own 5 s closed connections the client had just
# reused (a request sent as the timer fired got a reset).
KEEP_ALIVE_S = 75.0


def served_model_id(model: str) -> str:
    """The id clients name the model by: a built-in name as it is, a directory by its own name (a request never
    names a file)."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to serve beyond this machine without a key."""
    if not is_loopback(host) and not api_key:
        raise NpumoeError(f"--host {host} is not a loopback address: give --api-key (or NPUMOE_API_KEY) so that "
                          "only clients with the key are served")


def listen(host: str, port: int) -> socket.socket:
    """The bound, listening socket (port 0: a free one; read it back with `.getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise NpumoeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM or SIGINT it drained on is not raised again afterwards: draining is
    the normal end of a server, not a failure."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(engine: AnyEngine, api_key: str | None = None, drain_s: float = DRAIN_S) -> uvicorn.Server:
    """The uvicorn server of `engine`'s app; `.run(sockets=[sock])` serves, `.should_exit = True` stops it."""
    config = uvicorn.Config(create_app(engine, api_key), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_s, timeout_keep_alive=KEEP_ALIVE_S, lifespan="on")
    return _DrainingServer(config)


def serve(engine: AnyEngine, sock: socket.socket, api_key: str | None = None, drain_s: float = DRAIN_S,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve `engine` (warmed up) on the listening `sock` until SIGTERM or SIGINT, then drain and close the
    engine. `on_ready` runs before the first request is taken."""
    if on_ready is not None:
        on_ready()
    server = make_server(engine, api_key, drain_s)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(drain_s)  # a no-op after the app's own shutdown; else (it did not start) the engine stops here
    if not server.started:
        raise NpumoeError("the server did not start (see the message above)")
