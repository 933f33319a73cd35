"""The committed conformance vectors (``conformance/vectors.json``) are what the
Python implementation generates now: a Python-side change to keys, buckets,
money, prices, scripts, script arguments or refusals that was not regenerated
(and so not mirrored by the TypeScript package, which checks itself against
the file) fails here.

Regenerate with ``python conformance/generate.py > conformance/vectors.json``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "conformance" / "vectors.json"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mcpbg_conformance_generate", ROOT / "conformance" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diff(old: object, new: object, path: str = "") -> list[str]:
    """The paths where two JSON values differ (a few, to say what went stale)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            if key not in old or key not in new:
                out.append(f"{path}.{key}: only in {'new' if key in new else 'committed'}")
            else:
                out += _diff(old[key], new[key], f"{path}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = enumerate(zip(old, new, strict=True))
        return [d for i, (a, b) in pairs for d in _diff(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {json.dumps(old)[:120]} -> {json.dumps(new)[:120]}"]


def test_committed_vectors_are_current() -> None:
    fresh = _generator().render()
    committed = COMMITTED.read_text(encoding="utf-8")
    if fresh != committed:
        stale = _diff(json.loads(committed), json.loads(fresh))
        raise AssertionError(
            "conformance/vectors.json is stale (regenerate: python conformance/generate.py"
            " > conformance/vectors.json, then make ts/ pass): " + "; ".join(stale[:10])
        )


def test_a_changed_vector_is_detected() -> None:
    """The comparison is sensitive: one character changed in one key is reported."""
    vectors = json.loads(COMMITTED.read_text(encoding="utf-8"))
    changed = json.loads(json.dumps(vectors))
    changed["keys"][0]["key"] = changed["keys"][0]["key"].replace(":", ";", 1)
    assert _diff(vectors, changed) == [
        f".keys[0].key: {json.dumps(vectors['keys'][0]['key'])} -> "
        f"{json.dumps(changed['keys'][0]['key'])}"
    ]
