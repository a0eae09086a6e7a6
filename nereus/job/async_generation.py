"""The generation side of asynchronous RL: producers and weight syncs (``AsyncRun``'s
``Generation`` half, ``nereus.job.async_loop``).

- Producers: one producer task per policy-generation EMU, started with
  ``asyncio.create_task`` and never awaited by the training loop. Each takes the next
  entries of the global order the gate allows (``nereus.rl.async_buffer``), opens a
  request on its EMU (ReMax's baseline rows greedy in it) and decodes it
  ``decode_steps_per_call`` steps per call (``EngineHost.advance_rollout``); every
  returned token is tagged with the policy version its EMU held during the call. An entry
  whose rows are all done is scored (the task's rule) and enters the buffer at once with
  its prompt's global sample index; its request goes on for the others. With ``[rl]
  refill = true`` (off by default) the request stays open: after each call the slots of
  done rows take the rows of the next entries the gate allows (all of an entry's rows at once,
  ``nereus.job.async_refill``), and it closes when every row is done and none is
  allowed; without partial rollouts an EMU that needs newer weights stops refilling and
  lets its request drain first.
- Weight sync: after each update the trainer publishes the new weights: every
  policy-training device copies its parameters into a snapshot (``nereus.state.snapshot``,
  a copy on the device, reserved in its ledger), which takes one short call and is the
  only pause training makes for generation. Each generation EMU then takes that version
  itself, under its own lock, with the same in-place reshard plans as sync mode
  (``nereus.state.plan_reshard`` / ``execute_into``, the snapshots as sources), while the
  next update already runs: the training workers send from the snapshot in a concurrent
  endpoint. Each sync is bounded by ``sync_timeout_s`` (``DeadlineExceeded`` names the EMU
  and its devices) and tags what follows with the version the snapshot held; a publish
  waits for syncs reading the previous one, and holds new ones off, so a sync reads one
  version on every device. With ``partial_rollout`` the lock is held per decode call and
  the EMU syncs before its next call, so a request in flight reads the new weights with
  its KV cache kept. Without it an EMU holds its lock for a whole request and takes the
  newest weights between requests.

A producer whose worker died loses only its unfinished entries (issued again from the
same positions); a fault elsewhere is raised to the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from nereus.actors import emit
from nereus.errors import DeadlineExceeded
from nereus.job.async_recovery import is_own_death
from nereus.job.async_refill import OpenRequest
from nereus.job.recovery import is_fault
from nereus.job.traces import response_lengths
from nereus.rl.algorithms import sampling_seed
from nereus.rl.async_buffer import Group
from nereus.state import execute_into, plan_reshard
from nereus.state.snapshot import snapshot_name
from nereus.transfer import make_group

__all__ = ["Generation", "PublishGate", "Worker"]

log = logging.getLogger("nereus.rl")


@dataclass
class Worker:
    """One policy-generation EMU as the producer sees it."""

    emu: Any  # nereus.engines.EmuHandle
    plan: Any  # the reshard plan policy-training -> this EMU
    group: Any  # the transfer group of that plan (None when no byte crosses hosts)
    version: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    alive: bool = True
    busy_s: float = 0.0
    sync_s: float = 0.0  # seconds in weight syncs
    syncs: int = 0
    tokens: int = 0
    current: list[int] = field(default_factory=list)  # entries of the request in flight

    @property
    def name(self) -> str:
        return self.emu.name


class PublishGate:
    """Weight syncs read the snapshots together; a publish waits until none reads and
    holds new ones off until it is done (there is one publisher, the trainer)."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.readers = 0
        self.writing = False

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writing)
            self.readers += 1
        try:
            yield
        finally:
            async with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self.cond:
            self.writing = True
            await self.cond.wait_for(lambda: self.readers == 0)
        try:
            yield
        finally:
            async with self.cond:
                self.writing = False
                self.cond.notify_all()


