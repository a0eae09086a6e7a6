"""nereus.monitor: the monitoring tap's event schema and subscriber (DESIGN.md section 8)."""

from nereus.monitor.schema import EVENT_TYPES, SCHEMA_VERSION, check_event, describe
from nereus.monitor.tap import Subscriber, format_event, to_json

__all__ = ["EVENT_TYPES", "SCHEMA_VERSION", "Subscriber", "check_event", "describe",
           "format_event", "to_json"]
