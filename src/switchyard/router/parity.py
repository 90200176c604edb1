"""Hash-parity self-check: does the router key a prompt the way each engine caches it?

KV-aware routing is only as good as the router's prediction of which blocks an engine
holds. That prediction silently goes wrong when the router's tokenizer, chat template
or BOS handling differ from the engine's, or when block sizes differ: routing still
works, only worse, and nothing says why. So, per worker, a canary: a short unique chat
of a few blocks, ``max_tokens`` 1, tokenized with the router's own tokenizer and template.

The comparison, in order:

1. ``usage.prompt_tokens`` of the answer against the router's token count;
2. the token ids the engine publishes in its ``BlockStored`` events against the
   router's (first differing position, and whether one leading token explains it);
3. the block keys the router predicts against what the index built from those events
   holds (the tokens re-keyed in the engine's block size);
4. ``cached_tokens`` of a repeat of the canary against the router's predicted match,
   within one block.

The verdict names the likely cause: block size, chat template, BOS or tokenizer (or
that the events did not arrive). Where the engine has no events, 1 and 4 still run.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry, Gauge

from switchyard.balancer.siblings import ProcessLock, SiblingBus
from switchyard.kvstore.ingest import StoredTokens
from switchyard.kvstore.store import KVStore
from switchyard.net.control import async_client

log = logging.getLogger("switchyard.router.parity")

# Filler words for the canary: common words, so any tokenizer spells them in few tokens.
_WORDS = (
    "river stone window garden morning paper yellow bridge quiet number ocean travel "
    "little market silver winter forest signal pocket candle thunder orange harbor "
    "planet ladder copper meadow"
).split()


@dataclass
class ParityResult:
    """One check of one worker; ``ok`` is None when it could not be decided."""

    worker: str
    ok: bool | None
    reason: str
    cause: str | None = None
    block_size: int | None = None
    router_tokens: int = 0
    engine_prompt_tokens: int | None = None
    event_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    engine_cached_tokens: int | None = None
    first_difference: int | None = None
    checked_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def canary_messages(nonce: str, words: int) -> list[dict[str, str]]:
    filler = " ".join(_WORDS[i % len(_WORDS)] for i in range(words))
    return [{"role": "user", "content": f"switchyard parity canary {nonce}. {filler}"}]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ over their common length."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def _contains(haystack: list[int], needle: list[int]) -> bool:
    if not needle:
        return True
    n = len(needle)
    first = needle[0]
    return any(
        haystack[i] == first and haystack[i : i + n] == needle for i in range(len(haystack) - n + 1)
    )


def _middle(content: list[int]) -> list[int]:
    """A run of the canary's content tokens away from its edges (where merges differ)."""
    start = len(content) // 4
    return content[start : start + 12]


def likely_cause(router: list[int], engine: list[int], content: list[int]) -> str:
    """Why the engine's tokens differ from the router's.

    One extra or missing leading token is BOS. If the chat's content tokens appear in
    both, the words tokenize alike and the text around them differs: the chat template.
    Otherwise the vocabularies differ: the tokenizer.
    """
    n = min(len(router), len(engine)) - 1
    if n > 0 and (router[1 : n + 1] == engine[:n] or engine[1 : n + 1] == router[:n]):
        return "BOS"
    middle = _middle(content)
    if middle and _contains(engine, middle) and _contains(router, middle):
        return "chat template"
    return "tokenizer"


def event_chain(events: Iterable[StoredTokens], canary: list[int] | None = None) -> list[int]:
    """The published tokens that chain from a root block (parent None): of several chains,
    the one holding the canary's ``canary`` tokens, else the longest."""
    evs = list(events)
    by_parent: dict[Any, StoredTokens] = {}
    for ev in evs:
        if ev.parent_block_hash is not None:
            by_parent.setdefault(ev.parent_block_hash, ev)
    best: list[int] = []
    best_rank = (False, 0)
    for ev in evs:
        if ev.parent_block_hash is not None:
            continue
        tokens = list(ev.token_ids)
        cur: StoredTokens | None = ev
        while cur is not None and cur.block_hashes:
            cur = by_parent.get(cur.block_hashes[-1])
            if cur is not None:
                tokens.extend(cur.token_ids)
        rank = (bool(canary) and _contains(tokens, canary or []), len(tokens))
        if rank > best_rank:
            best, best_rank = tokens, rank
    return best


