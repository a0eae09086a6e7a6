"""A real one-host Slurm for the tests: munged, slurmctld and slurmd from Debian's
slurm-wlm and munge packages, run as root with every file in one temporary folder.

``OneHostSlurm().start()`` makes that folder, writes a munge key and a ``slurm.conf``
(auth/munge on a socket in the folder, proctrack/linuxproc, task/none, cons_tres with
CR_Core, free ports, this host as the only node with all its CPUs) plus a
``gres.conf`` of ``gpus`` GPUs whose device files are character devices in the folder
(``mknod`` of ``/dev/null``'s numbers): no GPU exists, but Slurm allocates them,
narrows ``CUDA_VISIBLE_DEVICES`` per task and says which a task got, as on a GPU node.
It starts the three daemons and waits until the node is idle. ``stop()`` cancels any
job left, stops the daemons by the pids in their pid files, waits until they are gone
and removes the folder.

Nothing here skips: a missing package, a daemon that will not start or a node that is
not idle in time raises with the daemon's own error or log.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class OneHostSlurm:
    """See the module docstring."""

    def __init__(self, gpus: int = 4) -> None:
        # munged wants every folder above its socket open to all (pytest's are 0700).
        self.folder = Path(tempfile.mkdtemp(prefix="nereus-slurm-"))
        self.folder.chmod(0o755)
        self.gpus = gpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pid_files: list[Path] = []

    def _write_files(self) -> None:
        d = self.folder
        for sub in ("state", "spool", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        null = os.stat("/dev/null").st_rdev
        for i in range(self.gpus):
            os.mknod(d / "dev" / f"nvidia{i}", 0o600 | 0o020000, null)  # S_IFCHR
        (d / "gres.conf").write_text(
            f"NodeName={self.host} Name=gpu File={d}/dev/nvidia[0-{self.gpus - 1}]\n"
        )
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=nereus-test",
                    f"SlurmctldHost={self.host}",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={d}/munge.sock",
                    "CredType=cred/munge",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "KillWait=10",
                    "GresTypes=gpu",
                    f"StateSaveLocation={d}/state",
                    f"SlurmdSpoolDir={d}/spool",
                    f"SlurmctldPidFile={d}/slurmctld.pid",
                    f"SlurmdPidFile={d}/slurmd.pid",
                    f"SlurmctldLogFile={d}/slurmctld.log",
                    f"SlurmdLogFile={d}/slurmd.log",
                    f"NodeName={self.host} CPUs={os.cpu_count()} RealMemory=1024 "
                    f"Gres=gpu:{self.gpus} State=UNKNOWN",
                    f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _daemon(self, argv: list[str], pid_file: Path, log: Path) -> None:
        self._pid_files.append(pid_file)
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(argv)} failed with exit code {done.returncode}: "
                f"{done.stderr.strip()}\n{tail}"
            )

    def start(self) -> OneHostSlurm:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"):
            if shutil.which(tool) is None:
                raise RuntimeError(
                    f"{tool} is not installed: `make test-slurm` installs "
                    "Debian's slurm-wlm and munge"
                )
        self._write_files()
        d = self.folder
        try:
            self._daemon(
                [
                    "munged",
                    "--key-file",
                    str(d / "munge.key"),
                    "--socket",
                    str(d / "munge.sock"),
                    "--pid-file",
                    str(d / "munged.pid"),
                    "--log-file",
                    str(d / "munged.log"),
                    "--seed-file",
                    str(d / "munge.seed"),
                ],
                d / "munged.pid",
                d / "munged.log",
            )
            self._daemon(
                ["slurmctld", "-f", str(self.conf)], d / "slurmctld.pid", d / "slurmctld.log"
            )
            self._daemon(["slurmd", "-f", str(self.conf)], d / "slurmd.pid", d / "slurmd.log")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            done = self.run(
                ["sinfo", "--noheader", "--format=%T", "--nodes", self.host], check=False
            )
            state = done.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)  # sinfo has no wait-for-state; poll it up to the deadline
        log = (self.folder / "slurmd.log").read_text()[-2000:]
        raise RuntimeError(
            f"node {self.host} is {state!r}, not idle, after "
            f"{START_TIMEOUT_S} s; slurmd.log ends:\n{log}"
        )

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, **kw)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed with exit code {done.returncode}: {done.stderr.strip()}"
            )
        return done

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def _cancel_jobs(self) -> None:
        """Cancel every job (a failed test may leave one running) and wait until Slurm
        has ended them, so their processes are gone before slurmd is."""
        self.run(["scancel", "--user=root"], check=False)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            left = self.run(["squeue", "--noheader", "--format=%i"], check=False)
            if left.returncode != 0 or not left.stdout.strip():
                return
            time.sleep(0.2)  # squeue has no wait-until-empty; poll it up to the deadline

    def stop(self) -> None:
        if (self.folder / "slurmctld.pid").exists():
            self._cancel_jobs()
        pids = []
        for pid_file in reversed(self._pid_files):  # slurmd, slurmctld, munged
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if not _alive(pid):
                continue
            pids.append(pid)
            fd = os.pidfd_open(pid)
            try:
                os.kill(pid, signal.SIGTERM)
                # A daemon is not our child: its pidfd becomes readable when it exits.
                if not select.select([fd], [], [], STOP_TIMEOUT_S)[0]:
                    os.kill(pid, signal.SIGKILL)
                    select.select([fd], [], [], STOP_TIMEOUT_S)
            finally:
                os.close(fd)
        self._pid_files.clear()
        left = [pid for pid in pids if _alive(pid)]
        if left:
            raise RuntimeError(f"Slurm daemons {left} are still running after SIGKILL")
        shutil.rmtree(self.folder, ignore_errors=True)


def job_processes(job_id: str) -> list[int]:
    """Pids of live processes of Slurm job ``job_id``: every process the job started
    (their environment holds ``SLURM_JOB_ID``) and its ``slurmstepd``s."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    stepd = f"slurmstepd: [{job_id}.".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if (marker in env or cmdline.startswith(stepd)) and _alive(int(entry)):
            found.append(int(entry))
    return found
