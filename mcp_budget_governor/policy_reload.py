"""Reload a policy file while serving: on SIGHUP, or when its modification time changes.

The rule is pure: :func:`due` says whether to read the file again, and
:func:`load_or_keep` turns a load into the policy to use, keeping the current
one when the new file is invalid (the error, with its line, is returned).
:class:`PolicyWatcher` is the thin adapter: it stats the file, logs, hands a
new policy to its ``apply`` callback (``Governor.replace_policy``, the
worker's), and runs as an asyncio task with a SIGHUP handler.

>>> import tempfile
>>> from mcp_budget_governor import Governor
>>> path = Path(tempfile.mkdtemp()) / "policy.toml"
>>> _ = path.write_text('[[limits]]\\nname = "calls"\\ncap = 5\\nwindow = "day"\\n')
>>> gov = Governor(Policy.from_file(path))
>>> watcher = PolicyWatcher(path, gov.replace_policy, current=gov.policy)
>>> _ = path.write_text('[[limits]]\\nname = "calls"\\ncap = 9\\nwindow = "day"\\n')
>>> watcher.check(force=True).reloaded, gov.policy["calls"].cap
(True, 9)
>>> _ = path.write_text('[[limits]]\\nname = "calls"\\ncap = -1\\nwindow = "day"\\n')
>>> outcome = watcher.check(force=True)  # logged as an error; the old policy stays
>>> outcome.reloaded, gov.policy["calls"].cap, str(outcome.error).split(": ")[1:3]
(False, 9, ['limits[0].cap', 'must be non-negative (got -1)'])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .errors import InvalidInputError
from .policy import Policy
from .policy_file import load_file
from .settings import SETTINGS, resolve

log = logging.getLogger("mcp_budget_governor.policy")

#: Environment variable: seconds between two looks at the policy file (0: SIGHUP only).
POLL_ENV = SETTINGS["policy_poll"].env
DEFAULT_POLL_SECONDS: float = SETTINGS["policy_poll"].default


@dataclass(frozen=True, slots=True)
class Stamp:
    """What identifies one version of a file: a rename over it changes the inode."""

    mtime_ns: int
    size: int
    inode: int
    device: int


def stamp(path: str | os.PathLike[str]) -> Stamp | None:
    """The file's :class:`Stamp`, None while it does not exist (mid-rename, deleted)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Stamp(st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def due(seen: Stamp | None, now: Stamp | None, *, forced: bool = False) -> bool:
    """Whether to read the file again: asked to (SIGHUP), or another version is there.

    A missing file is never due by polling (the previous policy stays, quietly);
    a forced reload reads it anyway, so a missing file is reported.

    >>> a, b = Stamp(1, 10, 7, 1), Stamp(2, 10, 7, 1)
    >>> due(a, a), due(a, b), due(a, None), due(a, a, forced=True)
    (False, True, False, True)
    """
    if forced:
        return True
    return now is not None and now != seen


@dataclass(frozen=True, slots=True)
class Outcome:
    """The policy to use after a reload attempt; ``error`` says why the file was refused."""

    policy: Policy
    reloaded: bool
    error: InvalidInputError | None = None


def load_or_keep(current: Policy, load: Callable[[], Policy]) -> Outcome:
    """The policy ``load`` returns, or ``current`` with the error when it refuses.

    ``reloaded`` is false for an unchanged policy too: nothing to swap.

    >>> old = Policy.of()
    >>> def bad() -> Policy:
    ...     raise InvalidInputError("policy", "x.toml", "no such file")
    >>> load_or_keep(old, bad).policy is old, load_or_keep(old, lambda: Policy.of()).reloaded
    (True, False)
    """
    try:
        new = load()
    except InvalidInputError as exc:  # PolicyFileError included: it carries the line
        return Outcome(current, False, exc)
    return Outcome(new, new != current)


