"""One Redis connection shared by every caller on an event loop: auto-pipelining.

Commands issued while others are in flight are buffered and written together
at the end of the event-loop turn; replies come back in order and are matched
to their callers. A lone caller (nothing in flight) writes at once, so it pays
nothing for the sharing. Replies are parsed by hiredis when installed (the
``redis`` extra), else by a small RESP2 parser here.

Calls of one script that can also be made as one call of a script taking
several (:class:`Batched`: charge.lua and charge_many.lua) go out, when more
than one are written in a turn, as that one call: Redis then does the work
they share once (lua/charge_many.lua says which).

A call that gets no reply within ``timeout`` fails with :class:`TimeoutError`
and drops the connection (a pipelined connection cannot skip one reply), so
every call still in flight on it fails too; the next call reconnects.
Connection failures raise :class:`ConnectionError`. Both are :class:`OSError`,
which the backend turns into ``BackendUnavailableError``.

>>> pack([b"EVALSHA", b"abc", 0])
b'*3\\r\\n$7\\r\\nEVALSHA\\r\\n$3\\r\\nabc\\r\\n$1\\r\\n0\\r\\n'
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from redis import exceptions as redis_errors

_HiredisReader: Any
try:  # pragma: no cover - which parser depends on the install
    from hiredis import Reader as _HiredisReader
except ImportError:  # pragma: no cover
    _HiredisReader = None


class _ReplyError(Exception):
    """An error reply (hiredis builds these; the backend maps them below)."""


def reply_error(message: str) -> redis_errors.ResponseError:
    """The redis-py error of an error reply, so callers handle one family."""
    if message.startswith("NOSCRIPT"):
        return redis_errors.NoScriptError(message)
    return redis_errors.ResponseError(message)


def _encode(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    return str(arg).encode()


def pack(args: Iterable[Any]) -> bytes:
    """One command in RESP: ``*<n>`` then ``$<len>`` and the bytes of each argument."""
    parts = [_encode(a) for a in args]
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def pack_args(args: Iterable[Any]) -> bytes:
    """Arguments packed without the ``*<n>`` header (to splice cached pieces)."""
    return b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in map(_encode, args))


class _PyReader:
    """A RESP2 reader with hiredis' interface (feed, gets -> reply or False)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def gets(self) -> Any:
        try:
            value, end = self._parse(0)
        except (IndexError, ValueError):  # a partial reply: wait for more
            return False
        del self.buf[:end]
        return value

    def _parse(self, at: int) -> tuple[Any, int]:
        nl = self.buf.index(b"\r\n", at)
        kind, line = self.buf[at : at + 1], bytes(self.buf[at + 1 : nl])
        nxt = nl + 2
        if kind == b"+":
            return line, nxt
        if kind == b"-":
            return _ReplyError(line.decode(errors="replace")), nxt
        if kind == b":":
            return int(line), nxt
        if kind == b"$":
            n = int(line)
            if n < 0:
                return None, nxt
            if len(self.buf) < nxt + n + 2:
                raise IndexError
            return bytes(self.buf[nxt : nxt + n]), nxt + n + 2
        if kind == b"*":
            n = int(line)
            if n < 0:
                return None, nxt
            items = []
            for _ in range(n):
                item, nxt = self._parse(nxt)
                items.append(item)
            return items, nxt
        raise redis_errors.InvalidResponse(f"unexpected RESP type {kind!r}")


def _reader() -> Any:
    if _HiredisReader is not None:
        return _HiredisReader(replyError=_ReplyError)
    return _PyReader()


