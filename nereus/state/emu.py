"""The Elastic Model Unit: one replica of one model-stage, as a description.

An ``EMU`` is (model-stage, layout, devices, parameter shards, optimizer shards,
logical state). TP and PP live inside it; DP is the number of EMUs of a model-stage.
The shards are not stored here: they follow from the ``ModelSpec``, the ``Layout`` and
the ``slots`` the EMU carries (``"param"`` plus, for a training EMU, the Adam moments
and master weights, which follow their parameter's layout exactly).

Every tensor an EMU holds has a *key*: the parameter name for ``"param"``, and
``"<name>:<slot>"`` for an optimizer slot (``"layers.0.mlp.up.weight:exp_avg"``).

``DeviceSet`` says which host each device is on (source choice prefers the same
device, then the same host) and, optionally, each device's memory budget.

Promises: pure descriptions (frozen dataclasses), no I/O, no torch.
Refuses (``ConfigError``/``StateError``): a device list whose length is not tp * pp,
a device listed twice, a layout that does not fit the model, an unknown slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from nereus.config import from_dict, require, to_dict
from nereus.errors import ConfigError
from nereus.state.layout import Layout, Shard, check_layout, holds_param, param_shard
from nereus.state.spec import DTYPE_BYTES, MOMENT_SLOTS, SLOT_DTYPE, ModelSpec, ParamSpec

__all__ = [
    "SLOTS",
    "OPTIMIZER_SLOTS",
    "DeviceSet",
    "LogicalState",
    "EMU",
    "tensor_key",
    "split_key",
    "emu_to_plain",
    "emu_from_plain",
]

# Every optimizer slot the state layer knows; which ones a training EMU holds follows
# from its parameters' dtype (``nereus.state.spec.training_slots``).
OPTIMIZER_SLOTS: tuple[str, ...] = (*MOMENT_SLOTS, "master")
SLOTS: tuple[str, ...] = ("param", *OPTIMIZER_SLOTS)


def tensor_key(slot: str, name: str) -> str:
    return name if slot == "param" else f"{name}:{slot}"


def split_key(key: str) -> tuple[str, str]:
    """(slot, parameter name) of a tensor key."""
    name, sep, slot = key.rpartition(":")
    return (slot, name) if sep else ("param", key)


@dataclass(frozen=True)
class DeviceSet:
    """Device index -> host id, and optionally device index -> memory budget (bytes)."""

    hosts: tuple[int, ...]
    memory_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "memory_bytes", tuple(self.memory_bytes))
        require(
            len(self.hosts) >= 1, "DeviceSet.hosts", self.hosts, "must list at least one device"
        )
        require(
            not self.memory_bytes or len(self.memory_bytes) == len(self.hosts),
            "DeviceSet.memory_bytes",
            self.memory_bytes,
            f"must be empty or list {len(self.hosts)} budgets",
        )

    @classmethod
    def single_host(cls, n: int, memory_bytes: int | None = None) -> DeviceSet:
        return cls((0,) * n, (memory_bytes,) * n if memory_bytes is not None else ())

    def host(self, device: int) -> int:
        if not 0 <= device < len(self.hosts):
            raise ConfigError(
                f"device={device} is not in the DeviceSet of {len(self.hosts)} devices"
            )
        return self.hosts[device]

    def budget(self, device: int) -> int | None:
        self.host(device)
        return self.memory_bytes[device] if self.memory_bytes else None

    def __len__(self) -> int:
        return len(self.hosts)


@dataclass(frozen=True)
class LogicalState:
    """What must survive every transition besides tensors."""

    update_count: int = 0
    policy_version: int = 0
    sample_position: int = 0

    def __post_init__(self) -> None:
        for name in ("update_count", "policy_version", "sample_position"):
            v = getattr(self, name)
            require(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                f"LogicalState.{name}",
                v,
                "must be an integer >= 0",
            )


@dataclass(frozen=True, eq=False)
class EMU:
    """One replica of ``model_stage``: ``devices[i]`` holds position ``layout.position(i)``.

    ``name`` identifies the EMU among every EMU alive (shard stores are keyed by it)."""

    name: str
    model_stage: str
    spec: ModelSpec
    layout: Layout
    devices: tuple[int, ...]
    slots: tuple[str, ...] = ("param",)
    state: LogicalState = field(default_factory=LogicalState)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "slots", tuple(self.slots))
        require(bool(self.name), "EMU.name", self.name, "must be non-empty")
        require(
            len(self.devices) == self.layout.size,
            f"EMU({self.name}).devices",
            self.devices,
            f"must list tp*pp={self.layout.size} devices for layout {self.layout}",
        )
        require(
            len(set(self.devices)) == len(self.devices),
            f"EMU({self.name}).devices",
            self.devices,
            "must not list a device twice",
        )
        require(
            all(isinstance(d, int) for d in self.devices),
            f"EMU({self.name}).devices",
            self.devices,
            "must be integers",
        )
        require(
            self.slots[:1] == ("param",)
            and all(s in SLOTS for s in self.slots)
            and len(set(self.slots)) == len(self.slots),
            f"EMU({self.name}).slots",
            self.slots,
            f"must start with 'param' and be distinct names from {list(SLOTS)}",
        )
        check_layout(self.spec, self.layout)

    def __repr__(self) -> str:
        return (
            f"EMU({self.name!r}, {self.model_stage}, {self.layout}, devices={list(self.devices)})"
        )

    def with_(self, **changes) -> EMU:
        """A copy with some fields changed (``name``, ``layout``, ``devices``, ``state``)."""
        return replace(self, **changes)

    def position(self, device: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of ``device`` in this EMU."""
        try:
            return self.layout.position(self.devices.index(device))
        except ValueError:
            raise ConfigError(f"device={device} is not a device of {self!r}") from None

    def device_at(self, pp_rank: int, tp_rank: int) -> int:
        return self.devices[self.layout.index(pp_rank, tp_rank)]

    def slot_dtype(self, slot: str, param: ParamSpec) -> str:
        return param.dtype if slot == "param" else SLOT_DTYPE[slot]

    @cached_property
    def _shards(self) -> dict[int, dict[str, tuple[Shard, str]]]:
        out: dict[int, dict[str, tuple[Shard, str]]] = {}
        for i, device in enumerate(self.devices):
            pp_rank, tp_rank = self.layout.position(i)
            held: dict[str, tuple[Shard, str]] = {}
            for p in self.spec.params:
                if not holds_param(self.spec, self.layout, p, pp_rank):
                    continue
                shard = param_shard(p, self.layout.tp, tp_rank)
                for slot in self.slots:
                    held[tensor_key(slot, p.name)] = (shard, self.slot_dtype(slot, p))
            out[device] = held
        return out

    def shards_on(self, device: int) -> dict[str, tuple[Shard, str]]:
        """key -> (shard, dtype) of every tensor this EMU holds on ``device``."""
        if device not in self._shards:
            raise ConfigError(f"device={device} is not a device of {self!r}")
        return self._shards[device]

    def bytes_on(self, device: int) -> int:
        return sum(s.numel * DTYPE_BYTES[dt] for s, dt in self.shards_on(device).values())

    def keys(self) -> Iterator[str]:
        for p in self.spec.params:
            for slot in self.slots:
                yield tensor_key(slot, p.name)

    @property
    def nbytes(self) -> int:
        """Bytes of every shard of this replica (replicated pieces counted per device)."""
        return sum(self.bytes_on(d) for d in self.devices)


