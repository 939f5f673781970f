"""One server process: bind first (so a port in use is said at once), load or compile the engines
while /healthz answers, report ready, and on SIGTERM or Ctrl-C stop taking connections, answer
every request in flight, then exit with status 0."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable

from ..batch.worker import StageHook
from ..core.choices import LOG_LEVELS
from ..core.errors import KasokuError
from .config import ServeConfig, require_serve
from .service import ImageService

log = logging.getLogger("kasoku.serve")


class PortUnavailable(KasokuError, OSError):
    """--host/--port cannot be bound."""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything heavy; port 0 takes any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise PortUnavailable(f"cannot listen on {host}:{port} ({error.strerror or error}); choose another --port or "
                              "--host.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _graceful_server(config):
    """uvicorn's Server, except that a SIGTERM (or Ctrl-C) ends in exit status 0 once the requests in
    flight are answered: uvicorn itself re-raises the signal after its graceful shutdown, which
    would end the process with the signal's status instead."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer(config)


def run_server(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, reference=None,
               on_listening: Callable[[str], None] | None = None,
               on_ready: Callable[[ImageService], None] | None = None,
               on_failure: Callable[[str], None] | None = None,
               on_stage: StageHook | None = None, log_level: str = "info") -> int:
    """Serve until SIGTERM or Ctrl-C; the exit status (1 when the engines could not be loaded)."""
    require_serve()
    import uvicorn

    from .app import create_app

    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    service = ImageService(config)
    server = None

    def load() -> None:
        try:
            service.load(reference, on_stage)
        except Exception as error:  # noqa: BLE001 - any failure ends the server with a message, not a hang
            service.failure = str(error) or type(error).__name__
            log.error("kasoku serve: the engines could not be loaded: %s", service.failure)
            if on_failure:
                on_failure(service.failure)
            server.should_exit = True
            return
        if on_ready:
            on_ready(service)

    app = create_app(service, load=load)
    server = _graceful_server(uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=int(config.timeout) + 5,
        timeout_keep_alive=5))
    if on_listening:
        on_listening(url)
    server.run(sockets=[sock])
    return 1 if service.failure else 0


__all__ = ["LOG_LEVELS", "PortUnavailable", "bind", "run_server"]
