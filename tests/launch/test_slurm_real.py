"""nereus clusters that a real Slurm starts (``make test-slurm``; selected by ``--slurm``).

A one-host Slurm (``tests.launch._slurm``) runs batch scripts that ``nereus slurm
script`` rendered: ``srun -N1 -n2`` starts two node daemons on this host, Slurm gives
each task its own GPU set, and the batch script runs a GRPO job against them; a held
cluster loses a node and is cancelled. Each test checks that no process of its Slurm job
is left and that the key folder is gone.
"""

from __future__ import annotations

import asyncio
import glob
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nereus.actors import Cluster
from tests.launch._actors import Where
from tests.launch._slurm import OneHostSlurm, job_processes

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "grpo_tiny.toml"
STEPS = 4


@pytest.fixture(scope="module")
def slurm():
    cluster = OneHostSlurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _script(tmp_path: Path, *flags: str) -> Path:
    script = tmp_path / "job.sbatch"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "nereus.cli",
            "slurm",
            "script",
            "--key-dir",
            str(tmp_path / "keys"),
            "--output",
            str(tmp_path / "out-%j.txt"),
            "-o",
            str(script),
            *flags,
        ],
        check=True,
        cwd=REPO,
    )
    return script


class _Submitted:
    """``sbatch --wait``: its job id at once, its exit status when the job ends."""

    def __init__(self, slurm: OneHostSlurm, script: Path) -> None:
        # From the repository's root: the job's processes import the tests' actors.
        self.proc = subprocess.Popen(
            ["sbatch", "--parsable", "--wait", str(script)],
            env=slurm.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.job_id = self.proc.stdout.readline().strip().split(";")[0]
        assert self.job_id.isdigit(), f"sbatch printed {self.job_id!r}"

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout_s)
        self.proc.stdout.close()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def _wait_for_file(path: Path, submitted: _Submitted, timeout_s: float) -> dict:
    """The JSON in ``path`` once the driver wrote it (it appears when the cluster is ready)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert submitted.proc.poll() is None, (
            f"the job ended (sbatch {submitted.proc.returncode}) first"
        )
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.1)  # the driver's output file is the only sign from inside the job
    return json.loads(path.read_text())


def _assert_gone(job_id: str, key_dir: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)  # slurmstepd reaps the step's processes after sbatch returns
    assert not left, f"processes of job {job_id} still running: {left}"
    assert not key_dir.exists(), f"the key folder {key_dir} was left behind"


def _private(path: Path, mode: int) -> None:
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == mode, f"{path} has mode {oct(st.st_mode)}"
    assert st.st_uid == os.getuid()


@pytest.mark.timeout(240)
def test_grpo_on_a_cluster_that_slurm_started(slurm, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        DEMO.read_text()
        .replace("steps = 120", f"steps = {STEPS}")
        .replace('out_dir = "runs/grpo_tiny"', f'out_dir = "{tmp_path / "run"}"')
        .replace("checkpoint_every = 40", "checkpoint_every = 0")
    )
    script = _script(
        tmp_path,
        "--tasks-per-node",
        "2",
        "--devices-per-task",
        "2",
        "--memory-per-device",
        "256MiB",
        "--job",
        str(job),
    )
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --nodes=1" in text
    submitted = _Submitted(slurm, script)
    keys = tmp_path / "keys"
    try:
        info = _wait_for_file(keys / "cluster.json", submitted, 120)
        _private(keys, 0o700)
        _private(keys / "key", 0o600)
        rc = submitted.wait(180)
    finally:
        submitted.kill()
    out = (tmp_path / f"out-{submitted.job_id}.txt").read_text()
    assert rc == 0, out
    # Two daemons of one srun step on this host, told apart by SLURM_PROCID, 2 devices each.
    nodes = {n["node_id"]: n for n in info["nodes"]}
    assert set(nodes) == {f"slurm-{submitted.job_id}-0", f"slurm-{submitted.job_id}-1"}
    assert all(n["host"] == slurm.host and len(n["devices"]) == 2 for n in nodes.values())
    assert sorted(d for n in nodes.values() for d in n["devices"]) == [0, 1, 2, 3]
    assert info["devices"] == 4 and info["key_file"] == str(keys / "key")
    assert "nereus cluster ready: 4 devices on 2 node daemons" in out
    # The job ran its GRPO steps on that cluster (its plan spans devices 0-3: both daemons).
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(math.isfinite(r["reward_mean"]) and 0 <= r["reward_mean"] <= 1 for r in records)
    assert [r["policy_version"] for r in records] == list(range(STEPS))
    assert all(r["response_len_mean"] > 0 for r in records)
    assert f"done: {STEPS} steps" in out
    state = slurm.job_state(submitted.job_id)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), state
    _assert_gone(submitted.job_id, keys)


@pytest.mark.timeout(240)
async def test_gpu_sets_a_lost_node_and_cancel(slurm, tmp_path):
    script = _script(
        tmp_path,
        "--tasks-per-node",
        "2",
        "--gpus-per-task",
        "2",
        "--memory-per-device",
        "64MiB",
        "--heartbeat-timeout-s",
        "4",
    )
    assert "#SBATCH --gpus-per-node=4" in script.read_text()
    submitted = _Submitted(slurm, script)
    keys = tmp_path / "keys"
    try:
        info = await asyncio.to_thread(_wait_for_file, keys / "cluster.json", submitted, 120)
        async with Cluster.connect(
            info["address"], key_file=info["key_file"], min_devices=4
        ) as cluster:
            failures, lost = [], asyncio.Event()

            def on_failure(failure) -> None:
                failures.append(failure)
                if len(failures) == 2:
                    lost.set()

            cluster.on_failure(on_failure)
            mesh = await cluster.spawn("where", Where, devices=[0, 1, 2, 3])
            seen = await mesh.where.call()
            # Each daemon maps its workers within the GPU set Slurm gave its task
            # (CUDA_VISIBLE_DEVICES in the daemon's own environment), one GPU each.
            by_node: dict[str, list[str]] = {}
            for w in seen:
                daemon_env = _environ(w["ppid"])
                given = daemon_env["CUDA_VISIBLE_DEVICES"].split(",")
                assert w["kind"] == "cuda"
                assert w["cuda_visible_devices"] == given[w["local_index"]], (w, given)
                assert w["node_id"] == f"slurm-{submitted.job_id}-{daemon_env['SLURM_PROCID']}"
                by_node.setdefault(w["node_id"], []).append(w["cuda_visible_devices"])
            assert len(by_node) == 2 and all(len(v) == 2 for v in by_node.values())
            assert sorted(g for v in by_node.values() for g in v) == ["0", "1", "2", "3"]
            # A node daemon that dies (SIGKILL: no goodbye) is a lost node: its devices
            # are reported to the driver once its heartbeats stop.
            victim = next(w for w in seen if w["node_id"].endswith("-1"))
            os.kill(victim["ppid"], signal.SIGKILL)
            await asyncio.wait_for(lost.wait(), 30)
            dead = {w["index"] for w in seen if w["node_id"] == victim["node_id"]}
            assert {f.device for f in failures} == dead
            assert all(f.reason == "node lost" for f in failures), failures
            assert all(f.node_id == victim["node_id"] for f in failures)
            # The other daemon's devices still answer.
            alive = sorted({0, 1, 2, 3} - dead)
            again = await cluster.spawn("where-alive", Where, devices=alive)
            assert [w["index"] for w in await again.where.call()] == alive
        rc_cancel = slurm.run(["scancel", submitted.job_id])
        assert rc_cancel.returncode == 0
        await asyncio.to_thread(submitted.wait, 60)
    finally:
        submitted.kill()
    state = slurm.job_state(submitted.job_id)
    assert state["JobState"] == "CANCELLED", state
    _assert_gone(submitted.job_id, keys)
    # scancel's SIGTERM stops the surviving daemon, which removes its scratch folder; the
    # SIGKILLed one could not remove its own, so the test does
    survivor = next(w["ppid"] for w in seen if w["node_id"] != victim["node_id"])
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"nereus-{survivor}-*"))
    for left in glob.glob(os.path.join(tempfile.gettempdir(), f"nereus-{victim['ppid']}-*")):
        shutil.rmtree(left)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        items = fh.read().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)
