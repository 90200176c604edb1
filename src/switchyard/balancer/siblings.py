"""State shared by the processes of one router, without Redis: a bus over unix sockets.

Under ``--processes N`` each process listens on one unix socket in a directory its
supervisor made, and connects to every other socket it finds there. It looks again when
a sibling connects to it (a process the supervisor starts or restarts connects to every
other), and every ``rescan_s`` when the directory changed, in case.
What travels on it: each process's in-flight counts every ``sibling_sync_interval_s``
(``SiblingShare``), admin registry changes at once, engine probes and scrapes (one process
probes and scrapes for all, the lowest-named one while it lives), and the router's placements
(``router.kv``). A message sent before a sibling connected is not seen by it: counts are
sent again on every sync, and the admin registry is also kept in a file a new process
loads. Messages go out in batches, one frame every ``BATCH_S`` at most: a 4-byte length,
then msgpack ``[origin, topic, payload, topic, payload, ...]``.

Plain asyncio unix streams, not ZMQ PUB/SUB: a batch is one write on the sender's loop
and one read on the receiver's. Through ZMQ it was a wake-up of the sender's ZMQ thread,
an ipc write, the receiver's ZMQ thread, its signal to the loop and pyzmq's poll
bookkeeping, several times the CPU of a stream write and read (see
docs/decisions/0004-process-bus.md).
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import logging
import os
import struct
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import orjson

from switchyard.balancer.scrape import Scrape
from switchyard.balancer.shared import apply_change, fold_peers, fold_worker, own_counts
from switchyard.balancer.worker import Worker, WorkerSpec
from switchyard.core.packing import packb

if TYPE_CHECKING:
    from switchyard.balancer.fleet import Fleet

log = logging.getLogger("switchyard.balancer.siblings")

Handler = Callable[[str, bytes], Awaitable[None] | None]
COUNTS = b"counts"
WORKER = b"worker"  # one worker's counts, sent as a request begins, starts decoding or ends
REGISTRY = b"registry"
SCRAPE = b"scrape"  # one worker's parsed /metrics, from the process that scraped it
PROBE = b"probe"  # one worker's health probe outcome, from the process that probed it
# How long a message may wait for others to share its frame. Each frame is one wake-up of
# every sibling's loop: sent one by one (about five a request: counts at begin, first
# token and end, the placement, new chat messages), they cost a sizeable fraction of the
# requests' own CPU (see docs/decisions/0004-process-bus.md). 2 ms is short next to any
# prefill the counts announce.
# A message after a quiet ``BATCH_S`` goes out at the end of its loop turn instead, with
# what that turn publishes: the wait ahead of it bought no company, and its timer was one
# more wake-up of the publishing loop.
BATCH_S = 0.002
# How long a lazy message (one no sibling routes on within milliseconds: a placement,
# tokens, KV operations, a scrape, counts that fell) may wait for an urgent one to carry
# it. Sent at once, they made several frames a request on the multi-turn replay, each a
# wake-up of every other process.
LAZY_S = 0.02
# Bytes a slow sibling may have waiting before batches to it are dropped (as PUB/SUB
# drops at its high-water mark): a stalled process must not grow the others' memory.
MAX_BUFFERED_BYTES = 16 << 20
_LENGTH = struct.Struct(">I")


class ProcessLock:
    """A lock only one process of the router holds at a time (``flock`` on a file of the
    bus directory): who does what only one should. The OS lets it go with its process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock if no other process holds it; True while this one does."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Inbound(asyncio.Protocol):
    """One sibling's connection to us: length-prefixed frames, each handed to the bus."""

    def __init__(self, bus: SiblingBus) -> None:
        self.bus = bus
        self.buffer = bytearray()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.bus._inbound.add(transport)
        self.bus._scan()  # a sibling that found us: it may be one we have not found yet

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.bus._inbound.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 4:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if len(buffer) - at - 4 < size:
                break
            self.bus._deliver(bytes(buffer[at + 4 : at + 4 + size]))
            at += 4 + size
        if at:
            del buffer[:at]


