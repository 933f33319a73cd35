"""An import-linter contract the tool does not ship: no module imports another that
imports it back (pyproject.toml, ``type = "acyclic_modules"``).

import-linter's own ``acyclic_siblings`` squashes each package into one node, so it
would also refuse packages that merely use each other (``cli`` and ``console``) and
miss nothing more; this one asks grimp's graph, per direct import ``a -> b``, whether
a chain leads from ``b`` back to ``a``. Imports under ``if TYPE_CHECKING:`` count: a
circle of types still means neither module can be read alone.
"""

from __future__ import annotations

from typing import Any

import grimp
from importlinter.application import contract_utils, output
from importlinter.application.contract_utils import AlertLevel
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"

    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=AlertLevel.ERROR,
        )
        roots = tuple(self.session_options["root_packages"])
        ours = sorted(m for m in graph.modules if m.split(".")[0] in roots)
        circles: list[dict[str, Any]] = []
        for importer in ours:
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if imported in ours and importer < imported:
                    back = graph.find_shortest_chain(importer=imported, imported=importer)
                    if back is not None:
                        circles.append({"there": (importer, imported), "back": back})
        return ContractCheck(
            kept=not circles,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"circles": circles},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for circle in check.metadata["circles"]:
            importer, imported = circle["there"]
            output.print_error(f"{importer} imports {imported}, which imports it back:")
            output.print(f"    {' -> '.join(circle['back'])}")
            output.new_line()
