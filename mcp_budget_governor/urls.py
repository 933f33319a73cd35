"""Service URLs: checked once before a client is made, and shown without their secrets."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from .errors import InvalidInputError
from .redaction import redact as redact  # its home before the errors needed it

#: Schemes redis-py connects with.
REDIS_SCHEMES = ("redis", "rediss", "unix")
_EXPECTED = "expected redis://host:port/db, rediss://host:port/db or unix:///path.sock"

#: Redis Cluster, the ``limits`` library's form: ``redis+cluster://h1:p1[,h2:p2]``.
CLUSTER_SCHEME = "redis+cluster://"


def parse_cluster_url(url: str, field: str = "url") -> list[tuple[str, int]]:
    """``redis+cluster://h1:p1[,h2:p2]`` -> its seed nodes.

    >>> parse_cluster_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    [('127.0.0.1', 7000), ('127.0.0.1', 7001)]
    >>> parse_cluster_url("redis+cluster://h:x")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: url: port 'x' is not 1-65535 \
(got 'redis+cluster://h:x')
    """
    expected = "expected redis+cluster://host:port[,host:port]"
    if not isinstance(url, str) or not url.lower().startswith(CLUSTER_SCHEME):
        raise InvalidInputError(field, url, expected)
    nodes = []
    for part in url[len(CLUSTER_SCHEME) :].rstrip("/").split(","):
        host, _, port = part.strip().rpartition(":")
        if not host:
            raise InvalidInputError(field, url, expected)
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise InvalidInputError(field, url, f"port {port!r} is not 1-65535")
        nodes.append((host, int(port)))
    return nodes


def check_redis_url(url: object, field: str = "--redis-url") -> str:
    """``url`` if redis-py can connect with it, else an error naming ``field`` (URL redacted).

    The one check of every command, the worker and the replay: scheme, port
    (1-65535) and database index (a whole number, from the path or ``?db=``).
    Whether the server has that many databases only the server can say.

    >>> check_redis_url("redis://localhost:6379/0")
    'redis://localhost:6379/0'
    >>> check_redis_url("redis://:pw@localhost:99999/0")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: --redis-url: port 99999 is not 1-65535 \
(got 'redis://***@localhost:99999/0')
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError(field, url, _EXPECTED)
    if url.lower().startswith(CLUSTER_SCHEME):  # Redis Cluster: its seed nodes
        parse_cluster_url(url, field)
        return url
    shown = redact(url)
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ in an IPv6 host
        raise InvalidInputError(field, shown, _EXPECTED) from None
    if parts.scheme.lower() not in REDIS_SCHEMES:
        raise InvalidInputError(field, shown, _EXPECTED)
    try:
        query = dict(parse_qsl(parts.query))
    except ValueError:
        raise InvalidInputError(field, shown, "the query is not name=value&...") from None
    if parts.scheme.lower() == "unix":
        if not parts.path:
            raise InvalidInputError(field, shown, "expected unix:///path/to/redis.sock")
        db = query.get("db", "0")
    else:
        port_text = parts.netloc.rsplit("@", 1)[-1].rpartition("]")[2].partition(":")[2]
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise InvalidInputError(field, shown, f"port {port_text} is not 1-65535")
        path = parts.path.strip("/")
        db = query.get("db", path or "0")
    if not (db.isascii() and db.isdigit()):
        raise InvalidInputError(field, shown, f"database {db!r} is not a whole number")
    return url


def parse_bootstrap(url: str) -> str:
    """``kafka://h1:9092,h2:9092`` or ``h1:9092,h2:9092`` -> ``h1:9092,h2:9092``.

    >>> parse_bootstrap("kafka://k1:9092, k2:9092")
    'k1:9092,k2:9092'
    """
    text = url.strip()
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme != "kafka":
            raise InvalidInputError("bootstrap", url, "expected kafka://host:port[,host:port]")
    hosts = [h.strip() for h in text.rstrip("/").split(",") if h.strip()]
    if not hosts:
        raise InvalidInputError("bootstrap", url, "expected host:port[,host:port]")
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError("bootstrap", url, f"{host!r} is not host:port")
    return ",".join(hosts)


def check_http_url(url: object, field: str = "url") -> str:
    """``url`` if it is an http:// or https:// URL with a host, else an error naming ``field``.

    >>> check_http_url("https://hooks.example/alerts")
    'https://hooks.example/alerts'
    >>> check_http_url("ftp://hooks.example/")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: url: expected an http:// or https:// URL \
(got 'ftp://hooks.example/')
    """
    problem = "expected an http:// or https:// URL"
    if not isinstance(url, str):
        raise InvalidInputError(field, url, problem)
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises for a port out of range
    except ValueError:  # an unclosed [ in an IPv6 host, a port out of range
        ok = False
    if not ok:
        raise InvalidInputError(field, redact(url), problem)
    return url


#: Schemes libpq (psycopg) connects with.
POSTGRES_SCHEMES = ("postgresql", "postgres")
_PG_EXPECTED = "expected postgresql://user@host:port/database"


def check_postgres_url(url: object, field: str = "--postgres") -> str:
    """``url`` if it is a libpq URL with a usable port, else an error naming ``field``.

    >>> check_postgres_url("postgresql://postgres@127.0.0.1:5432/test")
    'postgresql://postgres@127.0.0.1:5432/test'
    >>> check_postgres_url("redis://localhost:6379/0")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: --postgres: expected \
postgresql://user@host:port/database (got 'redis://localhost:6379/0')
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError(field, url, _PG_EXPECTED)
    shown = redact(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidInputError(field, shown, _PG_EXPECTED) from None
    if parts.scheme.lower() not in POSTGRES_SCHEMES:
        raise InvalidInputError(field, shown, _PG_EXPECTED)
    if port is not None and not 1 <= port <= 65535:
        raise InvalidInputError(field, shown, f"port {port} is not 1-65535")
    return url
