"""The committed event vectors (conformance/events.json, events.schema.json) are what the
Python implementation makes now: a Python-side change nobody mirrored fails here, and the
TypeScript suite (ts/test/ledgerEvents.test.ts) checks its encoder against the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from mcp_budget_governor.events import json_schemas, parse

GENERATOR = Path(__file__).resolve().parent.parent / "conformance" / "events.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conformance_events", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_event_vectors_are_fresh() -> None:
    gen = _generator()
    events, schema = gen.render()
    assert gen.EVENTS.read_text(encoding="utf-8") == events, (
        "conformance/events.json is stale: run .venv/bin/python conformance/events.py"
    )
    assert gen.SCHEMA.read_text(encoding="utf-8") == schema, (
        "conformance/events.schema.json is stale: run .venv/bin/python conformance/events.py"
    )


def test_vectors_cover_every_kind_and_parse() -> None:
    data = json.loads((GENERATOR.parent / "events.json").read_text(encoding="utf-8"))
    types = {v["type"] for v in data["vectors"]}
    assert types == set(json_schemas())
    for v in data["vectors"]:
        assert parse(v["event"]).id == v["entry"]["id"]
