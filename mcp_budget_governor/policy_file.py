"""Policies written as TOML files, and the one way to name a policy: file or module.

The file format and its checks live in :mod:`~mcp_budget_governor.policy_toml`
(below :class:`Policy`, whose ``from_file`` reads through it); here they build a
:class:`Policy`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from . import policy_toml
from .errors import InvalidInputError
from .policy import Policy
from .policy_toml import LIMIT_KEYS as LIMIT_KEYS
from .policy_toml import KeyPath as KeyPath
from .policy_toml import PolicyFileError as PolicyFileError
from .policy_toml import locate as locate


def load_file(path: str | os.PathLike[str]) -> Policy:
    """Read and validate the policy file at ``path`` (TOML)."""
    return policy_toml.load_file(path, Policy.of)


def loads(text: str, *, source: str = "<policy>") -> Policy:
    """Validate the TOML policy ``text``; ``source`` names it in errors."""
    return policy_toml.loads(text, Policy.of, source=source)


def load_policy(spec: str | os.PathLike[str]) -> Policy:
    """The policy named by ``spec``: a ``.toml`` file, or ``package.module:attribute``.

    The same spec works for every command and the stream worker
    (``--policy`` / ``MCPBG_POLICY``).
    """
    text = os.fspath(spec).strip()
    if not text:
        raise InvalidInputError("policy", spec, "expected a .toml file or package.module:attribute")
    if text.lower().endswith(".toml") or os.sep in text or Path(text).is_file():
        return load_file(text)
    module_name, sep, attribute = text.partition(":")
    if not sep or not module_name or not attribute:
        raise InvalidInputError("policy", spec, "expected a .toml file or package.module:attribute")
    try:
        policy = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise InvalidInputError("policy", spec, f"cannot load it ({exc})") from None
    if not isinstance(policy, Policy):
        raise InvalidInputError("policy", spec, f"not a Policy but {type(policy).__name__}")
    return policy