class SiblingBus:
    """One process's end of the bus: ``publish`` to all siblings, ``on`` to hear them."""

    def __init__(
        self,
        directory: str | Path,
        rescan_s: float = 1.0,
        batch_s: float = BATCH_S,
        lazy_s: float = LAZY_S,
    ) -> None:
        self.directory = Path(directory)
        self.instance = uuid.uuid4().hex[:12]
        self.rescan_s = rescan_s
        self.batch_s = batch_s
        self.lazy_s = lazy_s
        # Waiting messages as (topic, payload, ...), and where a keyed one sits.
        self._outbox: list[bytes] = []
        self._keyed: dict[tuple[bytes, str], int] = {}
        self._flush_at: asyncio.Handle | None = None
        self._flush_due = float("inf")  # time.monotonic() the waiting flush runs at
        self._flushed_at = float("-inf")  # time.monotonic() of the last frame sent
        self._handlers: dict[bytes, Handler] = {}
        # Siblings' sockets found (connected or connecting), and the connections made.
        self._peers: set[Path] = set()
        self._links: dict[Path, asyncio.Transport] = {}
        self._inbound: set[asyncio.BaseTransport] = set()
        self._scanned_mtime: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._connecting: set[asyncio.Task[None]] = set()
        # Awaitable handlers' work, run one after another in arrival order.
        self._awaiting: deque[Awaitable[None]] = deque()
        self._runner: asyncio.Task[None] | None = None
        # Called when a sibling is newly connected (it hears what is published from now on).
        self.on_join: Callable[[], None] | None = None

    @property
    def path(self) -> Path:
        return self.directory / f"{self.instance}.sock"

    @property
    def peers(self) -> int:
        """Siblings this process is connected to (they hear what it publishes)."""
        return len(self._links)

    def on(self, topic: bytes, handler: Handler) -> None:
        """Call ``handler(origin, payload)`` for each sibling message on ``topic``."""
        self._handlers[topic] = handler

    async def start(self) -> None:
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Inbound(self), str(self.path))
        self._scan()
        self._tasks = [loop.create_task(self._rescan(), name="siblings:rescan")]

    async def stop(self) -> None:
        self._flush()
        for task in [*self._tasks, *self._connecting]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._connecting, return_exceptions=True)
        self._tasks.clear()
        for transport in [*self._links.values(), *self._inbound]:
            transport.close()
        self._links.clear()
        self._inbound.clear()
        self._peers.clear()
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
            self._runner = None
        for waiting in self._awaiting:  # never started: closed, not left unawaited
            if inspect.iscoroutine(waiting):
                waiting.close()
        self._awaiting.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
            self.path.unlink(missing_ok=True)

    def publish(
        self, topic: bytes, payload: bytes, key: str | None = None, *, lazy: bool = False
    ) -> None:
        """Send to every connected sibling within ``batch_s`` (at the end of this loop turn
        when nothing went out for ``batch_s``), or within ``lazy_s`` if ``lazy``, with the
        next frame whichever comes first; never blocks (a sibling with
        ``MAX_BUFFERED_BYTES`` unread misses batches). Messages arrive in the order they
        were published. A message with a ``key`` replaces a waiting one of the same topic
        and key: only the latest state of that thing goes out, after the messages queued
        before it."""
        if self._server is None:
            return
        if key is not None:
            at = self._keyed.get((topic, key))
            if at is not None:
                self._outbox[at] = self._outbox[at + 1] = b""  # no topic: skipped
            self._keyed[(topic, key)] = len(self._outbox)
        self._outbox += (topic, payload)
        now = time.monotonic()
        wait = self.lazy_s if lazy else self._flushed_at + self.batch_s - now
        if self._flush_at is not None and self._flush_due <= now + wait:
            return  # the waiting flush takes it, soon enough
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to wait on: send now
            self._flush()
            return
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._flush_due = now + wait
        if wait <= 0:
            self._flush_at = loop.call_soon(self._flush)
        else:
            self._flush_at = loop.call_later(wait, self._flush)

    def _flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
            self._flush_due = float("inf")
        if not self._outbox:
            return
        self._flushed_at = time.monotonic()
        outbox, self._outbox = self._outbox, []
        self._keyed.clear()
        if not self._links:
            return
        batch: list[str | bytes] = [self.instance]
        for i in range(0, len(outbox), 2):
            if outbox[i]:  # a replaced keyed message is left as an empty topic
                batch += (outbox[i], outbox[i + 1])
        body = packb(batch)
        frame = _LENGTH.pack(len(body)) + body
        for path, transport in self._links.items():
            if transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
                log.debug("sibling %s is behind: %d messages dropped", path.stem, len(batch) // 2)
                continue
            transport.write(frame)

    def _deliver(self, frame: bytes) -> None:
        """Hand one batch's messages to their handlers, in order."""
        try:
            batch = msgpack.unpackb(frame)
        except (ValueError, msgpack.UnpackException):
            return
        if not isinstance(batch, list) or len(batch) % 2 != 1:
            return
        origin = batch[0]
        for i in range(1, len(batch), 2):
            topic, payload = batch[i], batch[i + 1]
            handler = self._handlers.get(topic)
            if handler is None:
                continue
            try:
                result = handler(origin, payload)
            except Exception:
                log.exception("sibling %s message from %s failed", topic.decode(), origin)
                continue
            if inspect.isawaitable(result):
                self._awaiting.append(result)
                if self._runner is None:
                    self._runner = asyncio.get_running_loop().create_task(self._run_awaiting())

    async def _run_awaiting(self) -> None:
        try:
            while self._awaiting:
                try:
                    await self._awaiting.popleft()
                except Exception:
                    log.exception("sibling message failed")
        finally:
            self._runner = None

    def _scan(self) -> None:
        """Connect to new siblings' sockets; nothing to do while the directory is unchanged
        (one stat: a glob every 0.1 s showed in an idle router's profile). A gone
        sibling's connection closes by itself."""
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            mtime = None
        # A change within the last second is looked at again: two in one tick of the
        # file system's coarse clock share one mtime.
        settled = mtime is not None and time.time_ns() - mtime > 1_000_000_000
        if settled and mtime == self._scanned_mtime:
            return
        self._scanned_mtime = mtime
        found = {p for p in self.directory.glob("*.sock") if p != self.path}
        loop = asyncio.get_running_loop()
        for path in found - self._peers:
            self._peers.add(path)
            task = loop.create_task(self._connect(path), name="siblings:connect")
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
        self._peers &= found | set(self._links)

    async def _connect(self, path: Path) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_unix_connection(
                lambda: _Outbound(self, path), str(path)
            )
        except OSError:  # a socket file its process left behind, or not listening yet
            self._peers.discard(path)  # tried again while the directory is changing
            return
        self._links[path] = transport
        if self.on_join is not None:
            self.on_join()

    def _lost(self, path: Path) -> None:
        self._links.pop(path, None)
        self._peers.discard(path)

    async def _rescan(self) -> None:
        while True:
            await asyncio.sleep(self.rescan_s)
            self._scan()


class _Outbound(asyncio.Protocol):
    """Our connection to one sibling: we only write; its end closing means it is gone."""

    def __init__(self, bus: SiblingBus, path: Path) -> None:
        self.bus = bus
        self.path = path

    def connection_lost(self, exc: Exception | None) -> None:
        self.bus._lost(self.path)


class SiblingShare:
    """A fleet's counts and admin registry shared with the other processes of its router
    (``FleetShare``, as ``RedisShare`` is across replicas)."""

    def __init__(self, fleet: Fleet, bus: SiblingBus) -> None:
        self.fleet = fleet
        self.bus = bus
        self.registry_path = bus.directory / "registry.json"
        # Per sibling: when its counts last came, as sent, and parsed.
        self._snapshots: dict[str, tuple[float, bytes, dict[str, list[list[int]]]]] = {}
        self._changed = False
        self._sent = b""
        self._sent_at = float("-inf")
        self._applying = False
        self._sent_inflight: dict[str, int] = {}  # per worker: local in-flight last sent
        self._task: asyncio.Task[None] | None = None

    @property
    def peers(self) -> int:
        now = time.monotonic()
        lease = self.fleet.settings.lease_s
        return sum(1 for snapshot in self._snapshots.values() if now - snapshot[0] <= lease)

    async def start(self) -> None:
        """Load the stored registry and start syncing (the bus's owner starts and stops it)."""
        self.bus.on(COUNTS, self._on_counts)
        self.bus.on(WORKER, self._on_worker)
        self.bus.on(REGISTRY, self._on_change)
        self.bus.on(SCRAPE, self._on_scrape)
        self.bus.on(PROBE, self._on_probe)
        if self.fleet.prober is not None:
            self.fleet.prober.on_scrape = self.publish_scrape
            self.fleet.prober.on_probe = self.publish_probe
        for spec in self._stored_registry():
            self._apply({"op": "add", "spec": spec})
        self._task = asyncio.get_running_loop().create_task(self._sync_loop(), name="siblings:sync")

    async def stop(self) -> None:
        if self.fleet.prober is not None:
            self.fleet.prober.on_scrape = None
            self.fleet.prober.on_probe = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # In-flight counts

    def sync(self) -> None:
        """Send our counts and fold in the siblings' latest ones (those within a lease).

        Unchanged counts are sent again only every third of a lease (a keep-alive), and
        the fold runs only when a sibling's counts changed or expired: an idle router's
        processes then do almost nothing, where a fold on every sync grows with the
        fleet (``bench.router_cpu --siblings``)."""
        now = time.monotonic()
        lease = self.fleet.settings.lease_s
        own: dict[str, list[list[int]]] = {}
        for (worker_id, rank), values in own_counts(self.fleet).items():
            ranks = own.setdefault(worker_id, [])
            ranks.extend([0, 0, 0, 0] for _ in range(rank + 1 - len(ranks)))
            ranks[rank] = list(values)
        payload = orjson.dumps(own)
        if payload != self._sent or now - self._sent_at >= lease / 3:
            self.bus.publish(COUNTS, payload, lazy=True)
            self._sent, self._sent_at = payload, now
        expired = [o for o, snapshot in self._snapshots.items() if now - snapshot[0] > lease]
        for origin in expired:
            del self._snapshots[origin]
        if not (self._changed or expired):
            return
        self._changed = False
        totals: dict[tuple[str, int], list[int]] = {}
        for _, _, counts in self._snapshots.values():
            for worker_id, per_rank in counts.items():
                for rank, sums in enumerate(per_rank):
                    acc = totals.setdefault((worker_id, rank), [0, 0, 0, 0])
                    for i, n in enumerate(sums):
                        acc[i] += n
        fold_peers(self.fleet, totals)

    def _on_counts(self, origin: str, payload: bytes) -> None:
        previous = self._snapshots.get(origin)
        if previous is not None and previous[1] == payload:
            self._snapshots[origin] = (time.monotonic(), payload, previous[2])
            return
        self._snapshots[origin] = (time.monotonic(), payload, orjson.loads(payload))
        self._changed = True

    def changed(self, worker: Worker) -> None:
        """Tell the siblings a worker's counts at once. A prefill lasts milliseconds: with
        counts only every sync, the siblings missed it and sent new conversations to the
        same worker, and two processes' hit rate fell well below one process's with half
        the engines idle (``bench.compare_routing multiturn``). ``begun_at`` goes along, so
        that every process rotates ties over the fleet's picks, not only its own."""
        ranks = [list(counters.local_tuple()) for counters in worker.ranks]
        payload = orjson.dumps([worker.id, ranks, worker.begun_at])
        # Only a request begun is urgent news: a first token or an end makes the worker
        # look busier than it is for a few milliseconds, never idler.
        rose = worker.local_inflight > self._sent_inflight.get(worker.id, 0)
        self._sent_inflight[worker.id] = worker.local_inflight
        self.bus.publish(WORKER, payload, key=worker.id, lazy=not rose)

    def _on_worker(self, origin: str, payload: bytes) -> None:
        worker_id, ranks, begun_at = orjson.loads(payload)
        now = time.monotonic()
        snapshot = self._snapshots.get(origin)
        counts = snapshot[2] if snapshot is not None else {}
        if any(any(r) for r in ranks):
            counts[worker_id] = ranks
        else:
            counts.pop(worker_id, None)
        # The next full snapshot from this sibling is parsed whatever its bytes.
        self._snapshots[origin] = (now, b"", counts)
        worker = self.fleet.get(worker_id)
        if worker is None:
            return
        worker.begun_at = max(worker.begun_at, begun_at)
        lease = self.fleet.settings.lease_s
        per_rank = [[0, 0, 0, 0] for _ in worker.ranks]
        for at, _, peer_counts in self._snapshots.values():
            if now - at > lease:
                continue
            for rank, values in enumerate(peer_counts.get(worker_id, ())):
                if rank < len(per_rank):
                    per_rank[rank] = [a + b for a, b in zip(per_rank[rank], values, strict=True)]
        fold_worker(worker, per_rank)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fleet.settings.sibling_sync_interval_s)
            self.sync()

    # Engine scrapes

    def publish_scrape(self, worker: Worker, samples: list[Scrape]) -> None:
        """Share a scrape this process made. Each process scraping every worker cost each
        of them the GETs and the parse, a visible share of each process's CPU on the
        multi-turn replay."""
        payload = orjson.dumps([worker.id, samples], option=orjson.OPT_NON_STR_KEYS)
        self.bus.publish(SCRAPE, payload, key=worker.id, lazy=True)

    def _on_scrape(self, origin: str, payload: bytes) -> None:
        """Take in a scrape from a lower-named sibling (the one that scrapes for all); a
        higher-named one scrapes only while the lower ones' scrapes do not come."""
        prober = self.fleet.prober
        if origin > self.bus.instance or prober is None:
            return
        worker_id, samples = orjson.loads(payload)
        worker = self.fleet.get(worker_id)
        if worker is not None:
            prober.take(worker, [Scrape.from_json(item) for item in samples])

    # Health probes

    def publish_probe(self, worker: Worker, ok: bool, error: str) -> None:
        """Share a probe this process made. Each process probing every worker cost each
        of them a GET per worker and interval, a large part of an idle router's CPU
        (``bench.router_cpu --idle``)."""
        self.bus.publish(PROBE, orjson.dumps([worker.id, ok, error]), key=worker.id, lazy=ok)

    def _on_probe(self, origin: str, payload: bytes) -> None:
        """Take in a probe from a lower-named sibling, as ``_on_scrape`` a scrape."""
        prober = self.fleet.prober
        if origin > self.bus.instance or prober is None:
            return
        worker_id, ok, error = orjson.loads(payload)
        worker = self.fleet.get(worker_id)
        if worker is not None:
            prober.take_probe(worker, bool(ok), str(error))

    # Registry broadcast

    def publish_add(self, spec: WorkerSpec) -> None:
        self._send({"op": "add", "spec": spec.to_dict()})

    def publish_remove(self, worker_id: str) -> None:
        self._send({"op": "remove", "id": worker_id})

    def publish_drain(self, worker_id: str) -> None:
        self._send({"op": "drain", "id": worker_id})

    def publish_undrain(self, spec: WorkerSpec) -> None:
        self._send({"op": "undrain", "id": spec.url})

    def _send(self, message: dict[str, Any]) -> None:
        if self._applying:
            return
        self.bus.publish(REGISTRY, orjson.dumps(message))
        self._store_registry()

    def _on_change(self, origin: str, payload: bytes) -> None:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        self._apply(data)
        self._store_registry()

    def _apply(self, data: dict[str, Any]) -> None:
        self._applying = True
        try:
            apply_change(self.fleet, data)
        finally:
            self._applying = False

    def _store_registry(self) -> None:
        """The admin workers that take requests, for a process that starts later (every
        process writes it after every change, so the last write holds all of them)."""
        registry = [
            w.spec.to_dict() for w in self.fleet.workers() if w.source == "admin" and not w.draining
        ]
        tmp = self.registry_path.with_name(f".registry-{self.bus.instance}.json")
        tmp.write_bytes(orjson.dumps(registry))
        os.replace(tmp, self.registry_path)

    def _stored_registry(self) -> list[dict[str, Any]]:
        try:
            stored = orjson.loads(self.registry_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return []
        return stored if isinstance(stored, list) else []
