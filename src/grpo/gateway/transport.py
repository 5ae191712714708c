"""The HTTP under the `openai` clients grpo hands its agents: a plain socket to the gateway's own server.

An agent's model call is ~6 ms of client CPU on this repo's 2-core benchmark host, a third of it in httpx's
default transport (httpcore's connection pool and h11's state machine), all of it beside the engine on the
same cores. The gateway's server answers one request per connection (server.py: `Connection: close`), with
a Content-Length or, for a stream, until it closes; so a request to it needs no pool and no general HTTP/1.1
parser: connect, send the request as httpx built it, read the status line and headers, hand the body on as
it arrives (a stream's events as they are sent). Anything not addressed to the gateway (another host, https)
goes through httpx's own transport, unchanged. The `openai` client and the agent's code above it are the
user's and are not touched: they see the same responses, errors (httpx.ConnectError, ReadError,
RemoteProtocolError) and streams.
"""

from __future__ import annotations

import socket

import httpx

MAX_HEAD = 65536  # bytes of a response's status line and headers


def agent_http_client(base_url: str) -> httpx.Client:
    """The httpx client of an agent worker's `openai` clients: the gateway at `base_url` over
    GatewayTransport, no timeout of its own (the runner keeps the episode's time limit)."""
    url = httpx.URL(base_url)
    transport = GatewayTransport(url.host, url.port or 80)
    return httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None), transport=transport)


class GatewayTransport(httpx.BaseTransport):
    """Requests to http://host:port go over a socket of their own (see the module docstring); others to
    `fallback` (httpx's default transport)."""

    def __init__(self, host: str, port: int, fallback: httpx.BaseTransport | None = None) -> None:
        self.host, self.port = host, int(port)
        self.fallback = fallback or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http" or url.host != self.host or (url.port or 80) != self.port:
            return self.fallback.handle_request(request)
        body = request.read()
        lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), url.raw_path)]
        lines += [b"%s: %s" % (name, value) for name, value in request.headers.raw]
        try:
            sock = socket.create_connection((self.host, self.port))
        except OSError as err:
            raise httpx.ConnectError(str(err), request=request) from err
        try:
            sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            reader = sock.makefile("rb")
            status, headers = _head(reader, request)
        except OSError as err:
            sock.close()
            raise httpx.ReadError(str(err), request=request) from err
        except BaseException:
            sock.close()
            raise
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if any(k.lower() == b"transfer-encoding" for k, _ in headers):
            sock.close()  # the gateway never sends one; a body it cannot frame is not guessed at
            raise httpx.RemoteProtocolError("a chunked response from the gateway", request=request)
        stream = _Body(sock, reader, int(length) if length is not None else None, request)
        return httpx.Response(
            status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"}
        )

    def close(self) -> None:
        self.fallback.close()


def _head(reader, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]]]:
    line = reader.readline(MAX_HEAD + 1)
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP response: {line[:80]!r}", request=request)
    headers, size = [], len(line)
    while True:
        raw = reader.readline(MAX_HEAD + 1)
        size += len(raw)
        if raw in (b"\r\n", b"\n"):
            return int(parts[1]), headers
        if not raw or size > MAX_HEAD:
            raise httpx.RemoteProtocolError(
                "the response's headers ended early or ran too long", request=request
            )
        name, colon, value = raw.partition(b":")
        if colon:
            headers.append((name.strip(), value.strip()))


class _Body(httpx.SyncByteStream):
    """The body as it arrives: `length` bytes, or up to the server's close."""

    def __init__(self, sock: socket.socket, reader, length: int | None, request: httpx.Request) -> None:
        self.sock, self.reader, self.left, self.request = sock, reader, length, request

    def __iter__(self):
        try:
            while self.left is None or self.left > 0:
                chunk = self.reader.read1(65536 if self.left is None else min(self.left, 65536))
                if not chunk:
                    if self.left:
                        raise httpx.RemoteProtocolError("the response ended early", request=self.request)
                    return
                if self.left is not None:
                    self.left -= len(chunk)
                yield chunk
        except OSError as err:
            raise httpx.ReadError(str(err), request=self.request) from err

    def close(self) -> None:
        self.reader.close()
        self.sock.close()
