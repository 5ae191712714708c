"""The HTTP client the gateway gives its Python agents' `openai` clients (issue 31 §2: a call's client CPU).

One `httpx.Client` serves every episode of a process (the trainer's agent threads, or one agent worker's): an
`openai.OpenAI` client per episode is cheap, an httpx client is not (its SSL context alone is ~0.1 s). Two
things differ from httpx's defaults, both because of what a step of dozens of concurrent agents does to them:

- Connections are kept in a stack (`_IdleStack`): a request takes the last connection put back, or opens one;
  a response, once read, puts its connection back if the server left it open. httpcore's own pool walks every
  connection it holds on each request and again as each response closes (a poll syscall on each idle socket,
  and a count of all of them for each idle one): with 32 concurrent agents in a worker, ~64 polls a call.
- No cookies: the gateway sets none, and the episodes sharing the client must not share any; httpx would
  otherwise wrap every response for `http.cookiejar` and every request for the cookie header.

With keep-alive off (`env.agent_keep_alive`, the server's `Connection: close`), each connection serves one
call and is closed after it, as with httpx's pool.
"""

from __future__ import annotations

import http.cookiejar
import threading
from collections.abc import Iterator

import httpcore
import httpx


class _NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that stores nothing and adds nothing (see the module docstring)."""

    def extract_cookies(self, response, request) -> None:  # noqa: ARG002 - CookieJar's signature
        return None

    def add_cookie_header(self, request) -> None:  # noqa: ARG002
        return None


class _Returned:
    """A response body that hands its connection back to the stack once it is read and closed."""

    def __init__(self, stream, connection: httpcore.HTTPConnection, stack: _IdleStack) -> None:
        self._stream, self._connection, self._stack = stream, connection, stack

    def __iter__(self) -> Iterator[bytes]:
        yield from self._stream

    def close(self) -> None:
        try:
            if hasattr(self._stream, "close"):
                self._stream.close()
        finally:
            self._stack.put_back(self._connection)


class _IdleStack:
    """httpcore's pool interface (`handle_request`, `close`) over a stack of idle connections: O(1) a call."""

    def __init__(self) -> None:
        self._idle: list[httpcore.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpcore.Request) -> httpcore.Response:
        connection = None
        while connection is None:
            with self._lock:
                kept = self._idle.pop() if self._idle else None
            if kept is None:
                connection = httpcore.HTTPConnection(origin=request.url.origin)
            elif (
                kept.can_handle_request(request.url.origin) and kept.is_available() and not kept.has_expired()
            ):
                connection = kept  # has_expired: the server closed it since (a readable idle socket)
            else:
                kept.close()
        try:
            response = connection.handle_request(request)
        except BaseException:
            connection.close()
            raise
        return httpcore.Response(
            status=response.status,
            headers=response.headers,
            content=_Returned(response.stream, connection, self),
            extensions=response.extensions,
        )

    def put_back(self, connection: httpcore.HTTPConnection) -> None:
        if connection.is_idle():  # read to the end, and the server did not say `Connection: close`
            with self._lock:
                if not self._closed:
                    self._idle.append(connection)
                    return
        connection.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for connection in idle:
            connection.close()

    def __enter__(self) -> _IdleStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def agent_http_client() -> httpx.Client:
    """The shared client for a process's agents (see the module docstring); no timeout of its own: the
    trainer times episodes out (env.episode_timeout_s)."""
    transport = httpx.HTTPTransport()
    transport._pool = _IdleStack()  # httpx's transport maps requests and replies; the pool is ours
    return httpx.Client(timeout=None, transport=transport, cookies=_NoCookies())


__all__ = ["agent_http_client"]
