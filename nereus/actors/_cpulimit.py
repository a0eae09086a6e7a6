"""Kernel-enforced CPU capacity per device: one cgroup per worker process of a node.

``CpuLimits(cores, owner=...)`` finds a writable CPU controller (cgroup v2 ``cpu.max``
where mounted and delegated to this process, else v1 ``cpu.cfs_quota_us``), makes one
group per device named ``nereus-<owner pid>-<node>-<random>-d<local index>`` with a
quota of that device's cores (``quota = cores x period``) and the scheduling weight of
that many nice-0 tasks (contended devices keep their capacities' ratio), and hands out
``preexec(i)``: what the worker's child process runs before it executes Python, so the
worker is inside its group before it imports torch or starts a thread. ``remove(i)``
deletes a group once its worker exited; ``close()`` deletes all of them;
``cpu_seconds(i)`` is the CPU time the kernel accounted to a device's processes.

Promises:
- a node that starts first removes groups whose owner pid is dead (a node that was
  killed with SIGKILL removes nothing); groups of live owners (other nodes on the host)
  are never touched;
- ``worker_threads(cores)`` is the torch intra-op thread count a device of ``cores``
  gets: ``max(1, ceil(cores))``.

Refuses (``ConfigError`` naming ``cores_per_device``): a capacity that is not > 0, and
a host where no CPU controller is writable (not root and no delegated v2 subtree, or a
given ``root`` that is missing or read-only); the message says how to run without limits
(``cores_per_device = "shared"``). Never falls back to running without a limit.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from nereus.errors import ConfigError

__all__ = [
    "CpuLimits",
    "find_controller",
    "check_cpu_limits",
    "worker_threads",
    "device_threads",
    "parse_cores",
    "PERIOD_US",
]

log = logging.getLogger("nereus.node")

# The CFS period quotas are set against: 10 ms, not the kernel's 100 ms default. A group
# that idled runs unthrottled until its quota for the period is spent, so with 100 ms a
# device idle between a step's phases ran each phase of up to 45 ms (at 0.45 cores) at a
# whole core: generation on devices apart from training measured 0.05 s where the same
# layout sharing devices measured 0.09 s. With 10 ms a burst is at most 4.5 ms and a
# device runs at its capacity on the scale of a decode call or a micro-batch, as a GPU
# runs at its rate.
PERIOD_US = 10_000
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_MOUNTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
_PREFIX = "nereus-"
_STALE = re.compile(r"^nereus-(\d+)-")
_HOW = (
    'run without CPU limits with cores_per_device = "shared" (each worker then shares '
    "the host's cores), or run as root / in a cgroup subtree delegated to this user"
)


def worker_threads(cores: float | None) -> int:
    """Torch intra-op threads for a device of ``cores`` (None: shared cores, one thread)."""
    return 1 if cores is None else max(1, math.ceil(cores - 1e-9))


def device_threads() -> int:
    """Torch threads this worker process computes with: what its node gave it
    (``OMP_NUM_THREADS``, set from the device's cores), one when unset."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def parse_cores(value: object, devices: int, field: str = "cores_per_device") -> list[float] | None:
    """``"shared"``/None -> None; a number -> that many cores for every device; a list ->
    one number per device. Anything else is refused, naming ``field``."""
    if value is None or value == "shared":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * devices
    elif isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        values = [float(v) for v in value]
        if len(values) != devices:
            raise ConfigError(
                f"{field}={list(value)!r} must give one number per device ({devices} devices)"
            )
    else:
        raise ConfigError(
            f'{field}={value!r} must be "shared", a number of cores, or one number per device'
        )
    bad = [v for v in values if not (0.01 <= v <= 4096)]
    if bad:
        raise ConfigError(f"{field}={value!r}: each device's cores must be in [0.01, 4096]")
    return values


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _own_v2_group(mount: Path) -> Path | None:
    """This process's own v2 group under ``mount`` (from /proc/self/cgroup), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return mount / line[3:].lstrip("/")
    return None


def _v2_usable(parent: Path) -> bool:
    """Groups made in ``parent`` get a ``cpu.max``: cpu is enabled for its children."""
    try:
        enabled = (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return "cpu" in enabled and _writable_dir(parent)


def find_controller(root: str | os.PathLike | None = None) -> tuple[str, Path]:
    """``("v2" | "v1", parent folder)`` where this process may make CPU-limited groups.

    ``root``: use that folder (a v1 ``cpu`` hierarchy, or a v2 group with cpu enabled
    for its children) and nothing else. Raises ``ConfigError`` when none is writable."""
    if root is not None:
        path = Path(root)
        if (path / "cpu.cfs_quota_us").exists() and _writable_dir(path):
            return "v1", path
        if (path / "cgroup.controllers").exists() and _v2_usable(path):
            return "v2", path
        raise ConfigError(
            f"cores_per_device is set but the cgroup root {str(path)!r} is missing, not a CPU "
            f"controller, or not writable by uid {os.getuid()}: the CPU limit cannot be set; "
            + _HOW
        )
    for mount in V2_MOUNTS:
        if not (mount / "cgroup.controllers").exists():
            continue
        own = _own_v2_group(mount)
        for parent in ([own] if own is not None else []) + [mount]:
            if _v2_usable(parent):
                return "v2", parent
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and _writable_dir(V1_ROOT):
        return "v1", V1_ROOT
    raise ConfigError(
        f"cores_per_device is set but no writable CPU controller was found (cgroup v2 with "
        f"cpu delegated under {', '.join(map(str, V2_MOUNTS))}, or v1 at {V1_ROOT}) for uid "
        f"{os.getuid()}: the CPU limit cannot be set; " + _HOW
    )


def check_cpu_limits(root: str | os.PathLike | None = None) -> str:
    """Where CPU limits would be set (e.g. ``"cgroup v1 at /sys/fs/cgroup/cpu"``); raises
    ``ConfigError`` (naming ``cores_per_device``, saying why) where they cannot be."""
    kind, parent = find_controller(root)
    return f"cgroup {kind} at {parent}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_group(path: Path, parent: Path, attempts: int = 50) -> bool:
    """rmdir ``path``; processes still inside (a stale group's) are moved to ``parent``
    first. A just-reaped worker may keep its group busy for a moment: retried briefly."""
    for _ in range(attempts):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                (parent / "cgroup.procs").write_text(pid)
        except OSError as e:  # the process left between the read and the write
            log.debug("moving the processes out of %s: %s", path, e)
        time.sleep(0.01)
    log.warning("could not remove the CPU group %s (still busy)", path)
    return False


def sweep_stale(parent: Path) -> list[str]:
    """Remove the groups under ``parent`` left by nodes whose pid is dead."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _STALE.match(entry.name)
        if m and entry.is_dir() and not _pid_alive(int(m.group(1))):
            if _remove_group(entry, parent):
                removed.append(entry.name)
    if removed:
        log.info("removed %d CPU groups left by nodes that were killed: %s", len(removed), removed)
    return removed


def _weight(cores: float, per_core: int, low: int, high: int) -> int:
    """The group's scheduling weight: ``cores`` times a nice-0 task's, so on a contended
    host devices keep the ratio of their capacities (the quota only caps from above)."""
    return max(low, min(high, int(round(cores * per_core))))


class CpuLimits:
    """The CPU groups of one node's devices (see the module docstring)."""

    def __init__(
        self, cores: Sequence[float], *, owner: str, root: str | os.PathLike | None = None
    ) -> None:
        for c in cores:
            if not c > 0:
                raise ConfigError(f"cores_per_device={list(cores)!r}: each must be > 0")
        self.cores = [float(c) for c in cores]
        self.kind, self.parent = find_controller(root)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", owner)
        self.prefix = f"{_PREFIX}{os.getpid()}-{safe}-{uuid.uuid4().hex[:6]}"
        self.groups: dict[int, Path] = {}
        sweep_stale(self.parent)

    def group(self, i: int) -> Path:
        """Make (once) the group of local device ``i`` with its quota; return its folder."""
        path = self.groups.get(i)
        if path is not None:
            return path
        path = self.parent / f"{self.prefix}-d{i}"
        try:
            path.mkdir(exist_ok=True)
            quota = max(1000, int(round(self.cores[i] * PERIOD_US)))
            if self.kind == "v2":
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                (path / "cpu.weight").write_text(str(_weight(self.cores[i], 100, 1, 10000)))
            else:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
                (path / "cpu.shares").write_text(str(_weight(self.cores[i], 1024, 2, 262144)))
        except OSError as e:
            raise ConfigError(
                f"cores_per_device={self.cores[i]}: cannot set the CPU limit in "
                f"{path}: {e.strerror}; " + _HOW
            ) from None
        self.groups[i] = path
        return path

    def preexec(self, i: int) -> Callable[[], None]:
        """What the worker's child runs before exec: join device ``i``'s group."""
        procs = str(self.group(i) / "cgroup.procs")

        def join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        return join

    def threads(self, i: int) -> int:
        return worker_threads(self.cores[i])

    def remove(self, i: int) -> None:
        """Delete device ``i``'s group (its worker has exited)."""
        path = self.groups.pop(i, None)
        if path is not None:
            _remove_group(path, self.parent)

    def close(self) -> None:
        for i in list(self.groups):
            self.remove(i)

    def cpu_seconds(self, i: int) -> float:
        """CPU seconds the processes now in device ``i``'s group have used, by the kernel's
        accounting: v2 ``cpu.stat`` ``usage_usec`` (the group's, exited processes too);
        v1, whose ``cpu`` controller keeps no usage, the ``utime + stime`` of every process
        in ``cgroup.procs`` (``/proc/<pid>/stat``; a process that exited is not counted).
        0.0 for a device without a group."""
        path = self.groups.get(i)
        if path is None:
            return 0.0
        if self.kind == "v2":
            return self.throttled(i).get("usage_usec", 0) / 1e6
        ticks = 0
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited between the two reads
            # fields after the command name (which may hold spaces) start at state (3rd)
            fields = stat.rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (14th, 15th)
        return ticks / os.sysconf("SC_CLK_TCK")

    def throttled(self, i: int) -> dict[str, int]:
        """The group's ``cpu.stat`` counters (nr_periods, nr_throttled, throttled time;
        v2 also usage_usec)."""
        path = self.groups.get(i)
        if path is None:
            return {}
        out = {}
        for line in (path / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out
