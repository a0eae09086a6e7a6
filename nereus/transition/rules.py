"""Which global rules a transition DAG is built and scheduled under (DESIGN §5).

The three rules that join model-stages' local DAGs into one:

- ``release_first``: among ready nodes, one that allocates nowhere (a Destroy, a node
  that only frees) starts before one that acquires memory;
- ``stage_order``: ties between model-stages broken generation, inference, training;
- ``resource_edges``: ``build_dag`` makes an acquisition blocked on a device's memory
  wait for a Destroy on that device that it does not reach.

All three are on by default (``ALL_RULES``); a job always runs with all of them. Turning
one off exists to show what it is for: the tests that run a DAG without it on real
workers and see it deadlock or overflow a worker's ledger. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.config import require

__all__ = ["ALL_RULES", "Rules"]


@dataclass(frozen=True)
class Rules:
    """The global rules that apply (see the module docstring)."""

    release_first: bool = True
    """A ready node that allocates nowhere starts before one that acquires memory."""
    stage_order: bool = True
    """Ties between model-stages broken generation, then inference, then training."""
    resource_edges: bool = True
    """An acquisition blocked on a device's memory waits for a Destroy on that device."""

    def without(self, rule: str) -> Rules:
        """These rules with ``rule`` (a field name) off; ``ConfigError`` for an unknown one."""
        require(
            rule in self.__dataclass_fields__,
            "rule",
            rule,
            f"must be one of {sorted(self.__dataclass_fields__)}",
        )
        return Rules(**{**vars(self), rule: False})


ALL_RULES = Rules()
