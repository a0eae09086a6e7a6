"""Leak checks shared by the tests: live descendant processes (read from /proc, no extra
package) and nereus's named shared-memory segments."""

from __future__ import annotations

import glob
import os
import time


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process we can see."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:  # it exited while we looked
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry)] = (int(fields[1]), fields[0])
    return out


def children() -> set[int]:
    """Live (not zombie) descendants of this process."""
    procs = processes()
    found, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _state) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return {pid for pid in found if procs[pid][1] != "Z"}


def wait_gone(pids: set[int], timeout_s: float = 5.0) -> set[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = pids & children()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def shm_segments() -> set[str]:
    """nereus's named shared-memory segments in /dev/shm."""
    return set(glob.glob("/dev/shm/nereus-*"))
