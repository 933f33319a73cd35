"""An ASGI app served by uvicorn on a free loopback port, in its own thread and event loop.

For the integration suites that call a server over real HTTP (FastMCP's streamable
HTTP transport, the ASGI middleware): :class:`ThreadServer`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")


class ThreadServer:
    """An ASGI app under uvicorn on a free loopback port, in its own thread and loop.

    ``build`` runs in that loop (so a Redis client is bound to it) and returns
    the app and whatever the test needs; ``run`` executes a coroutine there.
    """

    def __init__(self, build: Callable[[], Awaitable[tuple[Any, Any]]]) -> None:
        self._build = build
        self.loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.state: Any = None
        self._server: uvicorn.Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        app, self.state = await self._build()
        config = uvicorn.Config(app, log_level="warning", lifespan="on", ws="none")
        self._server = uvicorn.Server(config)
        serving = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not serving.done():  # noqa: ASYNC110 - uvicorn has only a flag
            await asyncio.sleep(0.01)
        self._ready.set()
        await serving
        close = getattr(self.state, "aclose", None)
        if close is not None:
            await close()

    def start(self) -> ThreadServer:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()
