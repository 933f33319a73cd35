"""``--api URL``: the CLI's commands over a running ``mcpbg serve``, same JSON.

The token is the write token for writes, else the read token (the settings
``write_token`` / ``read_token`` or their files); an error reply is one line
naming the field and the value, as the server said it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..errors import GovernorError, InvalidInputError


def _token(write: bool) -> str:
    from ..console.auth import Tokens

    tokens = Tokens.from_env()
    token = tokens.write if write else (tokens.read or tokens.write)
    if not token:
        from ..settings import SETTINGS

        env = SETTINGS["write_token"].env
        raise InvalidInputError("token", None, f"this needs {env} (or its file)")
    return token


def _call(url: str, method: str, path: str, body: Any = None, *, write: bool) -> Any:
    if not url.startswith(("http://", "https://")):
        raise InvalidInputError("--api", url, "expected http(s)://host:port")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url.rstrip("/") + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {_token(write)}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read())
        except ValueError:
            err = {"error": exc.reason}
        if "field" in err:
            raise InvalidInputError(err["field"], err.get("value"), err["error"]) from None
        raise GovernorError(f"--api {url}: HTTP {exc.code}: {err.get('error')}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise GovernorError(f"--api {url}: cannot be reached ({exc})") from None


def get_json(url: str, path: str, params: dict[str, Any] | None = None) -> Any:
    query = {k: v for k, v in (params or {}).items() if v is not None}
    return _call(
        url, "GET", path + (f"?{urllib.parse.urlencode(query)}" if query else ""), write=False
    )


def send_json(url: str, method: str, path: str, body: Any) -> Any:
    return _call(url, method, path, body, write=True)
