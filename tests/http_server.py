"""A real HTTP server for the remote-shard tests: Python's ``http.server`` serving a folder, with range requests,
a log of every GET (path, range start and end, whether it was cut), and ``drop_once``: ``(path, range start)`` pairs whose next response is cut off halfway (the
connection closed)."""

from __future__ import annotations

import re
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator


class RangeHandler(BaseHTTPRequestHandler):
    server: "FileServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _target(self) -> tuple[bytes, int, int] | None:
        file = self.server.root / self.path.lstrip("/")
        if not file.is_file():
            self.send_error(404)
            return None
        data = file.read_bytes()
        start, end = 0, len(data)
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if asked:
            start, end = int(asked[1]), min(int(asked[2]) + 1 if asked[2] else len(data), len(data))
        self.send_response(206 if asked else 200)
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        return data, start, end

    def do_HEAD(self) -> None:
        self._target()

    def do_GET(self) -> None:
        target = self._target()
        if target is None:
            return
        data, start, end = target
        body = data[start:end]
        with self.server.lock:
            drop = (self.path, start) in self.server.drop_once and len(body) > 1
            self.server.drop_once.discard((self.path, start))
            self.server.log.append((self.path, start, end, drop))
        if drop:  # half the promised bytes, then the connection goes away
            self.wfile.write(body[: len(body) // 2])
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)


class FileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root = root
        self.log: list[tuple[str, int, int, bool]] = []
        self.drop_once: set[tuple[str, int]] = set()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:  # a dropped connection is the point
        pass


@contextmanager
def serve(root: Path) -> Iterator[FileServer]:
    server = FileServer(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