class Generation:
    """The producers and weight syncs of an ``AsyncRun`` (see the module docstring): its
    ``stages``, ``mode``, ``ledger``, ``changed``, ``workers`` and ``version`` are the run's."""

    # --- weight syncs -----------------------------------------------------------------

    async def _make_workers(self) -> None:
        st = self.stages
        sources = [
            e.with_(name=snapshot_name(e.name), slots=("param",))
            for e in st.emus["policy_training"]
        ]
        for emu_handle, emu in zip(
            st.handles["policy_generation"].emus, st.emus["policy_generation"], strict=True
        ):
            plan = plan_reshard(sources, emu, st._host_of)
            group = None
            if plan.remote_moves():
                group = await make_group(
                    st.cluster, devices=sorted(plan.devices()), epoch=st.epoch, tag=emu.name
                )
            self.workers.append(Worker(emu_handle, plan, group, self.version))

    async def _publish(self) -> dict[str, Any]:
        """policy-training's weights now become the snapshot every sync reads (version
        ``self.version``); producers waiting for them are woken."""
        st = self.stages
        t0 = time.perf_counter()
        calls = [
            (d, emu.name, snapshot_name(emu.name))
            for emu in st.emus["policy_training"]
            for d in emu.devices
        ]
        async with self.gate.write():
            out = await asyncio.gather(
                *(st.hosts[d].snapshot.call_one(src, name, self.version) for d, src, name in calls)
            )
            self.published = self.version
        self.snapshots = {}
        for d, _, name in calls:
            self.snapshots.setdefault(d, []).append(name)
        async with self.changed:
            self.changed.notify_all()
        return {"bytes": sum(o["bytes"] for o in out), "seconds": time.perf_counter() - t0}

    async def _drop_snapshots(self, *, after_fault: bool) -> None:
        """Free the snapshots (a plan change or the run's end); ``after_fault``: a device
        whose worker died has nothing left to free."""
        st, held, self.snapshots = self.stages, self.snapshots, {}
        devices = [d for d in held if d in st.hosts]
        out = await asyncio.gather(
            *(st.hosts[d].drop_shards.call_one(held[d]) for d in devices), return_exceptions=True
        )
        for d, e in zip(devices, out, strict=True):
            if isinstance(e, BaseException):
                if not (after_fault and is_fault(e)):
                    raise e
                log.warning("snapshots on device %d not freed: its worker died (%s)", d, e)

    async def _sync_worker(self, w: Worker) -> dict[str, Any]:
        """The published weights into ``w`` (its lock held by the caller), beside the
        update running; ``w`` is tagged with the version the snapshots held."""
        t0 = time.perf_counter()
        try:
            async with self.gate.read():
                stats = await asyncio.wait_for(
                    execute_into([w.plan], self.stages.hosts, w.group, from_snapshots=True),
                    self.mode.sync_timeout_s,
                )
                version = self.published
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"weight sync to policy_generation EMU {w.name!r} on devices "
                f"{list(w.emu.devices)} did not "
                f"complete within rl.sync_timeout_s={self.mode.sync_timeout_s} s"
            ) from None
        w.version = version if stats.snapshot_version is None else stats.snapshot_version
        async with self.changed:  # a producer waiting at the gate for these weights goes on
            self.changed.notify_all()
        seconds = time.perf_counter() - t0
        w.sync_s += seconds
        w.syncs += 1
        nbytes = stats.bytes_moved + stats.bytes_local
        return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9}

    # --- generation -------------------------------------------------------------------

    def request_cap(self, version: int) -> int:
        """The longest cap a request may run at while policy version ``version`` trains
        next: that version's cap, or with ``[trace] lengths`` (each group at its own
        step's cap, and the gate lets generation run ``max_staleness`` steps ahead) the
        largest cap of those steps: what generation's memory must hold."""
        s = self.cfg.sampling
        if s.lengths is None:
            return s.cap_at(version)
        return max(s.cap_at(t) for t in range(version, version + self.mode.max_staleness + 1))

    def _params(self, positions: list[int], samples: dict[int, Any], greedy: int) -> dict[str, Any]:
        """Sampling of a request for the entries at ``positions`` (their ``samples``; then
        ``greedy`` baseline rows, one per entry). With ``[trace] lengths`` every row gets the
        length a synchronous step gives the same response: the draw of its sample index
        and row at the step its entry belongs to (a PPO entry is row ``entry % k`` of its
        prompt; a baseline row is row 0, as in the synchronous greedy request), and the
        request's cap is the largest of those steps' caps."""
        s = self.cfg.sampling
        params = {
            "max_tokens": s.cap_at(self.version),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "stop_token_ids": [] if s.ignore_eos else [self.job.codec.eos_id],
            "seed": sampling_seed(self.cfg.run.seed, positions[0]),
        }
        if s.lengths is not None:
            steps = [(p - self.ledger.origin) // self.B for p in positions]
            params["max_tokens"] = max(s.cap_at(t) for t in steps)
            per = self.shape.per_prompt
            rows: list[int] = []
            for t, p in zip(steps, positions, strict=True):
                drawn = response_lengths(self.cfg, t, [samples[p].index], per * self.K)
                first = (p % per) * self.K  # a PPO entry's row among its prompt's k
                rows += drawn[first : first + self.K]
            for t, p in list(zip(steps, positions, strict=True))[:greedy]:
                rows += response_lengths(self.cfg, t, [samples[p].index], 1)
            params["row_max_tokens"] = rows
        return params

    def _share(self) -> int:
        """Entries one generation EMU takes at most into a request: its share of a batch."""
        return max(1, -(-self.B // max(1, sum(x.alive for x in self.workers))))

    async def _positions(self, w: Worker) -> list[int]:
        """The next positions ``w`` may start (waits at the gate); [] when none are left.
        An EMU behind the published weights takes them first."""
        most = self._share()
        while True:
            async with self.changed:
                while True:
                    if not self.ledger.has_work() or self.pausing:
                        return []
                    if w.version < self.published:
                        break
                    got = self.ledger.take(w.version, most)
                    if got:
                        return got
                    await self.changed.wait()
            async with w.lock:
                await self._sync_worker(w)

    async def _produce(self, w: Worker) -> None:
        """``w``'s producer loop (see the module docstring)."""
        carry: list[int] = []  # positions taken for a refill that did not fit its request
        while True:
            positions: list[int] = []
            try:
                # the weight sync inside _positions meets a dead EMU as a request does
                positions = carry or await self._positions(w)
                carry = []
                if not positions:
                    return
                if self.mode.refill:
                    carry = await self._refilling_request(w, positions)
                else:
                    await self._request(w, positions)
            except Exception as e:
                if not await self._is_own_fault(w, e):
                    raise
                await self._lose_worker(w, e, positions)
                return

    async def _is_own_fault(self, w: Worker, e: Exception) -> bool:
        """Whether ``e`` is a worker's death that takes ``w`` with it: one of its devices
        died (a death elsewhere, say policy-training's during a weight sync, is raised to
        the training loop)."""
        lost = {d for _, devices in self.lost_workers for d in devices}
        return is_fault(e) and await is_own_death(self.stages, w.emu.devices, e, lost)

    async def _lose_worker(self, w: Worker, e: Exception, positions: list[int]) -> None:
        """``w`` died: its unfinished groups go back to the ledger, issued again."""
        if not w.alive:
            return
        w.alive = False
        self.lost_workers.append((w.name, list(w.emu.devices)))
        async with self.changed:
            lost = [p for p in positions if p in self.ledger.in_flight]
            self.ledger.lose(lost)
            self.regenerated_rows += len(lost) * self.K
            self.changed.notify_all()
        log.warning(
            "generation EMU %s died (%s): %d unfinished groups issued again",
            w.name,
            e,
            len(lost),
        )
        emit(
            "fault",
            step=self.version,
            devices=list(w.emu.devices),
            during="generation",
            error=f"{type(e).__name__}: {e}"[:400],
            committed=False,
            restored_from="",
            redone=False,
            recover_seconds=0.0,
            dropped=[w.name],
            missing=[],
            regenerated_groups=len(lost),
        )

    async def _request(self, w: Worker, positions: list[int]) -> None:
        job, K, shape = self.job, self.K, self.shape
        samples = {p: job.dataset.at(shape.prompt(p)) for p in positions}
        prompts = {p: job.task.prompt_ids(samples[p], job.codec) for p in positions}
        # each entry's K sampled rows, entry after entry, then ReMax's greedy rows
        rows = [prompts[p] for p in positions for _ in range(K)]
        own = [list(range(g * K, (g + 1) * K)) for g in range(len(positions))]
        greedy: list[int] = []
        if shape.baseline:
            greedy = list(range(len(rows), len(rows) + len(positions)))
            rows += [prompts[p] for p in positions]
            own = [o + [r] for o, r in zip(own, greedy, strict=True)]
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        versions: list[list[int]] = [[] for _ in rows]
        released: set[int] = set()
        args: tuple = (rows, self._params(positions, samples, len(greedy)), greedy)
        whole = None if self.mode.partial_rollout else await w.lock.acquire()
        w.current = list(positions)
        try:
            while True:
                out, version = await self._call(w, args)
                args = ()
                for r, (tk, lp) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
                    tokens[r] += tk
                    logprobs[r] += lp
                    versions[r] += [version] * len(tk)
                    w.tokens += len(tk)
                for g, p in enumerate(positions):
                    if p not in released and all(out["done"][r] for r in own[g]):
                        released.add(p)
                        await self._release(
                            p,
                            samples[p],
                            prompts[p],
                            [tokens[r] for r in own[g]],
                            [logprobs[r] for r in own[g]],
                            [versions[r] for r in own[g]],
                        )
                if out["finished"]:
                    return
                if self.pausing:  # a plan change: what is unfinished starts again after it
                    async with self.changed:
                        self.ledger.lose([p for p in positions if p not in released], fault=False)
                    return
        finally:
            w.current = []
            if whole is not None:
                w.lock.release()

    @property
    def prompt_width(self) -> int:
        """The prompt room a refilling request keeps (the longest of the first prompts of
        the global order; a wider one waits for a request of its own)."""
        if self._prompt_width is None:
            self._prompt_width = self.job.max_prompt_tokens()
        return self._prompt_width

    async def _refilling_request(self, w: Worker, positions: list[int]) -> list[int]:
        """``[rl] refill``: a request for ``positions`` kept open while the gate gives more;
        after each call the entries of done rows are released and free slots take the
        next entries (``_refills``). ``positions`` grows with them, so a fault loses what
        is in flight of it. Returns positions taken that did not fit this request (a wider
        prompt or a longer bound: the next request starts with them)."""
        job, shape = self.job, self.shape
        req = OpenRequest(self.K, shape.baseline)
        samples = {p: job.dataset.at(shape.prompt(p)) for p in positions}
        prompts = {p: job.task.prompt_ids(samples[p], job.codec) for p in positions}
        params = self._params(positions, samples, len(positions) if shape.baseline else 0)
        # room for the entries the gate lets in while this request is open
        params["max_tokens"] = max(params["max_tokens"], self.request_cap(self.version))
        width = max(self.prompt_width, *(len(prompts[p]) for p in positions))
        # the EMU's whole share of slots: those no entry takes yet are idle (one token,
        # dropped) until a refill
        idle = max(0, self._share() - len(positions)) * req.per_entry
        rows, greedy = req.first([(p, samples[p], prompts[p]) for p in positions], idle)
        if idle:
            limits = params.get("row_max_tokens") or [params["max_tokens"]] * (len(rows) - idle)
            params["row_max_tokens"] = [*limits, *[1] * idle]
        args: tuple = (rows, params, greedy, None, width)
        room = (width, params["max_tokens"])
        carry: list[int] = []
        draining = False  # no more refills: the request ends, then the EMU syncs
        whole = None if self.mode.partial_rollout else await w.lock.acquire()
        w.current = list(positions)
        try:
            while True:
                out, version = await self._call(w, args)
                w.tokens += sum(len(t) for t in out["tokens"])
                for e in req.record(out, version):
                    await self._release(
                        e.position, e.sample, e.prompt, e.tokens, e.logprobs, e.versions
                    )
                if self.pausing:  # a plan change: what is unfinished starts again after it
                    async with self.changed:
                        self.ledger.lose([*req.positions, *carry], fault=False)
                    return []
                if out["finished"]:  # every row done: the EMU closed the request
                    return carry
                refill: list[dict[str, Any]] = []
                if not draining and not carry:
                    refill, draining = await self._refills(w, req, room, carry, positions)
                w.current = req.positions + carry
                args = (None, None, None, refill or None)
        finally:
            w.current = []
            if whole is not None:
                w.lock.release()

    async def _refills(
        self,
        w: Worker,
        req: OpenRequest,
        room: tuple[int, int],
        carry: list[int],
        taken: list[int],
    ) -> tuple[list[dict[str, Any]], bool]:
        """The next entries the gate allows into ``req``'s free slots, as ``_positions``
        takes them (each appended to ``taken``; one that does not fit ``room``, the
        request's prompt width and cap, to ``carry`` too); returns the refills and whether
        the request must drain instead: when it has fewer slots than the EMU's share now
        (an EMU died), or without partial rollouts when newer weights are published."""
        n = len(req.free) // req.per_entry
        if n == 0:
            return [], False
        async with self.changed:
            if self.pausing or not self.ledger.has_work():
                return [], False
            if len(req.owner) < self._share() * req.per_entry:
                return [], True  # an EMU died: the next request takes the larger share
            if not self.mode.partial_rollout and w.version < self.published:
                return [], True
            got = self.ledger.take(w.version, n)
        taken += got
        if not got:
            return [], False
        job, shape = self.job, self.shape
        width, cap = room
        refill: list[dict[str, Any]] = []
        for p in got:
            sample = job.dataset.at(shape.prompt(p))
            prompt = job.task.prompt_ids(sample, job.codec)
            params = self._params([p], {p: sample}, 1 if shape.baseline else 0)
            limits = params.get("row_max_tokens") or [params["max_tokens"]] * req.per_entry
            if max(limits) > cap or len(prompt) > width + cap - max(limits):
                carry.append(p)
                continue
            refill += req.place(p, sample, prompt, limits)
            self.refilled_entries += 1
        return refill, False

    async def _call(self, w: Worker, args: tuple) -> tuple[dict[str, Any], int]:
        """One decode call on ``w`` and the policy version its weights held during it
        (``w``'s lock taken per call with partial rollouts, and newer published weights
        taken first; the request holds it otherwise), its seconds added to ``w.busy_s``."""
        if self.mode.partial_rollout:
            async with w.lock:
                if w.version < self.published:
                    await self._sync_worker(w)
                t0 = time.perf_counter()
                out, version = await self._advance(w, args), w.version
        else:
            t0 = time.perf_counter()
            out, version = await self._advance(w, args), w.version
        w.busy_s += time.perf_counter() - t0
        return out, version

    async def _advance(self, w: Worker, args: tuple) -> dict[str, Any]:
        self.decode_calls += 1
        results = await w.emu.mesh.advance_rollout.call(
            w.name, self.mode.decode_steps_per_call, *args
        )
        return results[w.emu.last_stage_rank]

    async def _release(
        self,
        position: int,
        sample: Any,
        prompt: list[int],
        tokens: list[list[int]],
        logprobs: list[list[float]],
        versions: list[list[int]],
    ) -> None:
        """The entry at ``position`` is done (its rows as ``_request`` laid them out: the
        sampled ones, then a baseline row): scored and into the buffer."""
        job, K = self.job, self.K
        scores = [job.task.reward(sample, job.codec.decode(t)) for t in tokens]
        async with self.changed:
            start = self.ledger.in_flight[position]
            group = Group(
                position,
                sample.index,
                prompt,
                tokens[:K],
                logprobs[:K],
                versions[:K],
                start,
                scores[:K],
            )
            if self.shape.baseline:
                group.baseline_ids, group.baseline_versions = tokens[K], versions[K]
                group.baseline_score = scores[K]
            self.ledger.finish(group)
            self.changed.notify_all()
