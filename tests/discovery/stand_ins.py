"""An instance's HTTP health check standing in for a vLLM server's (``GET /health``
answers 200 while it runs), for the bridge and the ``health`` command."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Served:
    """An HTTP server on 127.0.0.1 answering with ``handler`` on a thread of its own until
    :meth:`close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       kwargs={"poll_interval": 0.1})
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class HealthServer(Served):
    """Answers ``GET /health`` with 200 on 127.0.0.1 until :meth:`close`; counts the
    checks."""

    def __init__(self, port: int = 0) -> None:
        self.checks = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.checks += 1
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(Handler, port)

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
