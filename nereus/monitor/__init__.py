"""nereus.monitor: the monitoring tap's event schema and subscriber (docs/design.md §8),
and the dashboard that draws a tap stream in a browser (``nereus dashboard``; the server
needs ``pip install 'nereus[dashboard]'``, importing this package does not)."""

from nereus.monitor.dashboard import Dashboard
from nereus.monitor.schema import EVENT_TYPES, SCHEMA_VERSION, check_event, describe
from nereus.monitor.tap import Subscriber, format_event, to_json
from nereus.monitor.view import DashboardView

__all__ = [
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "Dashboard",
    "DashboardView",
    "Subscriber",
    "check_event",
    "describe",
    "format_event",
    "to_json",
]
