"""`python -m lab.serve` as a subprocess (Hydra overrides, 127.0.0.1, a free port): it serves, and on
SIGTERM it stops accepting, lets the in-flight stream finish (drain), stops the engine and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}: {process.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server did not become healthy")


@pytest.mark.slow
def test_cli_serves_then_drains_in_flight_stream_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "lab.serve", "model=tiny", f"serve.port={port}", "serve.served_model_name=tiny",
         "serve.log_level=warning", "threads=1", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(url, process)
        chunks: list[dict] = []
        first_chunk = threading.Event()

        def consume() -> None:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                        first_chunk.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_chunk.wait(60), "no streamed chunk"
        process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert process.wait(60) == 0, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
