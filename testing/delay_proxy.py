"""A TCP proxy that puts a store "far away": every reply arrives ``delay`` seconds late.

For the tests that cancel calls at every instant of their admission: with Redis
or Postgres behind :class:`DelayProxy`, a round trip takes at least ``delay``,
so a cancellation sent a few milliseconds into a call lands before the store's
reply, between the reply and the ledger, in the tool or in the settle, as the
test chooses. Requests go through at once; replies keep their order, each held
until ``delay`` after it arrived. The proxy runs in its own thread and event
loop, so a server in another thread (or process) can use it as well::

    with DelayProxy("127.0.0.1", redis_port, delay=0.04) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import TracebackType

__all__ = ["DelayProxy", "behind_proxy"]


class DelayProxy:
    """Forwards loopback connections on :attr:`port` to ``host:port``, replies delayed."""

    def __init__(self, host: str, port: int, *, delay: float = 0.04) -> None:
        self.target = (host, port)
        self.delay = delay
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.ensure_future(_pump(reader, up_writer, 0.0)),
            asyncio.ensure_future(_pump(up_reader, writer, self.delay)),
        ]
        for task in pumps:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    def start(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        return self

    def stop(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``src`` to ``dst``, each chunk written ``delay`` after it was read, in order."""
    if not delay:
        while chunk := await src.read(65536):
            dst.write(chunk)
            await dst.drain()
        return
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def later() -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                return
            dst.write(chunk)
            await dst.drain()

    writing = asyncio.ensure_future(later())
    try:
        while True:
            chunk = await src.read(65536)
            queue.put_nowait((time.monotonic() + delay, chunk))
            if not chunk:
                break
        await writing
    finally:
        writing.cancel()
        with contextlib.suppress(OSError):
            dst.close()


def behind_proxy(url: str, proxy: DelayProxy) -> str:
    """``url`` (redis:// or postgresql://) pointed at ``proxy`` instead of its server."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    netloc[-1] = host
    return urlunsplit(parts._replace(netloc="@".join(netloc)))


def target_of(url: str) -> tuple[str, int]:
    """The host and port a store URL names (its default port when it names none)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    default = 6379 if parts.scheme.startswith("redis") else 5432
    return parts.hostname or "127.0.0.1", parts.port or default
