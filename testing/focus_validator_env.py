"""The official FinOps ``focus-validator`` in its own virtual environment, for the tests.

``focus-validator`` 2.2.1 (the newest release that checks FOCUS 1.2 offline)
needs Python >= 3.12 and ``pyarrow<26``, while the project runs on 3.11 with
pyarrow 26, so it gets a virtual environment of its own:

- :func:`ensure_env` creates it on first use (about 30 s, pip needs PyPI) in
  pytest's cache folder, ``.pytest_cache/focus-validator-venv`` (already
  gitignored; ``MCPBG_FOCUS_VENV`` overrides the place), and reuses it
  afterwards. A lock file keeps two test
  processes from building it at once; a marker file written last says it is
  complete, so a build killed half way is redone.
- The interpreter is found, in this order: ``MCPBG_FOCUS_PYTHON``,
  ``python3.12`` / ``python3.13`` / ``python3`` on the PATH, then every Python
  >= 3.12 that pyenv has installed (a pyenv shim for a version that is not
  selected fails to run, so each candidate is tried, not just found).
- :func:`validate` runs this very file with that interpreter (the ``__main__``
  part below, which imports only the standard library and the validator). The
  validator opens ``focus_validator/rules/currency_codes.csv`` relative to the
  working directory, so it runs from its site-packages folder; its exit code
  is 0 even when rules fail, so the runner reads its results through the
  Python API and prints them as JSON.

A *real* failure is a failed, not skipped, rule that no passing OR rule
excuses: a rule such as ``InvoiceId-C-003-C`` is satisfied by either of its
children (null, or not null), so one of them always fails on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

VALIDATOR = "focus-validator==2.2.1"
#: pyarrow 26 dropped what the validator's pandas/polars stack expects.
PYARROW = "pyarrow<26"
ROOT = Path(__file__).resolve().parent.parent
MIN_VERSION = (3, 12)

#: The provider features our export claims (they switch on the conditional columns).
#: Not PUBLIC_PRICE_LIST_SUPPORTED, although the list prices are public: 2.2.1
#: applies a rule when *any* of its criteria is claimed, so that one alone would
#: demand the virtual-currency columns (PricingCurrency*, CostAndUsage-D-047-C),
#: which belong to providers that price in another currency than they bill.
#: UNIT_PRICING_SUPPORTED switches the Sku* rules on all the same.
APPLICABILITY = (
    "USAGE_MEASUREMENT_SUPPORTED",
    "UNIT_PRICING_SUPPORTED",
    "SUB_ACCOUNT_SUPPORTED",
    "TAGGING_SUPPORTED",
)


class FocusEnvError(RuntimeError):
    """The validator's environment could not be found or built."""


@dataclass
class Report:
    """What the validator said about one file."""

    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # rule id -> message
    excused: list[str] = field(default_factory=list)  # failed, but an OR parent passed

    @property
    def real_failures(self) -> dict[str, str]:
        """Failed rules that no passing OR rule excuses."""
        return {rid: msg for rid, msg in self.failed.items() if rid not in self.excused}


def venv_dir() -> Path:
    """Where the validator's virtual environment lives."""
    return Path(os.environ.get("MCPBG_FOCUS_VENV", ROOT / ".pytest_cache" / "focus-validator-venv"))


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


def _candidates() -> list[str]:
    found: list[str] = []
    if env := os.environ.get("MCPBG_FOCUS_PYTHON"):
        found.append(env)
    for name in ("python3.12", "python3.13", "python3.14", "python3"):
        if path := shutil.which(name):
            found.append(path)
    roots = [os.environ.get("PYENV_ROOT"), str(Path.home() / ".pyenv")]
    if pyenv := shutil.which("pyenv"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pyenv, "root"], capture_output=True, text=True, timeout=30, check=False
            )
            roots.insert(0, out.stdout.strip())
    for root in filter(None, roots):
        found += sorted(glob.glob(os.path.join(root, "versions", "3.1[2-9]*", "bin", "python3")))
    return list(dict.fromkeys(found))


