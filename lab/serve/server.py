"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
experiments), on a socket bound before start so port 0 yields a free port that is known up front.

Owns: the socket, uvicorn's config (graceful shutdown timeout) and start/stop. Ignores: the routes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


ABORT_GRACE_S = 2.0   # after the drain deadline's aborts, how long the streams get to send their last chunks


class GracefulServer(uvicorn.Server):
    """Shutdown in two stages: in-flight requests get `drain_timeout_s` to finish (`on_drain_start` first:
    health 503, new requests refused), then `on_drain_timeout` aborts the rest, whose streams end with their
    last chunk and [DONE] within ABORT_GRACE_S, after which uvicorn cancels whatever still runs.

    NOTE: uvicorn re-raises a captured SIGTERM/SIGINT once its graceful shutdown is done, so the process
    dies of the signal (status -15); a server that drained cleanly should exit 0 instead."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float,
                 on_drain_start: Callable[[], None] | None = None,
                 on_drain_timeout: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.on_drain_start, self.on_drain_timeout = on_drain_start, on_drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_drain_start is not None:
            self.on_drain_start()
        deadline = (asyncio.get_running_loop().call_later(self.drain_timeout_s, self.on_drain_timeout)
                    if self.on_drain_timeout is not None else None)
        try:
            await super().shutdown(sockets)
        finally:
            if deadline is not None:
                deadline.cancel()


def make_server(app: FastAPI, drain_timeout_s: float, log_level: str = "warning") -> uvicorn.Server:
    # NOTE: backlog well above the default 2048 so a burst of connections is answered (429 or served),
    # not refused by the kernel; the graceful timeout lets in-flight streams finish on SIGTERM.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s + ABORT_GRACE_S,
                            backlog=4096, timeout_keep_alive=30, access_log=False)
    server = getattr(app.state, "server", None)   # NOTE: lab's OpenAIServer (create_app); absent for other apps
    return GracefulServer(config, drain_timeout_s, getattr(server, "begin_drain", None),
                          getattr(server, "abort_in_flight", None))


def serve_forever(app: FastAPI, host: str, port: int, drain_timeout_s: float, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, let in-flight requests finish, then stop the engine."""
    sock = bind(host, port)
    make_server(app, drain_timeout_s, log_level).run(sockets=[sock])


class ServerThread:
    """`with ServerThread(app) as server:` serves on 127.0.0.1:<free port> until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 5.0) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
