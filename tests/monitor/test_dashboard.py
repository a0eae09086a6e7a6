"""``nereus dashboard``: its server (page, stream, JSON, Host check, policy), its sources
(a followed file, metrics.jsonl records), its command line, and the recorder of the
test stream."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import subprocess
import sys

import aiohttp
import pytest

from nereus.monitor import Dashboard, DashboardView, check_event
from nereus.monitor.dashboard import events_from_jsonl, read_jsonl
from tests.monitor.test_view import ASSET, recorded

pytestmark = pytest.mark.timeout(180)


def test_the_recorded_stream_follows_the_schema():
    events = recorded()
    assert events and all(check_event(e) == [] for e in events)
    kinds = {e["type"] for e in events}
    assert {"plan", "step", "transition", "transition_node", "decision", "memory", "weight_sync",
            "worker_join", "device_drain", "worker_retire", "worker_leave"} <= kinds


async def test_the_recorder_still_records_the_story(tmp_path):
    from tests.monitor.record_tap import record

    events = await record(tmp_path / "tap.jsonl", tmp_path)
    counts = {t: sum(e["type"] == t for e in events) for t in {e["type"] for e in events}}
    assert counts["step"] == 7 and counts["transition"] == 2 and counts["decision"] == 3
    assert counts["worker_join"] == 4 and counts["worker_retire"] == 1 and counts["plan"] == 1
    assert [e["admitted"] for e in events if e["type"] == "decision"] == [True, False, True]
    assert [e["ok"] for e in events if e["type"] == "transition"] == [True, True]
    assert (tmp_path / "tap.jsonl").read_text().count("\n") == len(events)


# --- the server --------------------------------------------------------------------------

async def test_the_server_serves_the_page_the_stream_and_the_json(tmp_path):
    dashboard = Dashboard(source=f"file {ASSET}", verified=None, port=0)
    url = await dashboard.start()
    try:
        await read_jsonl(dashboard, str(ASSET))
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as r:
                page = await r.text()
                policy = r.headers["Content-Security-Policy"]
            # the policy admits the page's one inline script by its hash, and nothing from elsewhere
            (script,) = re.findall(r"<script>(.*?)</script>", page, flags=re.S)
            digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
            assert f"script-src 'sha256-{digest}'" in policy and "default-src 'none'" in policy
            assert "connect-src 'self'" in policy
            assert not re.search(r"(src|href)=\"(https?:)?//", page), "the page must not load anything from elsewhere"

            async with http.get(url + "api/updates") as r:
                body = await r.json()
            assert body["updates"] == json.loads(json.dumps(dashboard.view.updates))
            assert body["status"]["steps"] == 7 and body["status"]["verified"] is None
            assert body["status"]["state"].startswith(f"read {ASSET}")

            # the stream: reset, then every update so far, then status
            async with http.get(url + "events") as r:
                assert r.headers["Content-Type"] == "text/event-stream"
                got: list = []
                names = []
                while "status" not in names:
                    block = (await r.content.readuntil(b"\n\n")).decode()
                    name = re.search(r"^event: (\w+)$", block, flags=re.M).group(1)
                    data = json.loads(re.search(r"^data: (.*)$", block, flags=re.M).group(1))
                    names.append(name)
                    if name == "updates":
                        got += data
                assert names[0] == "reset" and got == body["updates"]

            # a page elsewhere that rebinds its name to 127.0.0.1 cannot read the run
            async with http.get(url + "api/status", headers={"Host": "evil.example:80"}) as r:
                assert r.status == 403
            async with http.get(url + "nothing-here") as r:
                assert r.status == 404
    finally:
        await dashboard.close()


async def test_a_page_that_connects_later_gets_what_it_missed_then_live_updates():
    events = recorded()
    dashboard = Dashboard(source="test", verified=True, port=0)
    url = await dashboard.start()
    try:
        for e in events[:20]:
            dashboard.add(e)
        async with aiohttp.ClientSession() as http, http.get(url + "events") as r:
            seen: list = []

            async def read_until(n: int) -> None:
                while len(seen) < n:
                    block = (await r.content.readuntil(b"\n\n")).decode()
                    if block.startswith("event: updates"):
                        seen.extend(json.loads(block.split("data: ", 1)[1]))

            first = len(dashboard.view.updates)
            await asyncio.wait_for(read_until(first), 10)
            for e in events[20:]:
                dashboard.add(e)
            await asyncio.wait_for(read_until(len(dashboard.view.updates)), 10)
            assert seen == json.loads(json.dumps(dashboard.view.updates))
    finally:
        await dashboard.close()


async def test_a_followed_file_is_read_as_it_grows(tmp_path):
    lines = ASSET.read_text().splitlines(keepends=True)
    path = tmp_path / "tap.jsonl"
    path.write_text("".join(lines[:30]) + lines[30][:25])  # ends inside a line being written
    dashboard = Dashboard(source=f"file {path}", verified=None, port=0)
    reader = asyncio.get_running_loop().create_task(read_jsonl(dashboard, str(path), follow=True, poll_s=0.02))

    arrived = asyncio.Event()
    add = dashboard.add

    def add_and_tell(event: dict) -> None:
        add(event)
        arrived.set()

    dashboard.add = add_and_tell

    async def until(n: int) -> None:
        while dashboard.view.status()["events"] < n:
            arrived.clear()
            await arrived.wait()

    try:
        await asyncio.wait_for(until(30), 10)
        assert dashboard.state == f"following {path}" and dashboard.rejected_by_source == 0
        with open(path, "a") as fh:
            fh.write(lines[30][25:] + "".join(lines[31:]))
        await asyncio.wait_for(until(len(lines)), 10)
        assert dashboard.view.steps == 7 and dashboard.view.rejected == 0 and dashboard.rejected_by_source == 0
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def test_metrics_records_become_step_events():
    clock = [0.0]
    record = {"step": 4, "step_seconds": 2.0, "generate_seconds": 1.5, "reward_mean": 0.25, "response_len_mean": 30.0,
              "max_new_tokens": 64, "tokens_generated": 960, "model_stage_seconds": {"policy_generation": 1.5},
              "device_peak_bytes": {"0": 100}, "epoch": 2, "policy_version": 4}
    event = events_from_jsonl(json.dumps(record), "metrics.jsonl:5", clock)
    event2 = events_from_jsonl(json.dumps(record | {"step": 5}), "metrics.jsonl:6", clock)
    assert event["type"] == "step" and event["reward"] == 0.25 and event["response_length_tokens"] == 30.0
    assert event["stage_seconds"] == {"step": 2.0, "generate": 1.5} and event["time_monotonic_seconds"] == 2.0
    assert event2["time_monotonic_seconds"] == 4.0
    view = DashboardView()
    (update,) = view.add(event)
    assert update["step_seconds"] == 2.0 and update["model_stage_seconds"] == {"policy_generation": 1.5}
    assert events_from_jsonl("  \n", "f:1", clock) is None
    with pytest.raises(ValueError, match="f:2: not JSON"):
        events_from_jsonl("{oops", "f:2", clock)
    with pytest.raises(ValueError, match="f:3: neither a tap event"):
        events_from_jsonl('{"loss": 1}', "f:3", clock)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nereus.cli", "dashboard", *args], capture_output=True,
                          text=True, timeout=60)


def test_the_command_refuses_what_it_cannot_serve(tmp_path):
    out = _cli("--jsonl", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "--jsonl=" in out.stderr and "is not a file" in out.stderr
    out = _cli("--jsonl", str(ASSET), "--key-file", str(tmp_path / "k"))
    assert out.returncode == 2 and "carries no signatures" in out.stderr
    out = _cli("--tap", "127.0.0.1:5556")
    assert out.returncode == 2 and "must look like 'tcp://HOST:PORT'" in out.stderr
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    out = _cli("--tap", "tcp://127.0.0.1:5556", "--key-file", str(short))
    assert out.returncode == 2 and "at least 16" in out.stderr and "tiny" not in out.stderr
    out = _cli()
    assert out.returncode == 2 and "--tap" in out.stderr