def find_python() -> str:
    """A Python >= 3.12 interpreter that runs; raises :class:`FocusEnvError` if none."""
    tried = _candidates()
    for python in tried:
        version = _version_of(python)
        if version is not None and version >= MIN_VERSION:
            return python
    raise FocusEnvError(
        f"focus-validator needs Python >= 3.12; none found (tried {tried or 'nothing'}); "
        "install one (e.g. pyenv install 3.12) or set MCPBG_FOCUS_PYTHON"
    )


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_env(log: bool = True) -> Path:
    """The validator's interpreter, building its virtual environment on first use."""
    venv = venv_dir()
    marker = venv / ".mcpbg-ready"
    wanted = f"{VALIDATOR} {PYARROW}\n"
    if marker.is_file() and marker.read_text() == wanted:
        return _venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f".{venv.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
        if marker.is_file() and marker.read_text() == wanted:
            return _venv_python(venv)
        python = find_python()
        if log:
            print(
                f"building the focus-validator environment in {venv} with {python} "
                f"({VALIDATOR}, {PYARROW}; once, about 30 s)",
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(venv, ignore_errors=True)
        steps = [
            [python, "-m", "venv", str(venv)],
            [str(_venv_python(venv)), "-m", "pip", "install", "-q", VALIDATOR, PYARROW],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
                raise FocusEnvError(f"{' '.join(step)} failed: " + " | ".join(tail))
        marker.write_text(wanted)
    return _venv_python(venv)


def validate(path: str | Path, applicability: tuple[str, ...] = APPLICABILITY) -> Report:
    """Run focus-validator (FOCUS 1.2, CostAndUsage) on a CSV or Parquet file."""
    python = ensure_env()
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import focus_validator, os; print(os.path.dirname(focus_validator.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    done = subprocess.run(
        [
            str(python),
            str(Path(__file__).resolve()),
            str(Path(path).resolve()),
            ",".join(applicability),
        ],
        cwd=str(Path(site).parent),  # rules/currency_codes.csv is opened relative to the cwd
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise FocusEnvError(f"focus-validator runner failed: {done.stderr.strip()[-2000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return Report(**data)


# --- the runner, executed by the validator's own interpreter -----------------


def _or_children(requirement: object) -> list[str]:
    """Rule ids referenced directly by an OR requirement (possibly nested in AND/OR)."""
    out: list[str] = []
    if isinstance(requirement, dict):
        if requirement.get("CheckFunction") == "OR":
            for item in requirement.get("Items", []):
                if isinstance(item, dict) and item.get("CheckFunction") == "CheckModelRule":
                    out.append(item["ModelRuleId"])
        for item in requirement.get("Items", []) or []:
            out += _or_children(item)
    return out


def _run(path: str, criteria: str) -> dict[str, object]:  # pragma: no cover - other interpreter
    import logging

    from focus_validator.validator import Validator

    logging.disable(logging.CRITICAL)
    with contextlib.redirect_stdout(sys.stderr):  # its console outputter prints
        validator = Validator(
            data_filename=path,
            output_destination=None,
            output_type="console",
            rules_version="1.2",
            focus_dataset="CostAndUsage",
            rules_block_remote_download=True,
            applicability_criteria=criteria,
        )
        results = validator.validate()
    passed, skipped, failed = [], [], {}
    for rid, entry in results.by_rule_id.items():
        details = entry.get("details") or {}
        if details.get("skipped"):
            skipped.append(rid)
        elif entry.get("ok"):
            passed.append(rid)
        else:
            message = details.get("message") or details.get("reason") or "failed"
            failed[rid] = f"{message} (violations={details.get('violations', '?')})"
    excused = []
    for rid, rule in results.rules.items():
        if rid in passed:
            requirement = rule.validation_criteria.requirement
            excused += [child for child in _or_children(requirement) if child in failed]
    return {
        "passed": sorted(passed),
        "skipped": sorted(skipped),
        "failed": failed,
        "excused": sorted(set(excused)),
    }


if __name__ == "__main__":  # pragma: no cover - runs in the validator's interpreter
    print(json.dumps(_run(sys.argv[1], sys.argv[2])))
