"""`serve`'s port, bound before anything heavy is imported or loaded (torch, FastAPI, the model): a busy
port fails at once, and from the first second /health answers 503 {"status": "loading", "phase": ...}
(the start-up phase under way, pagedserve/engine/startup.py) and every other route 503 with Retry-After,
until the engine is ready and the real app is swapped in (`LoadingApp.inner`). Imports only uvicorn
and the standard library."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Callable


class StopLoading(BaseException):
    """SIGTERM / SIGINT while the engine loads: stop loading, close the port, exit."""


async def _json(send, status: int, body: dict, headers: tuple = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class LoadingApp:
    """What `serve` answers from the moment its port is bound until the engine is ready: /health 503
    {"status": "loading", "phase": <the phase under way>}, every other route 503 (OpenAI's error shape,
    type server_loading, Retry-After: 1); once `inner` (the real app) is set, every request goes to it.
    Lifespan events are answered here (the real app keeps no lifespan state)."""

    def __init__(self, startup):
        self.startup, self.inner = startup, None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.inner is not None:
            return await self.inner(scope, receive, send)
        if scope["type"] != "http":         # a websocket while loading: refused
            return
        phase, retry = self.startup.current, ((b"retry-after", b"1"),)
        if scope["path"] == "/health":
            return await _json(send, 503, {"status": "loading", "phase": phase}, retry)
        msg = f"the model is loading ({phase}); retry when /health answers 200"
        body = ({"type": "error", "error": {"type": "overloaded_error", "message": msg}}
                if scope["path"].startswith("/v1/messages") else
                {"error": {"message": msg, "type": "server_loading", "param": None, "code": 503}})
        await _json(send, 503, body, retry)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a busy port raises OSError at once (TIME_WAIT is no conflict,
    as uvicorn binds)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class Front:
    """The bound socket, uvicorn serving LoadingApp on it from a thread of its own (its event loop: the
    server's for its whole life), started by `start`. `on_exit` runs when uvicorn returns (run_server
    points it at the engine loop's shutdown)."""

    def __init__(self, startup, host: str, port: int):
        import uvicorn
        self.sock = bind_socket(host, port)
        self.app = LoadingApp(startup)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.done = threading.Event()
        self.on_exit: Callable[[], object] = lambda: None
        self.thread = threading.Thread(target=self._serve, name="pagedserve-http", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            self.done.set()
            self.on_exit()

    def start(self) -> "Front":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Close the port (a load that failed or was stopped)."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
        self.sock.close()
