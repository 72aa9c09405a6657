"""A ``dllm serve`` app run by uvicorn in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time

import pytest


def serve_args(*argv: str):
    from dllm.serve.cli import parser

    return parser().parse_args(list(argv))


class LiveServer:
    """``with LiveServer(app) as server:`` -> ``server.url`` ("http://127.0.0.1:PORT"); stopped (lanes cancelled
    after the app's grace) on exit."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    @property
    def engine(self):
        return self.app.state.engine

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)


def require_serve():
    """Skip with the reason when the [serve] extra (and the openai client the tests speak) is not installed."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "greenlet", "openai", "httpx"):
        pytest.importorskip(module, reason=f"dllm serve's tests need {module}: pip install -e '.[serve,test]'")