class ParityChecker:
    """Runs the canary against one worker and compares, using the router's own KV store."""

    def __init__(
        self,
        store: KVStore,
        *,
        request_timeout_s: float = 60.0,
        events_wait_s: float = 5.0,
        canary_blocks: int = 4,
    ) -> None:
        self.store = store
        self.request_timeout_s = request_timeout_s
        self.events_wait_s = events_wait_s
        self.canary_blocks = canary_blocks

    async def check(self, client: httpx.AsyncClient, worker: str, model: str) -> ParityResult:
        tok = self.store.tokenizer_for(model)
        if not tok.exact:
            return ParityResult(worker, None, "no tokenizer: the router's tokens are estimates")
        size = self.store.block_size_of(worker)
        target = self.canary_blocks * max(size, 64) + max(size, 64) // 2
        nonce = secrets.token_hex(6)
        words = max(8, target // 2)
        messages = canary_messages(nonce, words)
        tokens = await tok.aencode_chat(messages)
        while len(tokens) < target:
            words += max(4, (target - len(tokens)) // 2)
            messages = canary_messages(nonce, words)
            tokens = await tok.aencode_chat(messages)
        content = await tok.aencode_prompt(str(messages[0]["content"]))
        expects_events = self.store.expects_events(worker)
        marks = {id(f): f.ingestor.stored_serial for f in self.store.feeds_of(worker)}
        result = ParityResult(worker, None, "", router_tokens=len(tokens))
        try:
            first = await self._chat(client, worker, model, messages)
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            result.reason = f"canary request failed: {type(exc).__name__}: {exc}"
            return result
        result.engine_prompt_tokens = first[0]
        published: list[int] | None = None
        if expects_events:
            published = await self._published(worker, marks, len(tokens), _middle(content))
            result.event_tokens = len(published)
        size = self.store.block_size_of(worker)
        result.block_size = size
        full = len(tokens) // size * size
        if expects_events:
            keys = self.store.keys_for(tokens, block_size=size)
            matches, _ = await self.store.lookup_keys(keys, [worker], size)
            result.predicted_cached_tokens = max(
                (m.matched_tokens for m in matches if m.tier == "gpu"), default=0
            )
        else:
            result.predicted_cached_tokens = full
        try:
            repeat = await self._chat(client, worker, model, messages)
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            result.reason = f"repeat request failed: {type(exc).__name__}: {exc}"
            return result
        result.engine_cached_tokens = repeat[1]
        self._judge(result, tokens, published, content, size)
        return result

    def _judge(
        self,
        r: ParityResult,
        tokens: list[int],
        published: list[int] | None,
        content: list[int],
        size: int,
    ) -> None:
        if published:
            diff = first_difference(tokens, published)
            if diff is not None:
                r.first_difference = diff
                r.cause = likely_cause(tokens, published, content)
                self._fail(r, f"engine's event tokens differ from the router's at token {diff}")
                return
        if r.engine_prompt_tokens is not None and r.engine_prompt_tokens != len(tokens):
            r.cause = "BOS" if abs(r.engine_prompt_tokens - len(tokens)) == 1 else "chat template"
            self._fail(
                r,
                f"engine counts {r.engine_prompt_tokens} prompt tokens, the router {len(tokens)}",
            )
            return
        if published is not None and not published:
            r.cause = "events"
            self._fail(r, f"no KV events for the canary within {self.events_wait_s:g} s")
            return
        predicted = r.predicted_cached_tokens or 0
        if published and predicted < len(tokens) // size * size:
            r.cause = "block size"
            self._fail(
                r, f"the index holds {predicted} of the canary's tokens in {size}-token blocks"
            )
            return
        cached = r.engine_cached_tokens
        if cached is not None and abs(cached - predicted) > size:
            r.cause = "block size"
            self._fail(
                r, f"engine cached {cached} tokens of the repeat, router predicted {predicted}"
            )
            return
        r.ok = True
        r.reason = "verified" + ("" if cached is not None else " (engine reports no cached_tokens)")

    @staticmethod
    def _fail(r: ParityResult, reason: str) -> None:
        r.ok = False
        r.reason = reason

    async def _chat(
        self,
        client: httpx.AsyncClient,
        worker: str,
        model: str,
        messages: list[dict[str, str]],
    ) -> tuple[int, int | None]:
        """(prompt_tokens, cached_tokens or None) of a one-token chat completion, all of it
        within ``request_timeout_s``."""
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0}
        async with asyncio.timeout(self.request_timeout_s):
            resp = await client.post(
                worker.rstrip("/") + "/v1/chat/completions",
                json=body,
                timeout=self.request_timeout_s,
            )
        data = resp.json()
        if resp.status_code != 200:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else data
            raise ValueError(f"HTTP {resp.status_code}: {message}")
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return int(usage.get("prompt_tokens", 0)), None if cached is None else int(cached)

    async def _published(
        self, worker: str, marks: dict[int, int], want: int, canary: list[int]
    ) -> list[int]:
        """Tokens the engine published for the canary, waiting up to ``events_wait_s``.

        Feeds of engines that connect appear with their first frame, so they are looked
        up anew each time; a feed not seen before the canary counts from its start.
        """
        deadline = time.monotonic() + self.events_wait_s
        while True:
            feeds = self.store.feeds_of(worker)
            fresh = [
                ev for f in feeds for ev in f.ingestor.recent if ev.serial > marks.get(id(f), 0)
            ]
            best = event_chain(fresh, canary)
            size = max((f.ingestor.block_size or 1 for f in feeds), default=1)
            if (best and len(best) + size > want) or time.monotonic() > deadline:
                return best
            await asyncio.sleep(0.05)


RETRY_S = 10.0
PARITY = b"parity"  # sibling-bus topic: a check's result, from the process that ran it


class ParityMonitor:
    """Checks each worker once it is healthy and serves a model, then every ``interval_s``.

    Results go to the gauge ``switchyard_router_kv_parity{worker}`` (1 verified, 0
    mismatch), to the worker's state (``kv_parity`` in ``/admin/workers``) and, when a
    worker's verdict changes, to one log line naming the likely cause.

    Of several router processes (``siblings``) one checks, the holder of a lock file in
    their directory, and tells the others each result: when each process sent its own
    canaries, they polluted the engines' caches enough to lower kv_aware's multi-turn hit
    rate (``bench.compare_routing multiturn``).
    """

    def __init__(
        self,
        store: KVStore,
        fleet: Any,
        registry: CollectorRegistry,
        *,
        interval_s: float,
        checker: ParityChecker | None = None,
        siblings: SiblingBus | None = None,
    ) -> None:
        self.siblings = siblings
        self._lock = None if siblings is None else ProcessLock(siblings.directory / "parity.lock")
        self.store = store
        self.fleet = fleet
        self.interval_s = interval_s
        self.checker = checker or ParityChecker(store)
        self.results: dict[str, ParityResult] = {}
        self.gauge = Gauge(
            "switchyard_router_kv_parity",
            "Hash parity of the router's block keys with the worker's KV cache "
            "(1 verified by a canary, 0 mismatch; absent until checked).",
            ["worker"],
            registry=registry,
            multiprocess_mode="min",  # under --processes: 0 if any process saw a mismatch
        )
        self._next: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.siblings is not None:
            self.siblings.on(PARITY, self._on_sibling_result)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-parity")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._lock is not None:
            self._lock.release()  # for a sibling

    async def _run(self) -> None:
        async with async_client() as client:
            while True:
                now = time.monotonic()
                if self._checks_here():
                    for worker in list(self.fleet.workers()):
                        if self._due(worker, now):
                            result = await self.check(client, worker)
                            if self.siblings is not None:
                                payload = orjson.dumps(result.as_dict())
                                self.siblings.publish(PARITY, payload, lazy=True)
                await asyncio.sleep(1.0)

    def _checks_here(self) -> bool:
        """Whether this process sends the canaries: always alone, else the lock holder
        among the processes that follow the engines' events themselves (a check compares
        the engine's published blocks with the router's)."""
        if self._lock is None:
            return True
        if self.store.events_from_sibling:
            self._lock.release()
            return False
        return self._lock.acquire()

    def _on_sibling_result(self, origin: str, payload: bytes) -> None:
        result = ParityResult(**orjson.loads(payload))
        worker = self.fleet.get(result.worker)
        if worker is not None:
            self.report(worker, result, quiet=True)

    def _due(self, worker: Any, now: float) -> bool:
        """Unified workers that are up, serve a model and whose events are followed live
        (not still being replayed); P/D pools are not sent canaries (a plain request is not
        what their KV connector expects)."""
        return (
            str(worker.role) == "unified"
            and worker.healthy
            and bool(worker.models)
            and self._next.get(worker.id, 0.0) <= now
            and not self.store.catching_up(worker.id)
        )

    async def check(self, client: httpx.AsyncClient, worker: Any) -> ParityResult:
        model = sorted(worker.models)[0]
        try:
            result = await self.checker.check(client, worker.id, model)
        except Exception as exc:  # a check must never take the router down
            log.exception("%s: parity check failed", worker.id)
            result = ParityResult(worker.id, None, f"check failed: {type(exc).__name__}")
        undecided = result.ok is None
        wait = RETRY_S if undecided else self.interval_s
        self._next[worker.id] = time.monotonic() + (wait if wait > 0 else float("inf"))
        self.report(worker, result)
        return result

    def report(self, worker: Any, result: ParityResult, *, quiet: bool = False) -> None:
        """Record a result; log a changed verdict unless ``quiet`` (a sibling logged it)."""
        before = self.results.get(worker.id)
        self.results[worker.id] = result
        worker.kv_parity = result.as_dict()
        if result.ok is None:
            return
        self.gauge.labels(worker.id).set(1.0 if result.ok else 0.0)
        if quiet or (
            before is not None and before.ok == result.ok and before.cause == result.cause
        ):
            return
        if result.ok:
            log.info("%s: KV hash parity verified (%d-token blocks)", worker.id, result.block_size)
        else:
            log.warning(
                "%s: KV hash parity MISMATCH, likely cause: %s (%s); prefix routing to it is "
                "guesswork until fixed",
                worker.id,
                result.cause,
                result.reason,
            )
