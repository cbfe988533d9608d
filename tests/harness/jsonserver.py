"""A stand-in HTTP server on its own thread that answers every GET and POST with JSON, for a
service the test plays itself (Prometheus's query API, an OpenAI-style provider over TLS)."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[BaseHTTPRequestHandler], tuple[Any, Mapping[str, str]]]
"""The request -> (the JSON body of a 200 answer, extra response headers)."""


@contextlib.contextmanager
def json_server(answer: Answer, *, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """Serve `answer` on a free loopback port (over TLS with `tls`) for the length of the block;
    yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body, headers = answer(self)
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
