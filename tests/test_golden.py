"""The key scheme, buckets, expiries, money and prices match the committed golden vectors."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent / "golden"
# generate.py is a script (run by path to regenerate the vectors): load its function
# by path too, without putting tests/golden/ on sys.path.
vectors = runpy.run_path(str(HERE / "generate.py"))["vectors"]


@pytest.fixture(scope="module")
def pair() -> tuple[dict[str, Any], dict[str, Any]]:
    committed = json.loads((HERE / "vectors.json").read_text())
    return committed, json.loads(json.dumps(vectors()))


@pytest.mark.parametrize(
    "section", ["keys", "escape", "usd", "prices", "scripts", "caps", "leases"]
)
def test_contract_unchanged(pair: tuple[dict[str, Any], dict[str, Any]], section: str) -> None:
    committed, current = pair
    if committed[section] != current[section]:
        old, new = committed[section], current[section]
        if isinstance(old, list):
            diff = [(a, b) for a, b in zip(old, new, strict=False) if a != b][:3]
        else:
            diff = [
                (k, old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)
            ][:3]
        consequence = (
            "Replicas running the old scripts would disagree with the new ones; if the change "
            "is compatible, regenerate"
            if section == "scripts"
            else "Every live counter would reset; if intended, bump the key version and regenerate"
        )
        pytest.fail(
            f"the {section} contract changed (first differences: {diff}). {consequence}: "
            "python tests/golden/generate.py > tests/golden/vectors.json"
        )


def test_vectors_cover_the_contract(pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    committed, _ = pair
    assert len(committed["keys"]) >= 300
    assert all(k["key"].startswith("mcpbg:v1:") for k in committed["keys"])
    assert len({k["key"] for k in committed["keys"]}) > 100