def emu_to_plain(emu: EMU) -> dict[str, Any]:
    """An EMU as plain data (msgpack/JSON), spec included."""
    return {
        "name": emu.name,
        "model_stage": emu.model_stage,
        "spec": to_dict(emu.spec),
        "layout": {"tp": emu.layout.tp, "pp": emu.layout.pp, "cuts": list(emu.layout.cuts)},
        "devices": list(emu.devices),
        "slots": list(emu.slots),
        "state": to_dict(emu.state),
    }


_SPECS: dict[tuple, ModelSpec] = {}
_SPECS_KEPT = 16


def _spec_from_plain(plain: dict[str, Any]) -> ModelSpec:
    """``ModelSpec`` of plain data, built and validated once per distinct spec (an
    engine host sees the same few specs in every message)."""
    params = plain.get("params") or []
    try:
        key = (
            plain.get("name"),
            plain.get("num_layers"),
            plain.get("num_attention_heads"),
            plain.get("num_kv_heads"),
            plain.get("vocab_size"),
            plain.get("hidden_size"),
            tuple(
                (
                    p["name"],
                    tuple(p["shape"]),
                    p["dtype"],
                    p["rule"],
                    p["stage"],
                    p.get("layer"),
                    tuple((c["name"], c["size"], c["units"]) for c in p.get("components") or ()),
                    p.get("tied_head", False),
                )
                for p in params
            ),
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"ModelSpec description is malformed: {e!r}") from None
    spec = _SPECS.get(key)
    if spec is None:
        spec = from_dict(ModelSpec, plain)
        if len(_SPECS) >= _SPECS_KEPT:
            _SPECS.pop(next(iter(_SPECS)))
        _SPECS[key] = spec
    return spec


def emu_from_plain(plain: dict[str, Any]) -> EMU:
    """The EMU ``emu_to_plain`` described; every field is validated again (a spec seen
    before is not built twice)."""
    try:
        lay = plain["layout"]
        return EMU(
            name=plain["name"],
            model_stage=plain["model_stage"],
            spec=_spec_from_plain(plain["spec"]),
            layout=Layout(lay["tp"], lay["pp"], tuple(lay["cuts"])),
            devices=tuple(plain["devices"]),
            slots=tuple(plain["slots"]),
            state=from_dict(LogicalState, plain["state"]),
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"EMU description is malformed: {e!r}") from None
