"""``python -m mcp_budget_governor.cli``: the same as ``mcpbg``."""

import sys

from . import main

sys.exit(main())
