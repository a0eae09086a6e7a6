"""What the vLLM adapter does before and around vLLM, checked without vLLM: the
environment of vLLM's external_launcher at TP > 1, and sleep's account in the ledger."""

from __future__ import annotations

import socket

import pytest
import torch

from nereus.engines import vllm_adapter
from nereus.engines.context import EmuContext
from nereus.engines.memory import MemoryLedger
from nereus.engines.vllm_adapter import VllmGenerationEngine, _agree_on_master, launcher_env
from nereus.errors import ConfigError
from nereus.models.parallel import ParallelContext


class _SharedBroadcast:
    """A TP group of ranks in one process: broadcast copies the root's tensor."""

    def __init__(self, rank: int, size: int, board: dict) -> None:
        self.rank, self.size, self.board = rank, size, board

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.rank == src:
            self.board["record"] = tensor.clone()
        else:
            tensor.copy_(self.board["record"])

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Nothing in flight: broadcast copies at once."""


def _ctx(rank: int, size: int, board: dict | None) -> EmuContext:
    comm = _SharedBroadcast(rank, size, board) if board is not None else None
    if comm is None:
        return EmuContext(ParallelContext())
    return EmuContext(ParallelContext(tp_rank=rank, tp_size=size, tp_comm=comm))


def test_every_tp_rank_gets_the_launcher_environment():
    board: dict = {}
    envs = [_agree_on_master(_ctx(r, 3, board)) for r in range(3)]  # rank 0 first
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for r, env in enumerate(envs):
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "3"
        assert env["LOCAL_RANK"] == "0"  # a worker sees one GPU, cuda:0
        assert env["MASTER_ADDR"] == "127.0.0.1"


def test_tp_ranks_on_two_hosts_are_refused():
    with pytest.raises(ConfigError, match="must share one host"):
        launcher_env(1, 2, "another-host-" + socket.gethostname(), "127.0.0.1", 29500)


def _engine(ledger: MemoryLedger, *, on_cpu: bool, sleep_mode: bool, llm) -> VllmGenerationEngine:
    """An engine as __init__ leaves it, around a stand-in for vLLM's LLM."""
    engine = VllmGenerationEngine.__new__(VllmGenerationEngine)
    engine.name, engine.ledger, engine.llm = "gen", ledger, llm
    engine.on_cpu, engine.sleep_mode, engine.is_sleeping = on_cpu, sleep_mode, False
    engine._reserved = {"weights": 600, "kv_cache": 400}
    ledger.reserve("gen/weights", 600)
    ledger.reserve("gen/kv_cache", 400)
    return engine


class _LLM:
    def __init__(self) -> None:
        self.slept = self.woken = 0

    def sleep(self, level: int) -> None:
        self.slept += 1

    def wake_up(self) -> None:
        self.woken += 1


def test_sleep_without_sleep_mode_is_refused():
    ledger = MemoryLedger("vllm-launch-a", 10_000)
    llm = _LLM()
    engine = _engine(ledger, on_cpu=False, sleep_mode=False, llm=llm)
    with pytest.raises(ConfigError, match="enable_sleep_mode=False"):
        engine.sleep()
    assert llm.slept == 0 and ledger.used_bytes == 1000


@pytest.mark.parametrize("freed, given_back", [(1000, 1000), (250, 250), (0, 0), (5000, 1000)])
def test_the_ledger_gives_back_only_what_sleep_freed(monkeypatch, freed, given_back):
    ledger = MemoryLedger(f"vllm-launch-{freed}", 10_000)
    free = iter([1 << 30, (1 << 30) + freed])
    monkeypatch.setattr(vllm_adapter, "_free_device_bytes", lambda: next(free))
    engine = _engine(ledger, on_cpu=False, sleep_mode=True, llm=_LLM())
    assert engine.sleep() == given_back
    assert ledger.used_bytes == 1000 - given_back
    engine.wake_up()
    assert ledger.used_bytes == 1000 and not engine.is_sleeping


class _Core:
    def __init__(self) -> None:
        self.shut = 0

    def shutdown(self) -> None:
        self.shut += 1


class _Running:
    """vLLM's LLM as far as close() reaches into it."""

    def __init__(self) -> None:
        self.llm_engine = type("E", (), {})()
        self.llm_engine.engine_core = _Core()


def test_the_last_engine_of_a_process_tears_down_vllms_parallel_state(monkeypatch):
    from nereus.engines import vllm_adapter

    torn: list[int] = []
    monkeypatch.setattr(vllm_adapter, "_release_parallel_state", lambda: torn.append(1))
    monkeypatch.setattr(vllm_adapter, "_LIVE_ENGINES", 0)
    engines = []
    for i in range(2):
        e = _engine(MemoryLedger(f"dev-{i}", None), on_cpu=True, sleep_mode=False, llm=_Running())
        vllm_adapter.VllmGenerationEngine._count_live(+1)  # as __init__ does around LLM(...)
        e._live = True
        engines.append(e)
    cores = [e.llm.llm_engine.engine_core for e in engines]
    engines[0].close()
    assert cores[0].shut == 1 and torn == []  # another engine still uses vLLM's groups
    engines[1].close()
    assert cores[1].shut == 1 and torn == [1]  # the last one: a rebuilt engine starts clean
    engines[1].close()
    assert torn == [1] and vllm_adapter._LIVE_ENGINES == 0
    built_bare = _engine(MemoryLedger("dev-x", None), on_cpu=True, sleep_mode=False, llm=_Running())
    built_bare.close()  # never counted (it never started vLLM): nothing torn down
    assert torn == [1] and vllm_adapter._LIVE_ENGINES == 0
