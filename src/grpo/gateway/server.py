"""The HTTP endpoint: stdlib ThreadingHTTPServer on 127.0.0.1, a free port, one thread per connection.

Routes (ROUTES, path → handler(gateway, session, body)) answer a dict as JSON, or an iterator as a
server-sent event stream; GET /v1/models needs no body; /v1/responses is responses.py's translation. Every
request must carry a live session's key as `Authorization: Bearer ...` (401 otherwise). A request that
cannot be served gets an OpenAI-style error object and the server stays up: malformed JSON 400, a body
over `max_body` bytes 413, an ended session 409, another method 405 (even what the stdlib answers itself, a
malformed request line, is an error object). A session's malformed request (400/413) ends its episode
(counted as `bad_request`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.gateway.responses import responses_route
from grpo.gateway.service import Gateway, ended_error
from grpo.gateway.sessions import Session
from grpo.gateway.wire import (
    ChatRequest,
    GatewayError,
    TurnDone,
    chat_completion,
    finite_reward,
    stream_chunks,
)

log = logging.getLogger("grpo")

MAX_BODY = 8 * 2**20  # bytes of a request body
MAX_LINE, MAX_HEADERS = 65536, 100  # a header line's bytes and the headers of a request (the stdlib's limits)


def chat_completions(gateway: Gateway, session: Session, body: dict):
    req = ChatRequest.parse(body)
    request_id = "chatcmpl-" + uuid.uuid4().hex
    events = gateway.complete(session, req)
    first = next(events)  # errors in the request surface here, before any byte of a reply is sent
    events = _chain(first, events)
    if req.stream:
        return stream_chunks(events, request_id, gateway.model_name, req.include_usage)
    done = next(ev for ev in events if isinstance(ev, TurnDone))
    return chat_completion(done, request_id, gateway.model_name)


def reward(gateway: Gateway, session: Session, body: dict):
    del gateway
    value = finite_reward(body.get("reward")) if isinstance(body, dict) else None
    if value is None:  # JSON as Python reads it also carries NaN and Infinity: not a reward either
        raise GatewayError(
            400,
            'The body must be {"reward": <finite number>} (and optionally "turn": <int>).',
            param="reward",
        )
    turn = body.get("turn")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 1):
        raise GatewayError(
            400, "turn must be a positive integer (1 = the first assistant turn).", param="turn"
        )
    with session.lock:
        if turn is None:
            session.reward = value
        else:
            session.turn_rewards[turn] = value
    return {"object": "reward", "reward": value, "turn": turn}


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


ROUTES: dict[str, Callable] = {
    "/v1/chat/completions": chat_completions,
    "/v1/responses": responses_route,  # the Responses API, translated onto Gateway.complete
    "/v1/reward": reward,
}


class _HTTPServer(ThreadingHTTPServer):
    # The listen backlog: a step's episodes connect at once, and the default (5) resets connections.
    request_queue_size = 1024

    def __init__(self, *args, **kwargs) -> None:
        self.connections: set = set()  # open client connections (kept alive between calls), closed at close()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every open connection (its thread's read returns, the thread ends): no socket outlives the
        server."""
        with self._connections_lock:
            open_now = list(self.connections)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):  # noqa: ARG002 - socketserver's signature
        """A client that hangs up is the client's business: one debug line, not a traceback on the console."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError | TimeoutError):
            log.debug("gateway: a client connection ended: %s", err)
        else:
            log.warning("Gateway: a connection failed: %s: %s", type(err).__name__, err)


class GatewayServer:
    """Serves `gateway` on host:port (port 0: a free one) from a daemon thread until close()."""

    def __init__(
        self,
        gateway: Gateway,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body: int = MAX_BODY,
        keep_alive: bool = False,  # env.agent_keep_alive: a JSON reply leaves its connection open
    ):
        self.gateway = gateway
        attrs = {"gateway": gateway, "max_body": max_body, "keep_alive": keep_alive}
        handler = type("Handler", (_Handler,), attrs)
        self.httpd = _HTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="grpo-gateway", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_connections()
        self._thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    gateway: Gateway
    max_body: int
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        log.debug("gateway: " + format, *args)

    def parse_request(self) -> bool:
        """The request line and headers. A usual request line (`METHOD /path HTTP/1.x`) has its headers read
        here, without the stdlib's e-mail parser (a fifth of the server's cost of a chat request); any other
        goes to the stdlib's parse_request, which answers what is wrong with it."""
        line = self.raw_requestline.rstrip(b"\r\n")
        words = line.split()
        if len(words) != 3 or words[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not words[0].isalpha():
            return super().parse_request()
        self.requestline = line.decode("iso-8859-1")
        self.command, path, self.request_version = (w.decode("iso-8859-1") for w in words)
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path  # as the stdlib: no '//host'
        # by lower-cased name: a plain dict while read (_Headers' own lookups lower the name again)
        headers, name = {}, None
        for count in range(MAX_HEADERS + 1):
            raw = self.rfile.readline(MAX_LINE + 1)
            if len(raw) > MAX_LINE:
                self.send_error(431, "Line too long")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            if count == MAX_HEADERS:
                self.send_error(431, "Too many headers")
                return False
            text = raw.decode("iso-8859-1").rstrip("\r\n")
            if text[:1] in (" ", "\t"):  # a folded line continues the header before it
                if name is not None:
                    headers[name] += " " + text.strip()
                continue
            key, colon, value = text.partition(":")
            key = key.strip().lower()
            name = key if colon and key not in headers else None
            if name is not None:  # the first of repeated headers counts, as email.message.Message.get gives
                headers[name] = value.strip()
        self.headers = headers = _Headers(headers)
        connection = headers.get("Connection", "").lower()
        self.close_connection = self.request_version == "HTTP/1.0" or connection == "close"
        if headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def do_GET(self):
        session = self._session()
        if session is None:
            return
        path = self.path.split("?")[0].rstrip("/")
        model = {"id": self.gateway.model_name, "object": "model", "created": 0, "owned_by": "grpo"}
        if path == "/v1/models":
            self._json(200, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/"):  # client.models.retrieve(name): the policy answers to any name
            self._json(200, {**model, "id": path[len("/v1/models/") :]})
        else:
            self._error(GatewayError(404, f"No route GET {self.path}.", code="not_found"))

    def do_POST(self):
        session = self._session()
        if session is None:
            return
        route = ROUTES.get(self.path.split("?")[0].rstrip("/"))
        if route is None:
            self._error(GatewayError(404, f"No route POST {self.path}.", code="not_found"))
            return
        try:
            body = self._body()
            if session.ended is not None:
                raise ended_error(session)
            reply = route(self.gateway, session, body)
        except GatewayError as err:
            if err.status in (400, 413):
                with session.lock:
                    session.bad_requests += 1
                session.end("bad_request")
                self.gateway.batcher.wake()
            self._error(err)
            return
        except Exception as err:  # noqa: BLE001 - one request fails; the server and the run go on
            log.warning("Gateway: a request failed: %s: %s", type(err).__name__, err)
            self._error(GatewayError(500, f"{type(err).__name__}: {err}", "server_error"))
            return
        if isinstance(reply, dict):
            self._json(200, reply)
        else:
            self._stream(reply)

    def _not_allowed(self):
        self._discard_body()
        allow = "GET" if self.path.split("?")[0].rstrip("/").startswith("/v1/models") else "POST"
        self._error(GatewayError(405, f"{self.command} is not served on {self.path}: use {allow}.",
                                 code="method_not_allowed"), {"Allow": allow})  # fmt: skip

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    def send_error(self, code, message=None, explain=None):
        """What the stdlib answers itself (a malformed request line, an unsupported method) as an OpenAI-style
        error object, like every other reply, instead of its HTML page."""
        del explain
        self.close_connection = True
        # A request line it could not read leaves the stdlib assuming HTTP/0.9, which has no status line or
        # headers: answer as HTTP/1.1 so the client can read the status.
        self.request_version = self.protocol_version
        self._error(GatewayError(code, message or "The request could not be read."))

    def _session(self) -> Session | None:
        auth = self.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        session = self.gateway.sessions.get(key) if key else None
        if session is None:
            self._discard_body()
            self._error(
                GatewayError(
                    401,
                    "Incorrect API key: use the episode's own key.",
                    "authentication_error",
                    "invalid_api_key",
                )
            )
        return session

    def _discard_body(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if 0 < length <= self.max_body:
            self.rfile.read(length)
        elif length:
            self.close_connection = True

    def _body(self):
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise GatewayError(400, "Content-Length must be a number of bytes (0 or more).")
        if length > self.max_body:
            self.close_connection = True  # the body is not read: the connection cannot be reused
            raise GatewayError(413, f"The request body is {length} bytes, over the limit of {self.max_body}.")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw or b"null")
        except (ValueError, RecursionError) as err:  # RecursionError: a body nested past the limit
            raise GatewayError(400, f"The request body is not valid JSON ({err}).") from None

    def _json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        # Keep-alive: an agent's pooled client sends its next call on this connection instead of connecting
        # anew (a connect, a server thread started and ended, the client's connection setup: ~1 ms of CPU a
        # call on the two sides). The server never ends a kept connection on its own while serving it: when
        # it must (an unread body, an error, HTTP/1.0), the reply says `Connection: close` so no client
        # reuses it (a silent close is what left requests unanswered before); GatewayServer.close() ends the
        # idle ones. Off (env.agent_keep_alive=false): one request per connection.
        if self.close_connection or not self.keep_alive:
            self.send_header("Connection", "close")
            self.close_connection = True
        if getattr(self, "_headers_buffer", None) is not None:  # headers and body in one send, not two
            self._headers_buffer.append(b"\r\n" + data)
            self.flush_headers()
        else:  # an HTTP/0.9 request line: the stdlib buffers no headers
            self.end_headers()
            self.wfile.write(data)

    def _error(self, err: GatewayError, headers: dict | None = None) -> None:
        self._json(err.status, err.body(), headers)

    def _stream(self, items) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.close_connection = True  # the stream ends with the connection (no length to announce)
        self.end_headers()
        try:
            for item in items:
                if isinstance(item, tuple):
                    frame = f"event: {item[0]}\ndata: {json.dumps(item[1])}\n\n"
                elif isinstance(item, str):
                    frame = f"data: {item}\n\n"
                else:
                    frame = f"data: {json.dumps(item)}\n\n"
                self.wfile.write(frame.encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.debug("gateway: a client closed its stream early")
        except Exception as err:  # noqa: BLE001 - after the reply began the status is sent: the stream says it
            # A chat completions stream's error chunk (`data: {"error": ...}`, what the openai package raises
            # APIError on), then [DONE] for clients that read to the end. (A Responses stream never gets here:
            # responses.py ends its own with a `response.failed` event.)
            if not isinstance(err, GatewayError):
                log.warning("Gateway: a stream failed: %s: %s", type(err).__name__, err)
                err = GatewayError(500, f"{type(err).__name__}: {err}", "server_error")
            try:
                self.wfile.write(f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode())
            except OSError:
                log.debug("gateway: a client closed its stream before its error")
        finally:
            if (close := getattr(items, "close", None)) is not None:
                close()  # a turn the client left still ends (and is recorded) in Gateway.complete


class _Headers(dict):
    """A request's headers by lower-cased name; `get` and `[]` take any case."""

    def get(self, name, default=None):
        return super().get(name.lower(), default)

    def __getitem__(self, name):
        return super().__getitem__(name.lower())

    def __contains__(self, name):
        return super().__contains__(name.lower() if isinstance(name, str) else name)
