# Sourced by scripts/typecheck and scripts/lint-imports, from the repository root: a view
# of the installed layout in $view (.venv/typecheck/, never in the repository), made of
# links by scripts/package_view.py. The top-level folders (producers/, stream/,
# projections/, lua/, sql/, edges/*) install as mcp_budget_governor.<name> through
# pyproject's package-dir, which neither mypy nor the import graph can follow in an
# editable install (they read no import hooks). $mapped holds "view-path folder" lines.
view="${MCPBG_VENV:-.venv}/typecheck"
mapfile -t mapped < <(python scripts/package_view.py "$view")
