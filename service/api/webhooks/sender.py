"""One HTTP connection to one endpoint, as the outbound rules want it.

The host is resolved once per connection, every address checked (``trainer.outbound``), and
the connection made to those addresses, never to the name again (no DNS rebinding between
the check and the connect); TLS still verifies the certificate against the name. A
connection is kept alive between deliveries (the same checked address), and opened afresh
after ``MAX_AGE_S``, so a changed DNS answer is seen. Short timeouts, no redirects (a 3xx is
a failed delivery), and at most ``max_response_bytes`` of an answer are read.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.parse

from trainer.outbound import OutboundRefused, check_url, pinned_addresses

__all__ = ["Connection", "SendFailed"]

MAX_AGE_S = 60.0
USER_AGENT = "trainq-webhooks/1"


class SendFailed(Exception):
    """The endpoint did not take the delivery; ``status`` is its HTTP status if it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Connection:
    """A kept-alive connection to one endpoint URL (not thread-safe: one per sender)."""

    def __init__(
        self, url: str, *, timeout_s: float, max_response_bytes: int, allow_private: bool
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self.allow_private = allow_private
        self._conn: http.client.HTTPConnection | None = None
        self._opened = 0.0
        parts = urllib.parse.urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:  # what every request to this URL starts with; Host as the URL names it
            self._head = (
                f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Content-Type: application/json\r\nUser-Agent: {USER_AGENT}\r\n"
                "Accept-Encoding: identity\r\n"
            ).encode("ascii")
        except UnicodeEncodeError:
            self._head = b""  # refused at each send: a URL must be ASCII on the wire

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _open(self) -> http.client.HTTPConnection:
        parts = check_url(self.url, allow_private=self.allow_private)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = pinned_addresses(host, port, allow_private=self.allow_private)
        sock: socket.socket | None = None
        errors = []
        for address in addresses:
            try:
                sock = socket.create_connection((address, port), timeout=self.timeout_s)
                break
            except OSError as exc:
                errors.append(f"{address}: {exc}")
        if sock is None:
            raise SendFailed(f"cannot connect to {host}:{port} ({'; '.join(errors)[:300]})")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            context = ssl.create_default_context()
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise SendFailed(f"TLS with {host}: {exc}") from None
            conn = http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=context)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        conn.sock = sock  # connected to the checked address: http.client will not resolve
        self._opened = time.monotonic()
        return conn

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        """POST ``body``; the HTTP status of a 2xx answer, else SendFailed."""
        if not self._head:
            raise SendFailed("the URL has characters that are not ASCII (percent-encode them)")
        if self._conn is not None and time.monotonic() - self._opened > MAX_AGE_S:
            self.close()
        for _ in range(2):
            fresh = self._conn is None
            try:
                if self._conn is None:
                    self._conn = self._open()
                return self._post(self._conn, body, headers)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if fresh:
                    raise SendFailed("the endpoint closed the connection") from None
                # a kept-alive connection the endpoint had closed meanwhile: once more, fresh
            except OutboundRefused as exc:
                self.close()
                raise SendFailed(f"refused: {exc}") from None
            except SendFailed:
                self.close()
                raise
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                text = (
                    "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                )
                raise SendFailed(text[:500]) from None
        raise SendFailed("the endpoint closed the connection")

    def _post(self, conn: http.client.HTTPConnection, body: bytes, headers: dict[str, str]) -> int:
        # The request is written whole in one send: http.client sends the head and the body
        # apart, two system calls a delivery where one does (they cost the most of a send,
        # more so in a sandbox such as gVisor). The path has no spaces or control characters
        # (check_url), the URL no credentials, and the other header values are our own.
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = self._head + f"Content-Length: {len(body)}\r\n{head}\r\n".encode() + body
        sock = conn.sock
        assert sock is not None
        sock.sendall(request)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        length = response.getheader("content-length")
        small = length is not None and length.isdigit() and int(length) <= self.max_response_bytes
        response.read(self.max_response_bytes)
        if not small or response.will_close:
            self.close()  # unread bytes, or the endpoint closes: a fresh connection next time
        status = response.status
        if 200 <= status < 300:
            return status
        if 300 <= status < 400:
            raise SendFailed(f"HTTP {status}: redirects are not followed", status)
        raise SendFailed(f"HTTP {status}", status)