def poll_interval(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between polls, the ``policy_poll`` setting (default 5; 0 turns polling off).

    >>> poll_interval({"MCPBG_POLICY_POLL": "0.5"}), poll_interval({})
    (0.5, 5.0)
    """
    value: float = resolve(["policy_poll"], environ)["policy_poll"]
    return value


def reloadable(spec: str | os.PathLike[str]) -> bool:
    """Whether ``spec`` (``--policy``) names a file that can be watched, not a module."""
    return os.fspath(spec).strip().lower().endswith(".toml")


def watcher_for(
    spec: str | os.PathLike[str] | None,
    apply: Callable[[Policy], object],
    current: Policy | None,
    interval: float = DEFAULT_POLL_SECONDS,
) -> PolicyWatcher | None:
    """A watcher of the policy file ``spec`` names, polling every ``interval`` seconds
    (0: SIGHUP only); None when there is nothing to watch (no policy, or a
    ``module:attribute``)."""
    if not spec or current is None or not reloadable(spec):
        return None
    return PolicyWatcher(spec, apply, current=current, interval=interval)


class PolicyWatcher:
    """Watches one policy file and applies each valid new version once.

    - ``apply`` receives each new policy (``governor.replace_policy``);
    - ``current`` is the policy in force (None: the file is loaded now);
    - ``interval``: seconds between polls of the modification time, None or 0
      for none (then only :meth:`check` and SIGHUP reload).

    ``async with watcher:`` (or :meth:`start` / :meth:`stop`) runs the polling
    task and, on the main thread of a POSIX process, a SIGHUP handler.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        apply: Callable[[Policy], object],
        *,
        current: Policy | None = None,
        interval: float | None = DEFAULT_POLL_SECONDS,
        logger: logging.Logger = log,
    ) -> None:
        self.path = Path(path)
        self._apply = apply
        self._seen = stamp(self.path)  # before loading: a change made meanwhile is seen next
        self.policy = load_file(self.path) if current is None else current
        self.interval = interval or None
        self.log = logger
        self.reloads = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def check(self, *, force: bool = False) -> Outcome | None:
        """Reload if :func:`due`; None when the file was not read."""
        now = stamp(self.path)
        if not due(self._seen, now, forced=force):
            return None
        self._seen = now
        outcome = load_or_keep(self.policy, lambda: load_file(self.path))
        if outcome.error is not None:
            self.failures += 1
            err = outcome.error
            self.log.error(
                "policy: kept the previous policy, %s is invalid: %s",
                self.path,
                err,
                extra={"policy_field": err.field, "policy_line": getattr(err, "line", None)},
            )
        elif outcome.reloaded:
            self._apply(outcome.policy)
            self.policy = outcome.policy
            self.reloads += 1
            self.log.info("policy: reloaded %s (%d limits)", self.path, len(outcome.policy.limits))
        return outcome

    async def _poll(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._safe_check(force=False)

    def _safe_check(self, *, force: bool) -> None:
        # A failing ``apply`` must not end the polling task (or escape a signal handler).
        try:
            self.check(force=force)
        except Exception:
            self.failures += 1
            self.log.exception("policy: reloading %s failed; the previous policy stays", self.path)

    def start(self, *, sighup: bool = True) -> PolicyWatcher:
        """Start polling (if an interval is set) and, with ``sighup``, reload on SIGHUP."""
        loop = asyncio.get_running_loop()
        if self.interval is not None and self._task is None:
            self._task = loop.create_task(self._poll(self.interval))
        if sighup and self._loop is None and hasattr(signal, "SIGHUP"):
            try:
                loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
                self._loop = loop
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                self.log.info("policy: no SIGHUP handler here; reloads by polling only")
        return self

    def _on_sighup(self) -> None:
        self._safe_check(force=True)

    async def stop(self) -> None:
        """Stop polling and give SIGHUP back its default."""
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGHUP)
            self._loop = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> PolicyWatcher:
        return self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
