"""Running the app: uvicorn, with the shutdown a model server needs.

On SIGTERM or SIGINT (or `Server.stop()` from another thread) the server refuses new requests at once (503), stops
accepting connections, the engine cancels every request in flight (each stream ends with a last chunk whose
finish_reason is "abort", then `data: [DONE]`; a whole answer that was cut is a 503 saying so), and `run()` returns once they have ended: within a step or two, at most `graceful_s` seconds. A
signal is a request to stop, and stopping is success: the process goes on to exit with status 0 (uvicorn would
raise the signal again once it is done, which ends a process with the signal's status).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

GRACEFUL_S = 10.0  # the most a shutdown waits for requests in flight to end


class Server:
    """uvicorn serving an app of `create_app` on host:port (port 0: a free one, read from `port` once started)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                 graceful_s: float = GRACEFUL_S, on_started: Callable[[Server], None] | None = None) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_s, timeout_keep_alive=5)
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
