"""The Slurm launcher without a Slurm: the batch script and its flags, the Slurm
environment, the key folder, and one ``nereus slurm node`` task becoming a node daemon
of a real controller (``scontrol`` is a stand-in script on PATH)."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import stat
import sys
from pathlib import Path

import pytest

from nereus.actors import Cluster, Controller
from nereus.cli import main as nereus_main
from nereus.errors import ConfigError
from nereus.launch import SbatchOptions, SlurmCluster, render_sbatch
from nereus.launch._slurm_driver import NODE_PREFIX, make_key_dir
from nereus.launch._slurm_env import SlurmTask, expand_hostnames, host_address
from nereus.launch.slurm import parse_cluster_args
from tests._leaks import children, wait_gone

REPO = Path(__file__).resolve().parents[2]
KEY = b"a-slurm-launcher-test-key-0123456789"


def _fake_scontrol(folder: Path, hosts: list[str], fail: str = "") -> Path:
    """An ``scontrol`` that expands any host list to ``hosts`` (or fails with ``fail``)."""
    path = folder / "scontrol"
    body = (
        f"echo {shlex.quote(fail)} >&2; exit 1"
        if fail
        else f"printf '%s\\n' {' '.join(shlex.quote(h) for h in hosts)}"
    )
    path.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 2\n{body}\n")
    path.chmod(0o755)
    return path


def test_argv_and_flags_are_inverses(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("")
    for cluster in (
        SlurmCluster(devices_per_task=2),
        SlurmCluster(
            tasks_per_node=2,
            gpus_per_task=4,
            memory_per_device="20GiB",
            job=str(job),
            key_dir=str(tmp_path / "k"),
            controller_port=5555,
            tap_port=5556,
            heartbeat_timeout_s=2.5,
            start_timeout_s=90.0,
        ),
    ):
        assert parse_cluster_args(cluster.argv()) == cluster


def test_the_script_asks_for_what_the_cluster_uses(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("")
    cluster = SlurmCluster(tasks_per_node=2, gpus_per_task=4, job=str(job))
    options = SbatchOptions(
        nodes=3,
        partition="gpu",
        time="04:00:00",
        cpus_per_task=16,
        python="/shared/venv/bin/python",
        extra=("--exclusive",),
    )
    text = render_sbatch(cluster, options)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line for line in lines if line.startswith("#SBATCH ")]
    assert sbatch == [
        "#SBATCH --job-name=nereus",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --output=nereus-%j.out",
        "#SBATCH --exclusive",
    ]
    # sbatch reads #SBATCH lines only up to the first command.
    first_command = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    assert all(lines.index(line) < first_command for line in sbatch)
    command = shlex.split(lines[-1].removeprefix("exec "))
    assert command[:6] == [
        "/shared/venv/bin/python",
        "-m",
        "nereus.cli",
        "slurm",
        "run",
        "--tasks-per-node",
    ]
    assert parse_cluster_args(command[5:]) == cluster


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "devices_per_task=0 and gpus_per_task=0 must be exactly one > 0"),
        ({"devices_per_task": 2, "gpus_per_task": 1}, "devices_per_task=2 and gpus_per_task=1"),
        ({"devices_per_task": 1, "tasks_per_node": 0}, "tasks_per_node=0 must be >= 1"),
        ({"devices_per_task": 1, "memory_per_device": "lots"}, "memory_per_device='lots'"),
        (
            {"devices_per_task": 1, "job": "/nonexistent/job.toml"},
            "job='/nonexistent/job.toml' must be an existing TOML file",
        ),
        (
            {"devices_per_task": 1, "controller_port": 70000},
            "controller_port=70000 must be a TCP port",
        ),
        (
            {"devices_per_task": 1, "heartbeat_timeout_s": 0.0},
            "heartbeat_timeout_s=0.0 must be > 0",
        ),
    ],
)
def test_bad_clusters_are_refused_by_field(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SlurmCluster(**kwargs)


def test_bad_sbatch_options_are_refused_by_field():
    with pytest.raises(ConfigError, match="nodes=0 must be >= 1"):
        SbatchOptions(nodes=0)
    with pytest.raises(ConfigError, match="time='1:00\\\\n#SBATCH --x' must be one line"):
        SbatchOptions(time="1:00\n#SBATCH --x")
    with pytest.raises(ConfigError, match="extra='exclusive' must be one sbatch option"):
        SbatchOptions(extra=("exclusive",))


def test_the_script_command(tmp_path, capsys):
    assert (
        nereus_main(
            ["slurm", "script", "--gpus-per-task", "8", "--nodes", "2", "-o", str(tmp_path / "s")]
        )
        == 0
    )
    assert "#SBATCH --gpus-per-node=8" in (tmp_path / "s").read_text()
    assert nereus_main(["slurm", "script", "--devices-per-task", "2", "--gpus-per-task", "1"]) == 2
    assert "devices_per_task=2 and gpus_per_task=1" in capsys.readouterr().err


def test_run_outside_slurm_says_so(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert nereus_main(["slurm", "run", "--devices-per-task", "1"]) == 2
    assert "$SLURM_JOB_ID is not set: run this inside a Slurm job" in capsys.readouterr().err


def _slurm_env(**extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n[01-02]",
        "SLURM_PROCID": "3",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "1",
        "SLURMD_NODENAME": "n02",
        "SLURM_SUBMIT_DIR": "/home/u/run",
        **extra,
    }


@pytest.mark.integration
def test_the_slurm_environment(tmp_path):
    scontrol = str(_fake_scontrol(tmp_path, ["n01", "n02"]))
    task = SlurmTask.from_environ(_slurm_env(), scontrol=scontrol)
    assert (task.job_id, task.procid, task.nodeid, task.localid) == ("77", 3, 1, 1)
    assert task.hosts == ("n01", "n02") and task.first_host == "n01" and not task.is_first_node
    assert task.submit_dir == "/home/u/run"
    env = _slurm_env()
    del env["SLURM_JOB_ID"]
    with pytest.raises(ConfigError, match=r"\$SLURM_JOB_ID is not set"):
        SlurmTask.from_environ(env, scontrol=scontrol)
    with pytest.raises(ConfigError, match="SLURM_PROCID='x' must be an integer"):
        SlurmTask.from_environ(_slurm_env(SLURM_PROCID="x"), scontrol=scontrol)
    with pytest.raises(ConfigError, match="SLURMD_NODENAME='n09' is not one of"):
        SlurmTask.from_environ(_slurm_env(SLURMD_NODENAME="n09"), scontrol=scontrol)
    (tmp_path / "broken").mkdir()
    broken = str(_fake_scontrol(tmp_path / "broken", [], fail="Invalid hostlist: n[01-"))
    with pytest.raises(ConfigError, match=r"show hostnames n\[01-02\]` failed .*Invalid hostlist"):
        expand_hostnames("n[01-02]", scontrol=broken)
    with pytest.raises(ConfigError, match="is not on PATH"):
        expand_hostnames("n1", scontrol=str(tmp_path / "missing"))


def test_nodes_bind_an_address_other_nodes_reach():
    assert host_address("localhost", alone=True).startswith("127.")
    with pytest.raises(ConfigError, match="'localhost' resolves only to loopback addresses"):
        host_address("localhost")
    with pytest.raises(ConfigError, match="'no-such-node.invalid' does not resolve"):
        host_address("no-such-node.invalid")


def test_the_key_folder_is_private(tmp_path):
    old = os.umask(0)  # the modes must not depend on the user's umask
    try:
        key_file = make_key_dir(tmp_path / "shared" / "slurm-1")
    finally:
        os.umask(old)
    for path, mode in ((key_file.parent, 0o700), (key_file, 0o600)):
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.getuid()
    first = key_file.read_bytes()
    assert len(first) == 64
    # A requeued job (same id) gets a fresh key, and a folder opened up meanwhile is closed.
    key_file.parent.chmod(0o755)
    assert make_key_dir(key_file.parent).read_bytes() != first
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a folder of this user"):
        make_key_dir(tmp_path / "file")


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_node_task_becomes_a_node_daemon(tmp_path):
    host = socket.gethostname()
    _fake_scontrol(tmp_path, [host])  # alone in its allocation: a loopback address will do
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    controller = await Controller(KEY, bind="tcp://127.0.0.1:0").start()
    before = children()
    env = {
        **os.environ,
        **_slurm_env(SLURMD_NODENAME=host, SLURM_STEP_ID="4"),
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nereus.cli",
        "slurm",
        "node",
        "--controller",
        controller.address,
        "--key-file",
        str(key_file),
        "--devices",
        "2",
        "--memory-per-device",
        "128MiB",
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert first == f"{NODE_PREFIX}4 3 {host}\n"
        async with Cluster.connect(
            controller.address, key=KEY, min_devices=2, timeout_s=60
        ) as cluster:
            assert {d.node_id for d in cluster.devices} == {"slurm-77-3"}
            assert [d.memory_bytes for d in cluster.devices] == [128 * 2**20] * 2
        pid = proc.pid
        with open(f"/proc/{pid}/cmdline", "rb") as fh:  # the task became the daemon itself
            assert b"nereus.node" in fh.read()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await controller.close()
    assert not wait_gone(children() - before)


def test_the_committed_example_is_what_the_renderer_writes(tmp_path, monkeypatch):
    example = REPO / "examples" / "grpo_tiny.sbatch"
    header = example.read_text().splitlines()[1]
    assert header.startswith("# Rendered by: nereus slurm script ")
    monkeypatch.chdir(REPO)  # its paths are relative to the repository, where sbatch runs
    out = tmp_path / "again.sbatch"
    assert (
        nereus_main([*shlex.split(header.removeprefix("# Rendered by: nereus ")), "-o", str(out)])
        == 0
    )
    assert out.read_text() == example.read_text(), f"re-render {example} with its second line"
