"""The clock-independent engine model: a vLLM V1-like scheduler over paged KV blocks.

One ``step(now)`` is one forward pass: it schedules running requests first (decode and
chunked prefill share the per-step token budget, so prefill slows decode as on real
hardware), then admits waiting requests FCFS with their prefix-cache hit, preempting the
newest running request (recompute) when blocks run out. It returns the step's modelled
duration and which requests produced a token. Drivers own time: the real-clock driver
sleeps the duration, the virtual clock adds it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from switchyard.mock.engine.api import EngineRequest, EngineStats, FinishReason
from switchyard.mock.engine.blocks import Block, BlockPool
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.engine.hashing import BlockHasher

WAITING, RUNNING, HELD, FINISHED = 0, 1, 2, 3


class Seq:
    """One request's scheduling state (vLLM's ``Request``)."""

    __slots__ = (
        "req",
        "request_id",
        "tokens",
        "prompt_len",
        "max_tokens",
        "num_computed",
        "num_generated",
        "blocks",
        "digests",
        "num_cached_blocks",
        "num_cached_tokens",
        "state",
        "finish_reason",
        "remote_tokens",
        "remote_ready_at",
        "pulled",
        "held_until",
        "first_token_done",
        "output_ids",
        "sink",
        "arrival",
    )

    def __init__(self, req: EngineRequest, digests: list[bytes]) -> None:
        self.req = req
        self.request_id = req.request_id
        self.tokens = list(req.prompt_token_ids)
        self.prompt_len = len(self.tokens)
        self.max_tokens = max(1, req.max_tokens)
        self.num_computed = 0
        self.num_generated = 0
        self.blocks: list[Block] = []
        self.digests = digests
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_cached_tokens = -1  # set at first schedule
        self.state = WAITING
        self.finish_reason: FinishReason | None = None
        self.remote_tokens = min(req.remote_prefilled_tokens, self.prompt_len - 1)
        self.remote_ready_at = 0.0  # when the pulled remote KV has landed (model time)
        self.pulled = False
        self.held_until = 0.0
        self.first_token_done = False
        self.output_ids = req.output_token_ids or [0]
        self.sink: object = None  # the driver's per-request channel
        self.arrival = 0  # the engine's arrival order, for the priority policy

    @property
    def finished(self) -> bool:
        return self.state >= HELD


@dataclass(slots=True)
class StepResult:
    duration: float  # model seconds (before ``speed``)
    progressed: list[Seq] = field(default_factory=list)  # produced one token each
    num_scheduled: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        dp_rank: int = 0,
        event_sink: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.event_sink = event_sink
        self.block_size = config.block_size
        self.caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_gpu_blocks)
        self.hasher = BlockHasher(config.hash_flavor, config.block_size, config.int_block_hashes)
        self.waiting: deque[Seq] = deque()
        self.by_priority = config.scheduling_policy == "priority"
        self._arrivals = 0
        self.running: list[Seq] = []
        self.held: dict[str, Seq] = {}
        self.seqs: dict[str, Seq] = {}
        self._a = config.step_base_us * 1e-6
        self._b = config.prefill_token_us * 1e-6
        self._c = config.decode_token_us * 1e-6
        self._d = config.context_token_us * 1e-6
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0
        self.requests_finished = 0
        # LoRA: the adapters in GPU slots, least recently used first (vLLM's LRU cache of
        # active adapters); None when LoRA is off, so adapter names only key the hashes.
        self.max_loras = config.max_loras
        self.lora_slots: OrderedDict[str, None] | None = OrderedDict() if config.max_loras else None
        self._lora_load = config.lora_load_us * 1e-6
        self.lora_loads = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: EngineRequest) -> Seq:
        if not req.prompt_token_ids:
            raise ValueError("prompt must have at least one token")
        if req.request_id in self.seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        total = len(req.prompt_token_ids) + max(1, req.max_tokens)
        if total > self.config.kv_capacity_tokens:
            # Callers refuse these first (``api.context_length_error``), as vLLM's API does.
            raise ValueError(
                f"request needs {-(-total // self.block_size)} KV blocks, "
                f"engine has {self.config.num_gpu_blocks - 1}"
            )
        digests = (
            self.hasher.chain(req.prompt_token_ids, 0, None, req.lora_name, req.cache_salt)
            if self.caching
            else []
        )
        seq = Seq(req, digests)
        self.seqs[req.request_id] = seq
        self._arrivals += 1
        seq.arrival = self._arrivals
        if self.by_priority:
            self._wait_in_order(seq)
        else:
            self.waiting.append(seq)
        return seq

    def _wait_in_order(self, seq: Seq) -> None:
        """Queue ``seq`` by (priority, arrival), vLLM's priority policy; searched from the
        back, where a new request usually belongs."""
        waiting = self.waiting
        key = (seq.req.priority, seq.arrival)
        at = len(waiting)
        while at and (waiting[at - 1].req.priority, waiting[at - 1].arrival) > key:
            at -= 1
        waiting.insert(at, seq)

    def abort(self, request_id: str) -> Seq | None:
        """Drop a request wherever it is and free its blocks at once."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state == RUNNING:
            self.running.remove(seq)
        elif seq.state == HELD:
            del self.held[request_id]
        if seq.state != FINISHED:
            self._free(seq)
            seq.state = FINISHED
            seq.finish_reason = "abort"
        return seq

    def release_held(self, request_id: str) -> bool:
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self._free(seq)
        seq.state = FINISHED
        self.seqs.pop(request_id, None)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. The ``AllBlocksCleared`` goes out with the next step's
        batch, as vLLM 0.32 publishes it (seen in tests/fixtures/vllm_real/events.msgpack)."""
        return self.pool.reset_prefix_cache()

    def probe_prefix(
        self,
        prompt_token_ids: list[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Prompt tokens a request would find in this engine's prefix cache right now (an
        oracle for simulated routing; changes nothing)."""
        if not self.caching or len(prompt_token_ids) < 2:
            return 0
        max_blocks = (len(prompt_token_ids) - 1) // self.block_size
        tokens = prompt_token_ids[: max_blocks * self.block_size]
        hasher, lookup = self.hasher, self.pool.lookup
        parent: bytes | None = None
        bs = self.block_size
        for i in range(max_blocks):
            parent = hasher.digest(
                parent, tokens[i * bs : (i + 1) * bs], lora_name, cache_salt, i == 0
            )
            if lookup(parent) is None:
                return i * bs
        return max_blocks * bs

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_wakeup(self, after: float = 0.0) -> float | None:
        """The earliest model time after ``after`` that something becomes due without a
        step (a P/D transfer lands, a hold expires)."""
        times = [s.remote_ready_at for s in self.waiting if s.remote_ready_at > after]
        times.extend(s.held_until for s in self.held.values() if s.held_until > after)
        return min(times) if times else None

    def ready(self, now: float) -> bool:
        """Whether a step at ``now`` has anything to try (running, or waiting and not in a
        KV transfer)."""
        if self.running:
            return True
        return any(s.remote_ready_at <= now for s in self.waiting)

    # ------------------------------------------------------------------ the step

    def step(self, now: float, ts: float | None = None) -> StepResult:
        if self.held:
            self.expire_held(now)
        bs = self.block_size
        pool = self.pool
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Seq, int]] = []
        running = self.running
        preempted = False
        # The adapters this step runs: at most max_loras, as vLLM's scheduler keeps them.
        loras: set[str] | None = None if self.lora_slots is None else set()

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = len(seq.tokens) - seq.num_computed
            if num_new > budget:
                num_new = budget
            end = seq.num_computed + num_new
            need = -(-end // bs) - len(seq.blocks)
            if need > 0:
                while pool.num_free < need:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.state != RUNNING:
                    break
                seq.blocks.extend(pool.allocate(need))
            scheduled.append((seq, num_new))
            budget -= num_new
            if loras is not None and seq.req.lora_name:
                loras.add(seq.req.lora_name)
            if self.caching and end // bs > seq.num_cached_blocks:
                self._cache_blocks(seq, end // bs)
            i += 1

        if not preempted and self.waiting:
            self._schedule_waiting(now, budget, scheduled, loras)

        loading = self._load_loras(loras) * self._lora_load if loras else 0.0
        result = self._execute(now, scheduled, loading)
        if pool.events:
            self._flush_events(now if ts is None else ts)
        return result

    def _flush_events(self, ts: float) -> None:
        events, self.pool.events = self.pool.events, []
        if self.event_sink is not None and events:
            self.event_sink(KVEventBatch(ts, events, self.dp_rank))

    def _load_loras(self, loras: set[str]) -> int:
        """Put this step's adapters in GPU slots, evicting the least recently used ones the
        step does not run; the number loaded (each costs the step a load)."""
        slots = self.lora_slots
        assert slots is not None
        loaded = 0
        for name in loras:
            if name in slots:
                slots.move_to_end(name)
            else:
                slots[name] = None
                loaded += 1
        if len(slots) > self.max_loras:
            for name in [n for n in slots if n not in loras][: len(slots) - self.max_loras]:
                del slots[name]
        self.lora_loads += loaded
        return loaded

    def _schedule_waiting(
        self,
        now: float,
        budget: int,
        scheduled: list[tuple[Seq, int]],
        loras: set[str] | None = None,
    ) -> None:
        bs = self.block_size
        pool = self.pool
        waiting = self.waiting
        running = self.running
        max_seqs = self.config.max_num_seqs
        skipped: list[Seq] = []
        while waiting and len(running) < max_seqs and budget > 0:
            seq = waiting[0]
            if seq.remote_ready_at > now:
                skipped.append(waiting.popleft())
                continue
            lora = seq.req.lora_name
            if loras is not None and lora and lora not in loras and len(loras) >= self.max_loras:
                # As vLLM: a request whose adapter would exceed max_loras waits, others pass.
                skipped.append(waiting.popleft())
                continue
            hit: list[Block] = []
            if not seq.blocks:
                hit = self._lookup(seq)
            num_hit = len(hit) * bs
            if seq.remote_tokens and not seq.pulled:
                # P/D decode side: allocate the remote prompt's blocks, pull them (async, ∝
                # blocks not already local), then wait like vLLM's WAITING_FOR_REMOTE_KVS.
                total = max(num_hit, seq.remote_tokens)
                need = -(-total // bs) - len(hit)
                if need > pool.num_free - sum(1 for b in hit if b.ref_cnt == 0):
                    break
                pool.touch(hit)
                seq.blocks = hit + pool.allocate(need)
                seq.num_cached_blocks = len(hit)
                self.prefix_cache_queries += len(seq.tokens)
                self.prefix_cache_hits += num_hit
                seq.num_computed = total
                seq.num_cached_tokens = total
                pulled = -(-seq.remote_tokens // bs) - len(hit)
                transfer = max(0, pulled) * self.config.kv_transfer_us_per_block * 1e-6
                seq.remote_ready_at = now + transfer
                seq.pulled = True
                if transfer > 0:
                    skipped.append(waiting.popleft())
                    continue
                # Every pulled block was already local: nothing lands later, so no timer
                # would wake an idle driver for it; schedule it in this step.
                hit = []
            start = seq.num_computed if seq.blocks else num_hit
            num_new = len(seq.tokens) - start
            if num_new > budget:
                num_new = budget
            end = start + num_new
            need = -(-end // bs) - len(seq.blocks) - len(hit)
            if need > pool.num_free - sum(1 for b in hit if b.ref_cnt == 0):
                break
            if hit or not seq.blocks:
                pool.touch(hit)
                seq.blocks = hit
                seq.num_cached_blocks = len(hit)
                seq.num_computed = num_hit
                self.prefix_cache_queries += len(seq.tokens)
                self.prefix_cache_hits += num_hit
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = num_hit
            if need > 0:
                seq.blocks.extend(pool.allocate(need))
            waiting.popleft()
            seq.state = RUNNING
            running.append(seq)
            scheduled.append((seq, num_new))
            if loras is not None and lora:
                loras.add(lora)
            budget -= num_new
            if self.caching and end // bs > seq.num_cached_blocks:
                self._cache_blocks(seq, end // bs)
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _lookup(self, seq: Seq) -> list[Block]:
        """Longest cached run of full blocks, never the whole sequence (one token recomputed)."""
        if not self.caching:
            return []
        max_blocks = (len(seq.tokens) - 1) // self.block_size
        self._ensure_digests(seq, max_blocks)
        lookup = self.pool.lookup
        hit: list[Block] = []
        for digest in seq.digests[:max_blocks]:
            b = lookup(digest)
            if b is None:
                break
            hit.append(b)
        return hit

    def _execute(
        self, now: float, scheduled: list[tuple[Seq, int]], loading: float = 0.0
    ) -> StepResult:
        prefill = decode = context = 0
        progressed: list[Seq] = []
        any_finished = False
        for seq, n in scheduled:
            computed = seq.num_computed
            ntok = len(seq.tokens)
            if n == 1 and seq.num_generated and computed == ntok - 1:
                decode += 1
            else:
                prefill += n
            context += computed
            computed += n
            seq.num_computed = computed
            if computed >= ntok:
                ids = seq.output_ids
                seq.tokens.append(ids[seq.num_generated % len(ids)])
                seq.num_generated += 1
                progressed.append(seq)
                if seq.num_generated >= seq.max_tokens:
                    any_finished = True
        duration = self._a + self._b * prefill + self._c * decode + self._d * context + loading
        if not scheduled:
            duration = 0.0
        self.generation_tokens_total += len(progressed)
        for seq in progressed:
            if not seq.first_token_done:
                seq.first_token_done = True
                self.prompt_tokens_total += seq.prompt_len
        if any_finished:
            done_at = now + duration
            keep: list[Seq] = []
            for seq in self.running:
                if seq.num_generated >= seq.max_tokens:
                    self._finish(seq, done_at)
                else:
                    keep.append(seq)
            self.running = keep
        return StepResult(duration, progressed, len(scheduled), prefill, decode)

    # ------------------------------------------------------------------ helpers

    def _finish(self, seq: Seq, now: float) -> None:
        seq.finish_reason = "length"
        self.requests_finished += 1
        if seq.req.hold_kv_after_prefill:
            seq.state = HELD
            seq.held_until = now + self.config.held_kv_timeout_s
            self.held[seq.request_id] = seq
            return
        seq.state = FINISHED
        self.seqs.pop(seq.request_id, None)
        self._free(seq)

    def _free(self, seq: Seq) -> None:
        if seq.blocks:
            # Tail blocks first: a chain's end is evicted before its shared beginning.
            self.pool.release(reversed(seq.blocks))
            seq.blocks = []

    def _preempt(self, seq: Seq) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.state = WAITING
        self.num_preemptions += 1
        if self.by_priority:
            self._wait_in_order(seq)
        else:
            self.waiting.appendleft(seq)

    def expire_held(self, now: float) -> None:
        """Free prefill holds whose decode side never pulled them."""
        for rid in [rid for rid, s in self.held.items() if s.held_until <= now]:
            self.release_held(rid)

    def _ensure_digests(self, seq: Seq, nblocks: int) -> None:
        have = len(seq.digests)
        if have < nblocks:
            req = seq.req
            parent = seq.digests[-1] if have else None
            seq.digests.extend(
                self.hasher.chain(seq.tokens, have, parent, req.lora_name, req.cache_salt, nblocks)
            )

    def _cache_blocks(self, seq: Seq, num_full: int) -> None:
        """Register newly full blocks in the prefix cache and emit their ``BlockStored``."""
        start = seq.num_cached_blocks
        self._ensure_digests(seq, num_full)
        pool = self.pool
        published = self.hasher.published
        parent = seq.blocks[start - 1].published if start else None
        hashes: list[int | bytes] = []
        for i in range(start, num_full):
            digest = seq.digests[i]
            b = seq.blocks[i]
            h = published(digest)
            pool.register(b, digest, h)
            hashes.append(h)
        seq.num_cached_blocks = num_full
        bs = self.block_size
        tokens = seq.tokens
        if self.hasher.flavor == "sglang":
            for k, h in enumerate(hashes):
                i = start + k
                pool.events.append(
                    BlockStored([h], parent, tokens[i * bs : (i + 1) * bs], bs, None)
                )
                parent = h
        else:
            req = seq.req
            extra = None
            if req.lora_name or req.cache_salt:
                extra = [
                    self.hasher.extra_keys(req.lora_name, req.cache_salt, i == 0)
                    for i in range(start, num_full)
                ]
            pool.events.append(
                BlockStored(
                    hashes,
                    parent,
                    tokens[start * bs : num_full * bs],
                    bs,
                    req.lora_id,
                    lora_name=req.lora_name,
                    extra_keys=extra,
                )
            )

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.pool.usage,
            num_gpu_blocks=self.config.num_gpu_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions=self.num_preemptions,
            requests_finished=self.requests_finished,
            running_loras=_count_loras(self.running),
            waiting_loras=_count_loras(self.waiting),
        )


def _count_loras(seqs: Iterable[Seq]) -> dict[str, int]:
    out: dict[str, int] = {}
    for seq in seqs:
        name = seq.req.lora_name
        if name:
            out[name] = out.get(name, 0) + 1
    return out