@dataclass(frozen=True, slots=True)
class Address:
    """Where and how to connect: TCP ``host:port`` or a unix ``path``; then AUTH and SELECT."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None

    @classmethod
    def of_client(cls, client: Any) -> Address | None:
        """The address of a redis-py client's pool, or None when it is not a plain one."""
        from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

        pool = getattr(client, "connection_pool", None)
        if pool is None:
            return None
        kw = pool.connection_kwargs
        kind = pool.connection_class
        tls = None
        if kind is SSLConnection:
            tls = ssl.create_default_context()
            if kw.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
        elif kind not in (Connection, UnixDomainSocketConnection):
            return None
        return cls(
            host=kw.get("host", "127.0.0.1"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path") if kind is UnixDomainSocketConnection else None,
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            tls=tls,
        )


class _Waiter(Protocol):
    """What awaits a reply in order: a future, or a batch (:class:`_Batch`)."""

    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


def _hand(waiter: _Waiter, reply: Any) -> None:
    """A reply to what awaits it (an error reply as its exception), unless that
    is done already (a call that timed out, a batch handed on)."""
    if waiter.done():
        return
    if isinstance(reply, _ReplyError):
        waiter.set_exception(reply_error(str(reply)))
    else:
        waiter.set_result(reply)


class _Protocol(asyncio.Protocol):
    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe
        self.reader = _reader()

    def data_received(self, data: bytes) -> None:
        if self.pipe._protocol is not self:  # a dropped connection's late bytes
            return
        reader, waiters, sent = self.reader, self.pipe.waiters, self.pipe.sent
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except Exception as exc:  # a protocol error: nothing after it can be matched
                self.pipe.fail(ConnectionError(f"redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not waiters:
                self.pipe.fail(ConnectionError("redis sent a reply nobody asked for"))
                return
            sent.popleft()
            _hand(waiters.popleft(), reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pipe._protocol is self:
            self.pipe.fail(ConnectionError(f"redis connection lost: {exc or 'closed'}"))


#: The most calls one batched call carries. Redis reads a pipeline 16 KiB at
#: a time and replies to what it read before reading on, so calls in several
#: small batches are answered while the next are written; one batch of a
#: whole turn would be answered only when all of it is (the callers then
#: move in lockstep: at 64 callers a third fewer checks a second than
#: unbatched, benchmarks/README).
BATCH_CALLS = 16

#: One call of a batched script: its keys packed (:func:`pack_args`), how many,
#: its arguments packed, how many.
Part = tuple[bytes, int, bytes, int]


@cache
def _counts(nkeys: int, nargs: int) -> bytes:
    """A call's number of keys and of arguments, packed (few shapes: cached)."""
    return pack_args([nkeys, nargs])


class Batched:
    """A script whose calls may be made as one call of another script that takes
    several: KEYS every call's keys in order, ARGV per call its number of keys,
    its number of arguments, then its arguments; the reply, one per call."""

    __slots__ = ("_many", "_one", "ready")

    def __init__(self, one_sha: str, many_sha: str) -> None:
        self._one = pack_args([b"EVALSHA", one_sha])
        self._many = pack_args([b"EVALSHA", many_sha])
        #: Whether the script taking several is loaded (else each call goes alone).
        self.ready = False

    def one(self, part: Part) -> bytes:
        """``part`` as one EVALSHA of its own script."""
        keys, nkeys, args, nargs = part
        n = b"%d" % nkeys
        return b"".join(
            (
                b"*%d\r\n" % (3 + nkeys + nargs),
                self._one,
                b"$%d\r\n%s\r\n" % (len(n), n),
                keys,
                args,
            )
        )

    def many(self, parts: list[Part]) -> bytes:
        """``parts`` as one EVALSHA of the script taking several."""
        nkeys = sum(p[1] for p in parts)
        n = b"%d" % nkeys
        out = [
            b"*%d\r\n" % (3 + nkeys + sum(2 + p[3] for p in parts)),
            self._many,
            b"$%d\r\n%s\r\n" % (len(n), n),
        ]
        out += [p[0] for p in parts]
        for _, k, args, a in parts:
            out += (_counts(k, a), args)
        return b"".join(out)


class _Batch:
    """The one reply of a turn's batched calls, handed to each call's own future
    as it arrives (an error reply or a failure of the whole: to each of them).
    It stands in the connection's waiters as a future would; nobody awaits it."""

    __slots__ = ("_done", "batched", "calls", "parts")

    def __init__(self, batched: Batched) -> None:
        self.batched = batched
        self.parts: list[Part] = []
        self.calls: list[asyncio.Future[Any]] = []
        self._done = False

    def packed(self) -> bytes:
        if len(self.parts) == 1:
            return self.batched.one(self.parts[0])
        return self.batched.many(self.parts)

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        calls = self.calls
        replies = result if len(calls) > 1 else [result]
        if not isinstance(replies, list) or len(replies) != len(calls):
            self.set_exception(
                ConnectionError(f"redis gave {len(calls)} calls the reply {result!r}")
            )
            return
        self._done = True
        for fut, reply in zip(calls, replies, strict=True):
            _hand(fut, reply)

    def set_exception(self, exception: BaseException) -> None:
        if isinstance(exception, redis_errors.NoScriptError) and len(self.calls) > 1:
            self.batched.ready = False  # Redis lost it (a restart, SCRIPT FLUSH): load it again
        self._done = True
        for fut in self.calls:
            if not fut.done():
                fut.set_exception(exception)


class Pipe:
    """The shared connection of one event loop (see the module docstring)."""

    def __init__(self, address: Address, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.waiters: deque[_Waiter] = deque()
        self.sent: deque[float] = deque()
        self._transport: asyncio.Transport | None = None
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._buffer: list[bytes | _Batch] = []
        self._batch: _Batch | None = None  # this turn's batched calls, in the buffer
        self._watch: asyncio.TimerHandle | None = None

    async def call(self, packed: bytes) -> Any:
        """Send one packed command (:func:`pack`) and await its reply."""
        fut = self.send(packed)
        if fut is None:
            await self._connect()
            fut = self.send(packed)
            if fut is None:
                raise ConnectionError(f"redis connection to {self._where()} closed at once")
        return await fut

    def send(
        self, packed: bytes, future: type[asyncio.Future[Any]] | None = None
    ) -> asyncio.Future[Any] | None:
        """Queue one packed command now (its write keeps its place in the order of
        this connection); the future of its reply (of class ``future``, if given),
        or None when not connected."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._connecting is not None:
            return None
        fut = self.loop.create_future() if future is None else future(loop=self.loop)
        waiters = self.waiters
        if self._buffer:
            self._buffer.append(packed)
        elif waiters:  # others in flight: go out with this turn's other calls
            self._buffer.append(packed)
            self.loop.call_soon(self._flush)
        else:  # alone: at once
            transport.write(packed)
        waiters.append(fut)
        self.sent.append(self.loop.time())
        if self._watch is None:
            self._watch = self.loop.call_later(self.timeout, self._check_timeouts)
        return fut

    def send_part(
        self, part: Part, batched: Batched, future: type[asyncio.Future[Any]] | None = None
    ) -> asyncio.Future[Any] | None:
        """:meth:`send` of one call of ``batched``'s script: alone (nothing in flight)
        or while the script taking several is not loaded, at once as its own
        EVALSHA; else with the turn's other such calls, as one call."""
        if not batched.ready or not (self._buffer or self.waiters):
            return self.send(batched.one(part), future)
        transport = self._transport
        if transport is None or transport.is_closing() or self._connecting is not None:
            return None
        fut = self.loop.create_future() if future is None else future(loop=self.loop)
        batch = self._batch
        if batch is None or batch.batched is not batched:
            batch = self._batch = _Batch(batched)
            if not self._buffer:
                self.loop.call_soon(self._flush)
            self._buffer.append(batch)
            self.waiters.append(batch)
            self.sent.append(self.loop.time())
            if self._watch is None:
                self._watch = self.loop.call_later(self.timeout, self._check_timeouts)
        batch.parts.append(part)
        batch.calls.append(fut)
        if len(batch.calls) >= BATCH_CALLS:
            self._flush()
        return fut

    def _flush(self) -> None:
        buf, self._buffer = self._buffer, []
        self._batch = None
        if buf and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(x if isinstance(x, bytes) else x.packed() for x in buf))

    def _check_timeouts(self) -> None:
        self._watch = None
        if not self.sent:
            return
        late = self.sent[0] + self.timeout - self.loop.time()
        if late <= 0:
            self.fail(TimeoutError(f"redis gave no reply within {self.timeout}s"))
        else:
            self._watch = self.loop.call_later(late, self._check_timeouts)

    async def _connect(self) -> None:
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            return
        self._connecting = self.loop.create_future()
        try:
            await asyncio.wait_for(self._open(), self.timeout)
            self._connecting.set_result(None)
        except (TimeoutError, OSError, redis_errors.ResponseError) as exc:
            error = ConnectionError(f"redis connect to {self._where()} failed: {exc}")
            self._connecting.set_exception(error)
            self._connecting.exception()  # retrieved: no "never retrieved" warning
            raise error from exc
        finally:
            self._connecting = None

    def _where(self) -> str:
        a = self.address
        return a.path or f"{a.host}:{a.port}"

    async def _open(self) -> None:
        a = self.address
        protocol = self._protocol = _Protocol(self)
        if a.path:
            transport, _ = await self.loop.create_unix_connection(lambda: protocol, a.path)
        else:
            transport, _ = await self.loop.create_connection(
                lambda: protocol, a.host, a.port, ssl=a.tls
            )
        sock = transport.get_extra_info("socket")
        if sock is not None and not a.path:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport = transport
        setup: list[list[Any]] = []
        if a.password is not None:
            setup.append(["AUTH", *([a.username] if a.username else []), a.password])
        if a.db:
            setup.append(["SELECT", a.db])
        for cmd in setup:
            fut = self.loop.create_future()
            self.waiters.append(fut)
            self.sent.append(self.loop.time())
            transport.write(pack(cmd))
            await fut

    def fail(self, error: Exception) -> None:
        """Drop the connection; every call in flight gets ``error``."""
        transport, self._transport = self._transport, None
        self._protocol = None
        self._buffer = []
        self._batch = None
        waiters, self.waiters = self.waiters, deque()
        self.sent = deque()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for fut in waiters:
            if not fut.done():
                fut.set_exception(error)
        if transport is not None:
            transport.abort()

    def abandon(self) -> None:
        """Close the socket of a connection whose event loop is gone."""
        transport, self._transport = self._transport, None
        self._protocol = None
        if transport is not None:
            try:
                transport.abort()
            except RuntimeError:  # the loop is closed: close the socket itself
                sock = getattr(transport, "_sock", None)  # asyncio keeps the real socket here
                if sock is not None:
                    sock.close()

    def close(self) -> None:
        """Close the connection (calls in flight fail)."""
        self.fail(ConnectionError("redis connection closed"))
