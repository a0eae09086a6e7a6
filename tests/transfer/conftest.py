"""Harness for the transfer tests: a TCPStore in the test process and real worker
processes (``python -m tests.transfer._worker``), always reaped, with leak checks."""

from __future__ import annotations

import datetime
import glob
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from torch.distributed import TCPStore

ROOT = Path(__file__).resolve().parents[2]


def shm_names(port: int) -> set[str]:
    """Shared-memory names of groups whose store listens on ``port`` (other processes
    on this machine may be using nereus at the same time)."""
    return set(glob.glob(f"/dev/shm/nereus-{port}-*"))


class Workers:
    """Starts ``size`` workers for one scenario and collects their JSON lines."""

    def __init__(self) -> None:
        self.store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self.procs: list[subprocess.Popen] = []

    def run(
        self, scenario: str, size: int, timeout_s: float = 90.0, expect_rc=None, **args
    ) -> list[dict]:
        group = args.pop("group", f"t-{uuid.uuid4().hex[:8]}")
        # the checkout first, then whatever else this process was given (make test-gpu
        # puts the packages it installed there)
        path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
        procs = []
        for rank in range(size):
            a = {"rank": rank, "size": size, "port": self.store.port, "group": group, **args}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.transfer._worker", scenario, json.dumps(a)],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        self.procs.extend(procs)
        results = []
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout_s)
            want = 0 if expect_rc is None else expect_rc.get(rank, 0)
            assert p.returncode == want, (
                f"rank {rank} exited {p.returncode} (wanted {want})\n{err[-4000:]}"
            )
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            results.append(json.loads(lines[-1]) if lines else {"rank": rank, "rc": p.returncode})
        return results

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        self.store = None


@pytest.fixture
def workers():
    w = Workers()
    port = w.store.port
    try:
        yield w
    finally:
        w.close()
    leaked = shm_names(port)
    assert not leaked, f"shared-memory names leaked: {sorted(leaked)}"
