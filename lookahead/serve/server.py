"""Running the app: uvicorn, with the shutdown a model server needs.

On SIGTERM or SIGINT (or `Server.stop()` from another thread) the server refuses new requests at once (503), stops
accepting connections, the engine cancels every request in flight (each stream ends with a last chunk whose
finish_reason is "abort", then `data: [DONE]`; a whole answer that was cut is a 503 saying so), and `run()` returns once
they have ended: within a step or two, at most `graceful_s` seconds. A signal is a request to stop, and stopping is
success: the process goes on to exit with status 0 (uvicorn would raise the signal again once it is done, which ends a
process with the signal's status).

Slow clients: uvicorn never times out a request that is still arriving, so clients that dribble their requests could
hold every connection (and file descriptor) for as long as they like; here a request's head (its request line and
headers, a few hundred bytes from any real client) must arrive within `header_timeout_s` and the whole request within
`receive_timeout_s` (else 408 and the connection closes), and past `max_connections` connections a request gets 503.
So a flood of dribbling connections holds the server for `header_timeout_s`, not `receive_timeout_s`. A head that h11
refuses (malformed, or past its 16 KiB) gets a 400 in OpenAI's error shape, as every other error.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

GRACEFUL_S = 10.0  # the most a shutdown waits for requests in flight to end
RECEIVE_TIMEOUT_S = 30.0  # the most a request (its head and body) may take to arrive once it begins
HEADER_TIMEOUT_S = 10.0  # the most its head (request line and headers) may take
MAX_CONNECTIONS = 1000  # open connections (or requests in flight) past which a request gets 503
HEAD_BYTES = 16 * 1024  # the largest request head h11 takes (uvicorn's default: h11's own)


class Server:
    """uvicorn serving an app of `create_app` on host:port (port 0: a free one, read from `port` once started).

    receive_timeout_s: the most a request may take to arrive whole (from its connection's opening, or its first byte
    after a previous answer); header_timeout_s: the most its head may take (from the same moment); a slower one gets
    408 and its connection closes. max_connections: open connections past which a request gets 503 (keep it below
    the process's file limit)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                 graceful_s: float = GRACEFUL_S, on_started: Callable[[Server], None] | None = None,
                 receive_timeout_s: float = RECEIVE_TIMEOUT_S, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if not receive_timeout_s > 0:
            raise ValueError(f"receive_timeout_s must be > 0 seconds, got {receive_timeout_s!r}")
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0 seconds, got {header_timeout_s!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_s, timeout_keep_alive=5,
                                http=functools.partial(_DeadlineH11, receive_timeout_s=receive_timeout_s,
                                                       header_timeout_s=header_timeout_s),
                                limit_concurrency=max_connections)
        self.app, self.host = app, host
        self._thread: threading.Thread | None = None
        served = app.state.served
        self._uvicorn = _Uvicorn(config, served.refuse_new, served.begin_shutdown,
                                 lambda: on_started and on_started(self))

    def run(self) -> None:
        """Serve until stopped (a signal in the main thread, or `stop()`)."""
        with _quiet_signals():
            self._uvicorn.run()

    def start(self, timeout: float = 60.0) -> Server:
        """Serve on a thread of its own; returns (self) once it listens. RuntimeError if it has not within
        `timeout` seconds (the port is taken, the app failed to start: uvicorn has logged why)."""
        self._thread = threading.Thread(target=self.run, name="lookahead-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout)
                raise RuntimeError(f"the server did not start on {self.host}:{self._uvicorn.config.port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float | None = GRACEFUL_S + 5) -> None:
        """Stop serving (from any thread), as a SIGTERM does; after `start()`, wait for it to end."""
        self._uvicorn.handle_exit(signal.SIGTERM, None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._uvicorn.started

    @property
    def port(self) -> int:
        """The port it listens on (once started)."""
        return self._uvicorn.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Run `app` with uvicorn on host:port until SIGTERM or SIGINT; see `Server` for the options."""
    Server(app, host, port, **options).run()


class _DeadlineH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with deadlines for receiving a request, from the connection's opening (or the
    first byte of its next request): to the head's last byte (header_timeout_s) and to the request's
    (receive_timeout_s). Past one the client gets 408 and the connection closes, whatever the handler was waiting for
    (a body read then ends as a disconnect). A head h11 refuses gets a 400 in OpenAI's error shape."""

    def __init__(self, *args, receive_timeout_s: float, header_timeout_s: float = HEADER_TIMEOUT_S,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.receive_timeout_s, self.header_timeout_s = receive_timeout_s, header_timeout_s
        self._deadline: object | None = None  # the timer while a request is arriving
        self._began = 0.0  # when the request arriving now began
        self._head = False  # the timer is the head's

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _arriving(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _watch(self) -> None:
        arriving = self._arriving()
        if arriving and self._deadline is None:
            self._began, self._head = self.loop.time(), self.conn.their_state is h11.IDLE
            limit = min(self.header_timeout_s, self.receive_timeout_s) if self._head else self.receive_timeout_s
            self._deadline = self.loop.call_later(limit, self._too_slow)
        elif arriving and self._head and self.conn.their_state is not h11.IDLE:  # the head is in: the body's turn
            self._deadline.cancel()
            self._head = False
            self._deadline = self.loop.call_at(self._began + self.receive_timeout_s, self._too_slow)
        elif not arriving and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's head: a 400 in OpenAI's error shape (uvicorn's is plain text)."""
        limit = self.config.h11_max_incomplete_event_size or HEAD_BYTES
        if len(self.conn.trailing_data[0]) > limit:
            message = f"the request's head (request line and headers) is larger than the limit of {limit} bytes"
        else:
            message = "invalid HTTP request: a malformed request line or header"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_http_request"}}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _too_slow(self) -> None:
        self._deadline = None
        if not self._arriving() or self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:  # no answer begun: say why it closes
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_SLOW), _TOO_SLOW))
        self.transport.close()


_TOO_SLOW = (b'{"error": {"message": "the request did not arrive whole in time", "type": "invalid_request_error", '
             b'"param": null, "code": "request_timeout"}}')


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], on_shutdown: Callable[[], None],
                 on_started: Callable[[], None]):
        super().__init__(config)
        self._on_exit, self._on_shutdown, self._on_started = on_exit, on_shutdown, on_started

    def handle_exit(self, sig: int, frame) -> None:
        # a signal (or stop()): refuse new requests now; uvicorn notices should_exit only at its next tick
        super().handle_exit(sig, frame)
        self._on_exit()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    async def shutdown(self, sockets=None) -> None:
        # before uvicorn waits for the requests in flight: end them (uvicorn stops accepting first thing)
        self._on_shutdown()
        await super().shutdown(sockets)


@contextlib.contextmanager
def _quiet_signals() -> Iterator[None]:
    """While serving from the main thread, SIGINT and SIGTERM do nothing once uvicorn has let go of them: uvicorn
    raises the signal that stopped it again when it returns, and the process should then exit 0, not die of it."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
