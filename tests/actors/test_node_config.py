"""Node daemon and key configuration checks (no processes)."""

from __future__ import annotations

import pytest

from nereus.actors._keys import KEY_ENV, MIN_KEY_BYTES, generate_key, load_key
from nereus.actors._node import NodeDaemon, _add_tunable, _gpu_ids, _Worker, death_reason
from nereus.errors import ConfigError

KEY = b"k" * 32


def test_devices_or_gpus_exactly_one():
    with pytest.raises(ConfigError, match="exactly one"):
        NodeDaemon("tcp://x:1", KEY)
    with pytest.raises(ConfigError, match="exactly one"):
        NodeDaemon("tcp://x:1", KEY, devices=2, gpus="0")
    with pytest.raises(ConfigError, match="devices=0"):
        NodeDaemon("tcp://x:1", KEY, devices=0)
    with pytest.raises(ConfigError, match="transport"):
        NodeDaemon("tcp://x:1", KEY, devices=1, transport="udp")
    with pytest.raises(ConfigError, match="memory_per_device"):
        NodeDaemon("tcp://x:1", KEY, devices=1, memory_per_device="lots")
    node = NodeDaemon("tcp://x:1", KEY, devices=3, memory_per_device="1.5GiB")
    assert node.count == 3 and node.kind == "cpu"
    assert node.memory_bytes == [int(1.5 * 2**30)] * 3


def test_glibc_tunables_keep_what_the_user_set():
    env: dict[str, str] = {}
    _add_tunable(env, "glibc.cpu.x", 1 << 18)
    assert env["GLIBC_TUNABLES"] == "glibc.cpu.x=0x40000"
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    _add_tunable(env, "glibc.cpu.x", 16)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.cpu.x=0x10"
    env = {"GLIBC_TUNABLES": "glibc.cpu.x=0x100000"}
    _add_tunable(env, "glibc.cpu.x", 16)
    assert env["GLIBC_TUNABLES"] == "glibc.cpu.x=0x100000"


def test_gpu_lists():
    assert _gpu_ids("0,2, 3", {}) == [(0, "0"), (2, "2"), (3, "3")]
    for bad in ("", "0,0", "-1", "a,b"):
        with pytest.raises(ConfigError, match="gpus="):
            _gpu_ids(bad, {})


def test_gpus_map_within_a_narrowed_visible_set():
    # Inside a Slurm step that was given GPUs 2 and 3 (or a container given two GPUs),
    # the daemon's GPU 1 is the host's GPU 3: a worker must see "3", never the raw "1".
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert _gpu_ids("all", env) == [(0, "2"), (1, "3")]
    assert _gpu_ids("1", env) == [(1, "3")]
    with pytest.raises(ConfigError, match="names GPU 2.*CUDA_VISIBLE_DEVICES='2,3'.*0..1"):
        _gpu_ids("0,2", env)
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aa, MIG-bb"}
    assert _gpu_ids("all", uuids) == [(0, "GPU-aa"), (1, "MIG-bb")]
    with pytest.raises(ConfigError, match="gpus='all' but CUDA_VISIBLE_DEVICES=''"):
        _gpu_ids("all", {"CUDA_VISIBLE_DEVICES": ""})


def test_gpu_workers_get_their_share_of_the_visible_set(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    node = NodeDaemon("tcp://x:1", KEY, gpus="all", memory_per_device="1GiB")
    assert node.kind == "cuda" and node.count == 2
    envs = [node._env(w) for w in (_Worker(10, 0), _Worker(11, 1))]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "6"]


def test_death_reasons():
    assert death_reason(-9) == "SIGKILL"
    assert death_reason(-15) == "SIGTERM"
    assert death_reason(1) == "exit code 1"
    assert death_reason(0) == "exit code 0"


def test_keys(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="no cluster key"):
        load_key()
    monkeypatch.setenv(KEY_ENV, "e" * 20)
    assert load_key() == b"e" * 20
    f = tmp_path / "key"
    f.write_text("  " + "f" * 24 + "\n")
    assert load_key(key_file=str(f)) == b"f" * 24  # the file wins over the environment
    assert load_key("g" * 16) == b"g" * 16  # an explicit key wins over both
    with pytest.raises(ConfigError, match=f"at least {MIN_KEY_BYTES}"):
        load_key("short")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_key(key_file=str(tmp_path / "missing"))
    assert len(generate_key()) == 64 and generate_key() != generate_key()
