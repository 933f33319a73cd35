# Sourced by scripts/typecheck and scripts/lint-imports, from the repository root: a view
# of the installed layout in $view (.venv/typecheck/, never in the repository), made of
# links. The top-level folders (producers/, stream/, projections/, lua/, sql/) install as
# mcp_budget_governor.<folder> through pyproject's package-dir, which neither mypy nor the
# import graph can follow in an editable install (they read no import hooks).
view="${MCPBG_VENV:-.venv}/typecheck"
rm -rf "$view"
mkdir -p "$view/mcp_budget_governor"
for entry in mcp_budget_governor/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$PWD/$entry" "$view/$entry"
done
folders=(producers stream projections lua sql)
for folder in "${folders[@]}"; do
  ln -s "$PWD/$folder" "$view/mcp_budget_governor/$folder"
done
