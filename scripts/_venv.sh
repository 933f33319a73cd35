# Sourced by scripts/test and scripts/demo: make (or reuse) the project's
# virtual environment and install the project into it.
# MCPBG_VENV chooses the folder (default .venv); MCPBG_FRESH_VENV=1 rebuilds it.
set -euo pipefail
venv="${MCPBG_VENV:-.venv}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "mcp-budget-governor needs Python 3.11 or newer (set PYTHON=python3.12, say)" >&2
  exit 2
fi
if [[ "${MCPBG_FRESH_VENV:-0}" == 1 ]]; then rm -rf "$venv"; fi
stamp="$venv/.installed-$(cat pyproject.toml | "$python" -c 'import hashlib,sys; print(hashlib.sha1(sys.stdin.buffer.read()).hexdigest()[:12])')-${MCPBG_EXTRAS:-dev}"
if [[ ! -f "$stamp" ]]; then
  echo "==> setting up $venv (Python: $("$python" --version 2>&1))" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # The distribution was once called mcp-budget-governor (a name an unrelated project holds
  # on the index): an older venv's install of it would shadow this one's.
  "$venv/bin/python" -m pip uninstall --quiet --yes mcp-budget-governor >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install --quiet --editable ".[${MCPBG_EXTRAS:-dev}]"
  touch "$stamp"
fi
export PATH="$PWD/$venv/bin:$PATH"
