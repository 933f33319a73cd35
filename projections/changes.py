"""Run-time caps, plan assignments and grants, read from the counters' store as rows:
what ``mcpbg caps list --json`` prints and ``GET /v1/caps`` returns."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from mcp_budget_governor.caps import CAPS_PREFIX, field_value, why_from
from mcp_budget_governor.keys import parse_key
from mcp_budget_governor.money import Unit, format_usd
from mcp_budget_governor.policy import Policy

__all__ = ["change_rows"]


async def change_rows(policy: Policy, backend: Any) -> list[dict[str, Any]]:
    """Run-time caps, plan assignments and grants as ``caps list --json`` prints them
    (and ``GET /v1/caps`` returns them)."""
    caps, plans = await backend.overrides()
    grants = await backend.grants(10_000)
    rows: list[dict[str, Any]] = []
    for key, fields in sorted(caps.items()):
        limit = key.removeprefix(f"{CAPS_PREFIX}:")
        money = limit in policy and policy[limit].unit is Unit.USD_MICROS
        for field, (cap, until, why) in sorted(fields.items()):
            actor, reason = why_from(why)
            rows.append(
                {
                    "kind": "cap",
                    "limit": limit,
                    "scope": field,
                    "cap": cap,
                    "shown": format_usd(cap) if money else f"{cap:,}",
                    "until": None if not until else _iso(until),
                    "expired": bool(until) and until <= time.time(),
                    "actor": actor,
                    "reason": reason,
                }
            )
    for field, plan in sorted(plans.items()):
        dim, value = field_value(field)
        rows.append({"kind": "plan", "scope": field, dim: value, "plan": plan})
    for key, grant, why in grants:
        parsed = parse_key(key)
        limit = parsed.limit if parsed else key
        money = limit in policy and policy[limit].unit is Unit.USD_MICROS
        actor, reason = why_from(why)
        rows.append(
            {
                "kind": "grant",
                "limit": limit,
                "scope": parsed.scope if parsed else "",
                "bucket": parsed.bucket if parsed else "",
                "grant": grant,
                "shown": format_usd(grant) if money else f"{grant:,}",
                "actor": actor,
                "reason": reason,
            }
        )
    return rows


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
