"""nereus.monitor: the monitoring tap's event schema and subscriber (DESIGN.md section 8),
and the fold of a tap stream into what a dashboard draws."""

from nereus.monitor.schema import EVENT_TYPES, SCHEMA_VERSION, check_event, describe
from nereus.monitor.tap import Subscriber, format_event, to_json
from nereus.monitor.view import DashboardView

__all__ = ["EVENT_TYPES", "SCHEMA_VERSION", "DashboardView", "Subscriber", "check_event", "describe",
           "format_event", "to_json"]
