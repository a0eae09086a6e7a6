"""``nereus dashboard``: its server (page, stream, JSON, Host check, policy), its sources
(a followed file, metrics.jsonl records), its command line, the recorder of the test
stream, and the page in headless Chromium driven live by the recorded tap stream,
replayed signed through a real PUB socket.

The browser test needs Debian's chromium at /usr/bin/chromium (``make test`` installs
it); without it the test fails and says so: it never skips."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
import zmq

from nereus.actors import _session, _wire
from nereus.monitor import Dashboard, DashboardView, check_event
from nereus.monitor.dashboard import READY_PREFIX, events_from_jsonl, read_jsonl
from nereus.planner.plan_text import stage_change_text
from tests._leaks import children, wait_gone
from tests.monitor._chromium import BrowserError, Chromium
from tests.monitor.test_view import ASSET, JOB_ASSET, holders_of, recorded

pytestmark = pytest.mark.timeout(180)

KEY = b"dashboard-test-key-0123456789abcdef"


def test_the_recorded_stream_follows_the_schema():
    events = recorded()
    assert events and all(check_event(e) == [] for e in events)
    kinds = {e["type"] for e in events}
    assert {
        "plan",
        "step",
        "transition",
        "transition_node",
        "decision",
        "memory",
        "weight_sync",
        "worker_join",
        "device_drain",
        "worker_retire",
        "worker_leave",
    } <= kinds


@pytest.mark.integration
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
            assert not re.search(r"(src|href)=\"(https?:)?//", page), (
                "the page must not load anything from elsewhere"
            )

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
    reader = asyncio.get_running_loop().create_task(
        read_jsonl(dashboard, str(path), follow=True, poll_s=0.02)
    )

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
        assert (
            dashboard.view.steps == 7
            and dashboard.view.rejected == 0
            and dashboard.rejected_by_source == 0
        )
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def test_metrics_records_become_step_events():
    clock = [0.0]
    record = {
        "step": 4,
        "step_seconds": 2.0,
        "generate_seconds": 1.5,
        "reward_mean": 0.25,
        "response_len_mean": 30.0,
        "max_new_tokens": 64,
        "tokens_generated": 960,
        "model_stage_seconds": {"policy_generation": 1.5},
        "device_peak_bytes": {"0": 100},
        "epoch": 2,
        "policy_version": 4,
    }
    event = events_from_jsonl(json.dumps(record), "metrics.jsonl:5", clock)
    event2 = events_from_jsonl(json.dumps(record | {"step": 5}), "metrics.jsonl:6", clock)
    assert (
        event["type"] == "step"
        and event["reward"] == 0.25
        and event["response_length_tokens"] == 30.0
    )
    assert (
        event["stage_seconds"] == {"step": 2.0, "generate": 1.5}
        and event["time_monotonic_seconds"] == 2.0
    )
    assert event2["time_monotonic_seconds"] == 4.0
    view = DashboardView()
    (update,) = view.add(event)
    assert update["step_seconds"] == 2.0 and update["model_stage_seconds"] == {
        "policy_generation": 1.5
    }
    assert events_from_jsonl("  \n", "f:1", clock) is None
    with pytest.raises(ValueError, match="f:2: not JSON"):
        events_from_jsonl("{oops", "f:2", clock)
    with pytest.raises(ValueError, match="f:3: neither a tap event"):
        events_from_jsonl('{"loss": 1}', "f:3", clock)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nereus.cli", "dashboard", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.integration
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


# --- the page in a browser -----------------------------------------------------------------


@pytest.mark.integration
async def test_a_browser_that_cannot_start_fails_and_says_why(tmp_path):
    with pytest.raises(BrowserError, match="is missing: .*make test. installs it"):
        await Chromium.start(binary=str(tmp_path / "no-chromium"))
    with pytest.raises(BrowserError, match=r"exited \(1\) before it was ready"):
        await Chromium.start(binary="/bin/false")


@pytest.fixture
async def chromium():
    """Headless Chromium; fails (never skips) when it cannot start, and checks that it,
    and whatever the test started, left no process behind."""
    before = children()
    browser = await Chromium.start()
    try:
        yield browser
    finally:
        await browser.close()
    assert not wait_gone(children() - before, 10.0), "the browser test left processes behind"


async def _start_dashboard(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nereus.cli",
        "dashboard",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            raise AssertionError(
                f"the dashboard exited ({await proc.wait()}): {(await proc.stderr.read()).decode()}"
            )
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX) :].strip()


def _expected_rects(plan: dict) -> set[tuple[int, str, str, int]]:
    return {
        (int(d), stage, layout, emu)
        for d, hs in holders_of(plan).items()
        for stage, layout, emu in hs
    }


async def _shown_rects(page, epoch: int) -> set[tuple[int, str, str, int]]:
    rows = await page.evaluate(f"""[...document.querySelectorAll(
            '#chart-bands rect.band[data-epoch="{epoch}"]')]
        .map(r => [Number(r.dataset.device), r.dataset.modelStage, r.dataset.layout,
                   Number(r.dataset.emu)])""")
    return {tuple(r) for r in rows}


def _header(name: str) -> str:
    return f"document.getElementById('h-{name}').textContent"


@pytest.mark.integration
async def test_the_page_follows_a_recorded_tap_live_in_chromium(tmp_path, chromium):
    events = recorded()
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    proc, url = await _start_dashboard(
        "--tap", f"tcp://127.0.0.1:{port}", "--key-file", str(key_file), "--port", "0"
    )

    tap_id, seqs = os.urandom(16), itertools.count(1)

    def publish(event: dict, key: bytes = KEY) -> None:
        # as the controller publishes: one frame, the envelope (sender, any receiver, a
        # growing sequence number) under the signature
        body = msgpack.packb(event)
        envelope = _session.envelope(tap_id, _session.ANY, next(seqs))
        pub.send(_wire.sign(key, body, (), envelope) + envelope + body)

    try:
        assert url.startswith("http://127.0.0.1:")
        page = await chromium.new_page(width=1400, height=1000)
        await page.goto(url)
        assert await page.wait_for(f"{_header('verified')} === 'signed events verified'")

        # PUB/SUB joins asynchronously: probe until the page has counted an event
        async def joined() -> None:
            while True:
                publish(
                    {
                        "type": "tap_probe",
                        "v": 1,
                        "seq": 0,
                        "time_monotonic_seconds": events[0]["time_monotonic_seconds"],
                        "epoch": 0,
                        "source": "test",
                    }
                )
                try:
                    await page.wait_for(f"Number({_header('events')}) > 0", timeout_s=2.0)
                    return
                except AssertionError:
                    continue

        await asyncio.wait_for(joined(), 120)

        # the first part of the run: up to the end of the first change
        cut = next(i for i, e in enumerate(events) if e["type"] == "transition") + 1
        for e in events[:cut]:
            publish(e)
        steps_before = sum(e["type"] == "step" for e in events[:cut])
        assert await page.wait_for(
            f"document.body.dataset.steps === '{steps_before}' && "
            f"{_header('transitions')} === '1' && {_header('decisions')} === '1'"
        )
        plan = next(e for e in events if e["type"] == "plan")["plan"]
        first_change = events[cut - 1]
        assert await _shown_rects(page, 1) == _expected_rects(plan)
        assert await _shown_rects(page, 2) == _expected_rects(first_change["to_plan"])
        await page.evaluate("window.__same_page = true")

        # a forged event is dropped and counted; the rest of the run arrives live
        publish(
            {
                "type": "step",
                "v": 1,
                "seq": 999,
                "step": 99,
                "time_monotonic_seconds": 0.0,
                "epoch": 9,
                "source": "forger",
            },
            key=b"not-the-cluster-key-0123456789",
        )
        for e in events[cut:]:
            publish(e)
        steps = [e for e in events if e["type"] == "step"]
        assert await page.wait_for(
            f"document.body.dataset.steps === '{len(steps)}' && "
            f"{_header('transitions')} === '2' && {_header('rejected')} === '1' && "
            "document.querySelectorAll('#log li').length >= 8"
        )
        assert await page.evaluate("window.__same_page === true"), (
            "the page reloaded instead of updating"
        )

        # the header
        assert await page.evaluate(_header("epoch")) == str(max(e["epoch"] for e in events))
        assert await page.evaluate(_header("decisions")) == "3"

        # step time by model-stage, reward and length: one point per step, values as recorded
        series = await page.evaluate("""Object.fromEntries(
            [...document.querySelectorAll('svg g.series')]
            .map(g => [g.closest('svg').id + '/' + g.dataset.series, Number(g.dataset.points)]))""")
        stages = sorted({k for s in steps for k in s["model_stage_seconds"]})
        assert {f"chart-steptime/{s}" for s in stages} | {
            "chart-steptime/step",
            "chart-steptime/weight sync",
        } <= set(series)
        assert all(series[f"chart-steptime/{s}"] == len(steps) for s in stages + ["step"])
        assert series["chart-reward/reward"] == len(steps) == series["chart-length/response length"]
        assert series["chart-length/length cap"] == len(steps)
        rewards = await page.evaluate("""[...document.querySelectorAll(
            '#chart-reward circle title')]
            .map(t => t.textContent)""")
        assert [r.split(":")[0] for r in rewards] == [f"reward, step {s['step']}" for s in steps]
        assert [float(r.rsplit(": ", 1)[1]) for r in rewards] == pytest.approx(
            [s["reward"] for s in steps], rel=6e-3
        )
        caps = await page.evaluate("""[...document.querySelectorAll(
            '#chart-length g[data-series="length cap"] title')]
            .map(t => t.textContent)""")
        assert [float(c.split(": ")[1].split()[0]) for c in caps] == [
            s["max_new_tokens"] for s in steps
        ]

        # which model-stage holds which device: a band per device per placement, as the plans say
        transitions = [e for e in events if e["type"] == "transition"]
        assert await _shown_rects(page, 1) == _expected_rects(plan)
        for t in transitions:
            assert await _shown_rects(page, t["epoch"]) == _expected_rects(t["to_plan"])
        devices = await page.evaluate(
            "[...document.querySelectorAll('#chart-bands .device-label')].map(t => t.textContent)"
        )
        assert devices == [f"device {d}" for d in range(4)]
        marks = await page.evaluate("""[...document.querySelectorAll(
            '#chart-bands g.transition-mark')]
            .map(g => [Number(g.dataset.epochFrom), Number(g.dataset.epochTo), g.dataset.ok])""")
        assert marks == [[t["epoch_from"], t["epoch"], "true"] for t in transitions]
        states = await page.evaluate("""[...document.querySelectorAll(
            '#chart-bands rect.device-state')]
            .map(r => [Number(r.dataset.device), r.dataset.state])""")
        assert [3, "draining"] in states and [3, "retired"] in states
        legend = await page.evaluate("""[...document.querySelectorAll('#legend-bands > span')]
            .map(s => s.dataset.modelStage + ' ' + s.dataset.layout)""")
        layouts = {
            f"{st} tp{sp['tp']}·pp{sp['pp']}"
            for p in [plan] + [t["to_plan"] for t in transitions]
            for st, sp in p.items()
        }
        assert set(legend) == layouts

        # memory per device against its budget
        memory = await page.evaluate("""[...document.querySelectorAll('#memory .memrow')].map(r =>
            [Number(r.dataset.device), Number(r.dataset.peak), Number(r.dataset.budget),
             r.dataset.state, r.querySelector('.memtext').textContent])""")
        budget = next(e for e in events if e["type"] == "worker_join")["memory_bytes"]
        last_peak = {int(d): b for s in steps for d, b in s["device_peak_bytes"].items()}
        assert [m[0] for m in memory] == [0, 1, 2, 3]
        assert all(m[2] == budget for m in memory) and all(
            f"/ {budget / 2**20:.2f} MiB" in m[4] for m in memory
        )
        assert {m[0]: m[1] for m in memory} == last_peak
        assert memory[3][3] == "retired"

        # the decisions, newest first, with their saving, cost and verdict
        decisions = [e for e in events if e["type"] == "decision"]
        rows = await page.evaluate("""[...document.querySelectorAll('#decisions tbody tr')].map(r =>
            [Number(r.dataset.step), r.dataset.admitted, r.querySelector('.saving').textContent,
             r.querySelector('.cost').textContent, r.querySelector('.verdict').textContent,
             r.lastChild.textContent])""")
        assert [r[0] for r in rows] == [d["step"] for d in reversed(decisions)]
        assert [r[4] for r in rows] == [
            "admitted" if d["admitted"] else "rejected" for d in reversed(decisions)
        ]
        assert [r[5] for r in rows] == [d["reason"] for d in reversed(decisions)]
        # the proposed change with dp and devices: the rejected one only regroups generation's
        # devices
        proposed = await page.evaluate(
            "[...document.querySelectorAll('#decisions tbody tr')]"
            ".map(r => r.children[2].textContent)"
        )
        assert proposed[1] == "policy_generation: tp2·pp1·dp2 [0-3] → tp1·pp1·dp4 [0-3]"
        assert proposed == [
            "; ".join(
                f"{st}: {stage_change_text(d['current_plan'][st], d['target_plan'][st])}"
                for st in sorted(d["target_plan"])
                if d["target_plan"][st] != d["current_plan"][st]
            )
            for d in reversed(decisions)
        ]
        for r, d in zip(rows, reversed(decisions), strict=True):
            assert _seconds(r[2]) == pytest.approx(d["saving_seconds"], rel=6e-3)
            assert _seconds(r[3]) == pytest.approx(d["transition_seconds"], rel=6e-3)

        # the transitions, newest first: predicted against measured, and their DAG nodes per device
        rows = await page.evaluate("""[...document.querySelectorAll('#transitions tbody tr')]
            .map(r =>
            [r.querySelector('.predicted').textContent, r.querySelector('.measured').textContent,
             r.querySelectorAll('rect.node').length, r.children[2].textContent])""")
        nodes = [e for e in events if e["type"] == "transition_node"]
        cuts = [events.index(t) for t in transitions]
        per = [
            [n for n in nodes if (cuts[i - 1] if i else -1) < events.index(n) < cuts[i]]
            for i in range(len(cuts))
        ]
        for r, t, ns in zip(rows, reversed(transitions), reversed(per), strict=True):
            assert _seconds(r[0]) == pytest.approx(t["predicted_seconds"], rel=6e-3)
            assert _seconds(r[1]) == pytest.approx(t["measured_seconds"], rel=6e-3)
            assert r[2] == sum(len(n["devices"]) for n in ns)
            assert r[3] == "; ".join(
                f"{st}: {stage_change_text(t['from_plan'][st], t['to_plan'][st])}"
                for st in t["changed"]
            )
        assert rows[-1][3].startswith("policy_generation: tp1·pp1·dp4 [0-3] → tp2·pp1·dp2 [0-3]; ")

        # the picture: every band colour the page drew is on the screenshot
        shot = tmp_path / "dashboard.png"
        png = await page.screenshot(shot)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        fills = await page.evaluate(
            "[...new Set([...document.querySelectorAll('rect.band')]"
            ".map(r => r.getAttribute('fill')))]"
        )
        image = _rgb(shot)
        assert image.shape[1] == 1400 and image.shape[0] > 1000
        for fill in fills:
            rgb = [int(fill[i : i + 2], 16) for i in (1, 3, 5)]
            assert int((image == rgb).all(axis=2).sum()) > 300, (
                f"band colour {fill} is not on the screenshot"
            )
        assert page.errors == [], page.errors
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)
        pub.close(linger=0)
    assert proc.returncode == 0, (await proc.stderr.read()).decode()


@pytest.mark.integration
async def test_the_page_over_a_job_recording_shows_every_device_budget_in_chromium(
    tmp_path, chromium
):
    """``make demo``'s tap.jsonl, written by the job's own recorder: no ``worker_join`` of
    the starting devices (it subscribed after them), no ``memory`` events (the job emits
    none; the ones in the recording are the recorder script's, taken out here)."""
    lines = [
        line
        for line in JOB_ASSET.read_text().splitlines(keepends=True)
        if json.loads(line)["type"] != "memory"
    ]
    assert not [line for line in lines if json.loads(line)["type"] == "worker_join"]
    path = tmp_path / "tap.jsonl"
    path.write_text("".join(lines))
    budget = next(e for e in recorded() if e["type"] == "worker_join")["memory_bytes"]
    proc, url = await _start_dashboard("--jsonl", str(path), "--port", "0")
    try:
        page = await chromium.new_page(width=1400, height=1000)
        await page.goto(url)
        assert await page.wait_for(
            f"{_header('transitions')} === '2' && document.body.dataset.steps === '7'"
        )
        memory = await page.evaluate("""[...document.querySelectorAll('#memory .memrow')].map(r =>
            [Number(r.dataset.device), Number(r.dataset.budget),
             r.querySelector('.memtext').textContent])""")
        assert [m[0] for m in memory] == [0, 1, 2, 3]
        assert all(
            m[1] == budget and f"/ {budget / 2**20:.2f} MiB" in m[2] and "unknown" not in m[2]
            for m in memory
        ), memory
        assert page.errors == [], page.errors
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0, (await proc.stderr.read()).decode()


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]


def _rgb(path: Path) -> np.ndarray:
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    return np.rint(image[..., :3] * 255).astype(int)
