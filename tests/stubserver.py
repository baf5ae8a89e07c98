"""A local HTTP(S) server for client tests: it answers requests from a script, and records what they carried.

Each request gets the next answer of the script (the last one repeats): an Answer, or one of the failures a client
must survive: DROP (the connection closes before any answer), CUT (it closes mid-body), HANG (no answer until the
server stops).
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

DROP, CUT, HANG = "drop", "cut", "hang"


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: Any = field(default_factory=dict)  # JSON-encoded unless bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    at: float  # time.monotonic()


class StubServer:
    def __init__(self, *script: Answer | str, ssl_context: ssl.SSLContext | None = None):
        self.script, self.requests = list(script), []
        stopping = self._stopping = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the API server and Prometheus answer

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.requests.append(Request(self.command, self.path, dict(self.headers), time.monotonic()))
                answer = server.script[min(len(server.requests), len(server.script)) - 1]
                if answer == DROP:
                    self.close_connection = True
                    return
                if answer == HANG:
                    stopping.wait()
                    self.close_connection = True
                    return
                if answer == CUT:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"kind": "Con')
                    self.wfile.flush()
                    self.close_connection = True
                    return
                body = answer.body if isinstance(answer.body, bytes) else json.dumps(answer.body).encode()
                self.send_response(answer.status)
                for name, value in {"Content-Type": "application/json", **answer.headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="stub-server", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> StubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
