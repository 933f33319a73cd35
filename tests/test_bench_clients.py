"""``benchmarks/bench_clients.py`` runs end to end (no timing is checked), and without
the ``bench-clients`` extra it names the extra and exits 2, with no traceback."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_clients


def test_a_missing_client_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.import_module

    def without_glide(name: str, *args: Any) -> Any:
        if name == "glide":
            raise ImportError("No module named 'glide'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_glide)
    assert bench_clients.main(["--redis", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    # coredis is named too where the extra is not installed at all (as in CI)
    assert "bench-clients extra (missing: " in err and "valkey-glide)" in err
    assert "Traceback" not in err


def test_every_client_answers_a_short_run(redis_url: str, tmp_path: Path) -> None:
    pytest.importorskip("coredis")
    pytest.importorskip("glide")
    out = tmp_path / "clients.json"
    argv = ["--redis", redis_url, "--calls", "20", "--rounds", "1", "--warmup", "5"]
    argv += ["--rate-calls", "2", "--trials", "1", "--json", str(out)]
    assert bench_clients.main(argv) == 0
    results = json.loads(out.read_text())
    assert not any(v["failed_checks"] for v in results["variants"].values())
    assert set(results["rates"]) == {*bench_clients.CLIENTS, "Governor.check (autopipe)"}
