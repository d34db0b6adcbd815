"""Real S3 on loopback for tests and benchmarks: a moto server, and a fault-injecting HTTP proxy in front
of it that answers 503, resets connections or stalls, on demand, for a bounded number of requests.

    with moto_s3() as endpoint:                 # http://127.0.0.1:PORT, bucket `lake` exists
        with FaultProxy(endpoint) as proxy:     # point AWS_ENDPOINT_URL at proxy.url
            proxy.fail_next(3, "503")
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

BUCKET = "lake"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "rollflow-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "rollflow-test-SECRET-do-not-log",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@contextlib.contextmanager
def moto_s3(bucket: str = BUCKET) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (free port) with `bucket` created; yields its endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        s3.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that forwards to `upstream` or injects a fault per request.

    Faults: "503" (an S3 `ServiceUnavailable` answer), "reset" (TCP RST, no answer), "stall" (no answer
    for `stall_s`, then close). `fail_next(n, kind)` faults the next n requests, `fail_every(k, kind)`
    every k-th, `outage(kind)` every request until `heal()`.
    """

    def __init__(self, upstream: str, stall_s: float = 5.0):
        up = urlsplit(upstream)
        self.up_host, self.up_port = up.hostname or "127.0.0.1", up.port or 80
        self.stall_s = stall_s
        self.lock = threading.Lock()
        self.requests = 0
        self.injected: dict[str, int] = {}
        self._next: list[str] = []
        self._every: tuple[int, list[str]] | None = None
        self._outage: str | None = None
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _handle(self):
                body = self._read_body()
                fault = proxy._decide()
                if fault == "503":
                    self._send_503()
                elif fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                elif fault == "stall":
                    time.sleep(proxy.stall_s)
                    self.close_connection = True
                else:
                    self._forward(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b""):  # trailers
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send_503(self):
                payload = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                    b"<Message>injected by FaultProxy</Message></Error>"
                )
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _decide(self) -> str | None:
        with self.lock:
            self.requests += 1
            fault = None
            if self._outage:
                fault = self._outage
            elif self._next:
                fault = self._next.pop(0)
            elif self._every and self.requests % self._every[0] == 0:
                kinds = self._every[1]
                fault = kinds[(self.requests // self._every[0]) % len(kinds)]
            if fault:
                self.injected[fault] = self.injected.get(fault, 0) + 1
            return fault

    def fail_next(self, n: int, kind: str = "503") -> None:
        with self.lock:
            self._next = [kind] * n

    def fail_every(self, k: int, *kinds: str) -> None:
        """Fault every k-th request, cycling through `kinds` (default "503")."""
        with self.lock:
            self._every = (k, list(kinds or ["503"]))

    def outage(self, kind: str = "503") -> None:
        with self.lock:
            self._outage = kind

    def heal(self) -> None:
        with self.lock:
            self._outage, self._next, self._every = None, [], None

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
