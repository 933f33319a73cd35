"""Bearer tokens for ``mcpbg serve``: read and write, from the settings, compared in
constant time.

Each token comes from its variable (``MCPBG_READ_TOKEN``) or a file named by
``MCPBG_READ_TOKEN_FILE`` (the file wins; surrounding whitespace is dropped).
The write token may also read. No token configured: nothing is allowed.

>>> t = Tokens.from_env({"MCPBG_READ_TOKEN": "r" * 24, "MCPBG_WRITE_TOKEN": "w" * 24})
>>> t.allows("Bearer " + "r" * 24, write=False), t.allows("Bearer " + "r" * 24, write=True)
(True, False)
>>> t.allows("Bearer nope", write=False), t.allows(None, write=False)
(False, False)
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInputError
from ..settings import SETTINGS, resolve

#: Shorter tokens are refused at start: they can be guessed.
MIN_LENGTH = 16


def variables() -> str:
    """The token variables, for help texts: ``MCPBG_READ_TOKEN / MCPBG_WRITE_TOKEN (or ...)``."""
    read, write = SETTINGS["read_token"].env, SETTINGS["write_token"].env
    return f"{read} / {write} (or their _FILE variables)"


@dataclass(frozen=True, slots=True)
class Tokens:
    read: str
    write: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: str | None) -> Tokens:
        names = ["read_token", "read_token_file", "write_token", "write_token_file"]
        values = resolve(names, environ, given)
        out = []
        for kind in ("read", "write"):
            token = values[f"{kind}_token"] or ""
            path = values[f"{kind}_token_file"] or ""
            if path:
                try:
                    token = Path(path).read_text("utf-8").strip()
                except OSError as exc:
                    raise InvalidInputError(
                        SETTINGS[f"{kind}_token_file"].env, path, f"cannot be read: {exc.strerror}"
                    ) from None
            if token and len(token) < MIN_LENGTH:
                raise InvalidInputError(
                    SETTINGS[f"{kind}_token"].env, "<hidden>", f"at least {MIN_LENGTH} characters"
                )
            out.append(token)
        if not out[0] and not out[1]:
            raise InvalidInputError(
                "token",
                None,
                f"mcpbg serve needs a token: set {SETTINGS['read_token'].env} and "
                f"{SETTINGS['write_token'].env} (or their _FILE variables)",
            )
        if out[0] and out[0] == out[1]:
            # Every reader could write: the two tokens exist to tell them apart.
            raise InvalidInputError(
                SETTINGS["read_token"].env,
                "<hidden>",
                f"the same as {SETTINGS['write_token'].env}: give readers a token of their own",
            )
        return cls(out[0], out[1])

    def level(self, authorization: str | None) -> str | None:
        """``"write"``, ``"read"`` or None (missing or wrong) for an Authorization header."""
        # The scheme's name is case-insensitive (RFC 9110 11.1): "bearer" is "Bearer".
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        given = authorization[7:].strip().encode()
        # Both compared every time, each in constant time.
        write = bool(self.write) and hmac.compare_digest(given, self.write.encode())
        read = bool(self.read) and hmac.compare_digest(given, self.read.encode())
        if write:
            return "write"
        return "read" if read else None

    def allows(self, authorization: str | None, *, write: bool) -> bool:
        level = self.level(authorization)
        return level == "write" if write else level is not None
