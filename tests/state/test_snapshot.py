"""Published snapshots (``nereus.state.snapshot``) on real worker processes: a weight sync
reads the snapshot, not the live parameters, while a sequential call (a training step)
is still running on the sending worker; the snapshot is in the device's ledger; sends
that read anything else are refused."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from nereus.actors import Cluster, endpoint, in_thread
from nereus.config import to_dict
from nereus.engines import EngineHost, spawn_hosts
from nereus.errors import RemoteError
from nereus.models import model_spec, tiny_config
from nereus.state import EMU, Layout, execute_into, plan_reshard, training_slots
from nereus.state.emu import emu_to_plain
from nereus.state.snapshot import snapshot_name
from nereus.transfer import make_group

pytestmark = pytest.mark.integration

CONFIG = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
SPEC = model_spec(CONFIG)
KEY = "model.layers.0.self_attn.qkv_proj.weight"


class TrainingLikeHost(EngineHost):
    @endpoint
    async def busy(self, seconds: float, emu: str) -> float:
        """A sequential call that holds this worker's mailbox for ``seconds`` (in a thread,
        as a training step runs), then moves ``emu``'s parameters, as its optimizer step
        would. Returns when it ended."""
        await in_thread(time.sleep, seconds)
        with torch.no_grad():
            for t in self.shards[emu].values():
                t.add_(1.0)
        return time.time()


@pytest.mark.timeout(120)
async def test_a_sync_reads_the_snapshot_while_a_sequential_call_runs_on_the_sender():
    train = EMU("train.0", "policy_training", SPEC, Layout(), (0,), training_slots("float32"))
    gen = EMU("gen.0", "policy_generation", SPEC, Layout(), (1,))
    published = train.with_(name=snapshot_name(train.name), slots=("param",))
    async with Cluster.local(devices=2, memory_per_device="128MiB") as cluster:
        mesh = await spawn_hosts(cluster, host_class=TrainingLikeHost)
        hosts = {r.device: r for r in mesh.refs}
        plain = to_dict(CONFIG)
        await hosts[0].load_weights.call_one(emu_to_plain(train), plain, None, 1)
        await hosts[1].load_weights.call_one(emu_to_plain(gen), plain, None, 2)
        out = await hosts[0].snapshot.call_one("train.0", published.name, 7)
        params = {k: t for k, t in train.shards_on(0).items() if ":" not in k}
        assert out["version"] == 7 and out["bytes"] > 0
        ledger = await hosts[0].ledger_report.call_one()
        assert ledger["breakdown"][f"shards/{published.name}"] == out["bytes"]
        snap = await hosts[0].get_shards.call_one(published.name)
        assert set(snap) == set(params)  # parameters only: no optimizer slots

        plan = plan_reshard([published], gen, lambda d: 0)
        group = await make_group(cluster, devices=sorted(plan.devices()), epoch=1)
        # the sending worker is inside a long sequential call that then changes its weights
        busy = asyncio.ensure_future(hosts[0].busy.call_one(3.0, "train.0"))
        await asyncio.sleep(0.3)
        stats = await execute_into([plan], hosts, group, from_snapshots=True)
        synced_at = time.time()
        assert stats.snapshot_version == 7 and stats.bytes_moved > 0
        ended = await busy
        assert synced_at < ended, "the sync waited for the sequential call"
        got = await hosts[1].get_shards.call_one("gen.0")
        live = await hosts[0].get_shards.call_one("train.0")
        assert torch.equal(got[KEY], snap[KEY])  # the snapshot's values ...
        assert torch.equal(live[KEY], snap[KEY] + 1.0)  # ... not the live ones, moved since

        # a publish replaces the values in place, with the new version
        again = await hosts[0].snapshot.call_one("train.0", published.name, 8)
        assert again["version"] == 8
        stats = await execute_into([plan], hosts, group, from_snapshots=True)
        assert stats.snapshot_version == 8
        got = await hosts[1].get_shards.call_one("gen.0")
        assert torch.equal(got[KEY], live[KEY])

        # a send may read only snapshots: the live EMU is refused, naming it
        live_plan = plan_reshard([train], gen, lambda d: 0)
        with pytest.raises(RemoteError, match=r"reads \['train.0'\], which are not snapshots"):
            await execute_into([live_plan], hosts, group, from_snapshots=True)
        await group.destroy()

        # dropped like any EMU: out of the store and the ledger
        await hosts[0].drop_shards.call_one([published.name])
        ledger = await hosts[0].ledger_report.call_one()
        assert f"shards/{published.name}" not in ledger["breakdown"]
        await mesh.stop()
