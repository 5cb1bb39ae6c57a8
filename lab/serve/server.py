"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
experiments), on a socket bound before start so port 0 yields a free port that is known up front.

Owns: the socket, uvicorn's config (graceful shutdown timeout) and start/stop. Ignores: the routes.
"""

from __future__ import annotations

import socket
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """NOTE: uvicorn re-raises a captured SIGTERM/SIGINT once its graceful shutdown is done, so the process
    dies of the signal (status -15); a server that drained cleanly should exit 0 instead."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def make_server(app: FastAPI, drain_timeout_s: float, log_level: str = "warning") -> uvicorn.Server:
    # NOTE: backlog well above the default 2048 so a burst of connections is answered (429 or served),
    # not refused by the kernel; timeout_graceful_shutdown lets in-flight streams finish on SIGTERM.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s, backlog=4096,
                            timeout_keep_alive=30, access_log=False)
    return GracefulServer(config)


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
