"""A URL shown without its secrets: below the errors, which name URLs too."""

from __future__ import annotations

import re

# A password in the query (redis-py reads ``?password=``), up to the next parameter.
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` without its credentials (user info and ``?password=``), for logs and the screen.

    >>> redact("redis://:s3cret@cache:6379/15")
    'redis://***@cache:6379/15'
    >>> redact("redis://cache:6379/0?password=s3cret&ssl_cert_reqs=none")
    'redis://cache:6379/0?password=***&ssl_cert_reqs=none'
    >>> redact("redis://cache:6379/0")
    'redis://cache:6379/0'
    """
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    rest = _QUERY_PASSWORD.sub(r"\1***", rest)
    return f"{scheme}{sep}{rest}"
