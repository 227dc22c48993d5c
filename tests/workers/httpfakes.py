"""Stdlib HTTP fakes for the agent's tests: a handler that answers JSON, and a loopback server on its own thread."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that answers with `reply(status, doc)` (a JSON body) and logs nothing."""

    def reply(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass  # quiet test output


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler], tls=None) -> Iterator[str]:
    """A ThreadingHTTPServer with `handler` on 127.0.0.1 at a free port, serving on its own thread (HTTPS with the
    server SSLContext `tls`): yields its URL, then shuts it down."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def not_http(banner: bytes = b"SSH-2.0-OpenSSH\r\n") -> Iterator[int]:
    """A plain TCP server on 127.0.0.1 that answers every connection with `banner` (another service on the port
    --server names): yields its port, then closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(banner)
                conn.settimeout(2.0)
                conn.recv(65536)
            except OSError:
                pass

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(2)
        listener.close()
