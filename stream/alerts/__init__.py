"""Budget alerts: threshold crossings and breaker trips, once per limit, scope, bucket and level.

After each applied batch the worker hands its charges to :class:`AlertEvaluator`,
which reads the touched counters once, claims each newly crossed level in a
shared :class:`Deduper` and queues the alerts for its sinks. The rules (levels,
once per bucket, delivery, the ``mcpbg.alert.v1`` event) are in ``docs/alerts.md``.

>>> import asyncio
>>> from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Unit, usd
>>> from mcp_budget_governor import Scope, Window
>>> from mcp_budget_governor.producers.memory_ledger import MemoryLedger
>>> policy = Policy.of(Limit("spend", cap=usd(10), window=Window.DAY, scope=Scope.USER,
...                          unit=Unit.USD_MICROS, gated=False, alert_at=[50, 80]))
>>> backend, ledger = MemoryBackend(), MemoryLedger()
>>> gov = Governor(policy, backend, ledger=ledger)
>>> evaluator = AlertEvaluator(policy, backend, dedupe=MemoryDeduper())
>>> async def spend(amount):  # what the worker does with each batch it applied
...     await gov.meter("spend", amount, Context(user="alice"))
...     await ledger.project(backend)
...     fired = await evaluator.evaluate(ledger.entries[-1].charges)
...     return [(a.kind, a.level, a.scope) for a in fired]
>>> asyncio.run(spend(usd(9)))  # 0 -> 90 %: every level crossed fires, in order
[('threshold', 50, 'user=alice'), ('threshold', 80, 'user=alice')]
>>> asyncio.run(spend(usd(1)))  # already fired in this bucket: nothing new
[]
"""

from .dedupe import Deduper, Mark, MemoryDeduper, RedisDeduper
from .evaluator import AlertEvaluator, ChargeRef
from .event import ALERT_SOURCE, ALERT_TYPE, Alert, AlertEvent, parse_alert
from .levels import ALERTED_PREFIX, AlertKind, alert_levels, marker_key
from .sinks import (
    DEFAULT_ALERT_TOPIC,
    AlertDeliveryError,
    AlertDispatcher,
    AlertSink,
    LogSink,
    TopicProducer,
    TopicSink,
    WebhookSink,
)
from .store import ALERT_LOG_KEY, RedisLogSink, alert_row, latest_alerts

__all__ = [
    "ALERTED_PREFIX",
    "ALERT_LOG_KEY",
    "ALERT_SOURCE",
    "ALERT_TYPE",
    "DEFAULT_ALERT_TOPIC",
    "Alert",
    "AlertDeliveryError",
    "AlertDispatcher",
    "AlertEvaluator",
    "AlertEvent",
    "AlertKind",
    "AlertSink",
    "ChargeRef",
    "Deduper",
    "LogSink",
    "Mark",
    "MemoryDeduper",
    "RedisDeduper",
    "RedisLogSink",
    "TopicProducer",
    "TopicSink",
    "WebhookSink",
    "alert_levels",
    "alert_row",
    "latest_alerts",
    "marker_key",
    "parse_alert",
]
