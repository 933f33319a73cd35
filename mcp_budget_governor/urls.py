"""Service URLs as people may see them."""

from __future__ import annotations


def redact(url: str) -> str:
    """``url`` without its credentials, for logs and the screen.

    >>> redact("redis://:s3cret@cache:6379/15")
    'redis://***@cache:6379/15'
    >>> redact("redis://cache:6379/0")
    'redis://cache:6379/0'
    """
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"
