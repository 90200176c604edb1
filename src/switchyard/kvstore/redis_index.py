"""Redis prefix index: shared by router replicas.

Layout under a key prefix (namespace) ``P``, per location field ``instance \\t rank \\t tier``:
- ``P l:<field>``: SET of the 8-byte block keys the engine confirmed (events);
- ``P s:<field>``: ZSET of speculative block keys scored by expiry (ms since epoch);
- ``P locs``: SET of known location fields.
Both per-location keys carry an idle TTL refreshed on every store, so the blocks of an
engine that vanished without a clear age out; expired speculative members are purged
on the next speculative store.

Updates and the lookup are Lua scripts, so each is atomic and one round trip. The lookup
asks each location for a chunk of block keys at once (SMISMEMBER / ZMSCORE) and stops
at the first miss: its cost grows with the matched prefix and the number of locations,
not with a per-block command.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import redis.asyncio as aioredis

from switchyard.kvstore.index import (
    Add,
    BackendKind,
    Clear,
    Location,
    LocationInfo,
    Match,
    Op,
    Remove,
    rank_matches,
)

_ADD = """
local p, f, exp, ttl, blob = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local lset, zset = p .. 'l:' .. f, p .. 's:' .. f
redis.call('SADD', p .. 'locs', f)
local kids = {}
for off = 1, #blob, 8 do kids[#kids + 1] = string.sub(blob, off, off + 7) end
for i = 1, #kids, 1000 do
  local j = math.min(#kids, i + 999)
  if exp == 0 then
    redis.call('SADD', lset, unpack(kids, i, j))
    if redis.call('EXISTS', zset) == 1 then redis.call('ZREM', zset, unpack(kids, i, j)) end
  else
    local held = redis.call('SMISMEMBER', lset, unpack(kids, i, j))
    local args = {}
    for q = 1, #held do
      if held[q] == 0 then
        args[#args + 1] = exp
        args[#args + 1] = kids[i + q - 1]
      end
    end
    if #args > 0 then redis.call('ZADD', zset, 'GT', unpack(args)) end
  end
end
if exp == 0 then
  redis.call('PEXPIRE', lset, ttl)
else
  redis.call('ZREMRANGEBYSCORE', zset, '-inf', '(' .. ARGV[6])
  if redis.call('PTTL', zset) < ttl then redis.call('PEXPIRE', zset, ttl) end
end
return 1
"""

_REMOVE = """
local p, f, blob = ARGV[1], ARGV[2], ARGV[3]
local kids = {}
for off = 1, #blob, 8 do kids[#kids + 1] = string.sub(blob, off, off + 7) end
for i = 1, #kids, 1000 do
  local j = math.min(#kids, i + 999)
  redis.call('SREM', p .. 'l:' .. f, unpack(kids, i, j))
  redis.call('ZREM', p .. 's:' .. f, unpack(kids, i, j))
end
return 1
"""

_CLEAR = """
local p = ARGV[1]
for i = 2, #ARGV do
  redis.call('DEL', p .. 'l:' .. ARGV[i], p .. 's:' .. ARGV[i])
  redis.call('SREM', p .. 'locs', ARGV[i])
end
return 1
"""

_LOOKUP = """
local p, now, blob = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = #blob / 8
local kids = {}
for i = 1, n do kids[i] = string.sub(blob, i * 8 - 7, i * 8) end
local fields
if #ARGV > 3 then
  local wanted = {}
  for i = 4, #ARGV do wanted[ARGV[i]] = true end
  fields = {}
  for _, f in ipairs(redis.call('SMEMBERS', p .. 'locs')) do
    if wanted[string.match(f, '^[^\\t]*')] then fields[#fields + 1] = f end
  end
else
  fields = redis.call('SMEMBERS', p .. 'locs')
end
local out = {}
for _, f in ipairs(fields) do
  local lset, zset = p .. 'l:' .. f, p .. 's:' .. f
  local spec = redis.call('EXISTS', zset) == 1
  local run, pos, size = 0, 1, 16
  while pos <= n do
    local last = math.min(n, pos + size - 1)
    local held = redis.call('SMISMEMBER', lset, unpack(kids, pos, last))
    local exp = nil
    if spec then exp = redis.call('ZMSCORE', zset, unpack(kids, pos, last)) end
    local miss = false
    for j = 1, #held do
      if held[j] == 0 and not (exp and exp[j] and tonumber(exp[j]) > now) then
        miss = true
        break
      end
      run = run + 1
    end
    if miss then break end
    pos = last + 1
    size = 1024
  end
  if run > 0 then
    out[#out + 1] = f
    out[#out + 1] = run
  end
end
return out
"""


def _field(loc: Location) -> str:
    return f"{loc.instance}\t{loc.dp_rank}\t{loc.tier}"


def _location(field: str) -> Location:
    instance, rank, tier = field.rsplit("\t", 2)
    return Location(instance, int(rank), tier)


def _blob(keys: list[int]) -> bytes:
    return b"".join(k.to_bytes(8, "big") for k in keys)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisIndex:
    kind: BackendKind = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "switchyard:kv:",
        idle_ttl_s: float = 3600.0,
        socket_timeout_s: float = 1.0,
    ) -> None:
        self.prefix = prefix
        self.idle_ttl_ms = int(idle_ttl_s * 1000)
        self._r = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            retry_on_timeout=False,
            decode_responses=False,
        )
        self._add = self._r.register_script(_ADD)
        self._remove = self._r.register_script(_REMOVE)
        self._clear = self._r.register_script(_CLEAR)
        self._lookup = self._r.register_script(_LOOKUP)

    async def lookup(
        self, keys: list[int], candidates: Collection[str] | None = None, *, block_size: int
    ) -> list[Match]:
        if not keys:
            return []
        args: list[bytes | str | int] = [self.prefix, _now_ms(), _blob(keys)]
        if candidates is not None:
            if not candidates:
                return []
            args.extend(candidates)
        flat = await self._lookup(args=args)
        bs = block_size
        out = []
        for i in range(0, len(flat), 2):
            loc = _location(flat[i].decode())
            out.append(Match(loc.instance, loc.dp_rank, loc.tier, int(flat[i + 1]) * bs))
        return rank_matches(out)

    def _add_args(
        self, keys: list[int], location: Location, ttl_s: float | None
    ) -> list[bytes | str | int]:
        now = _now_ms()
        if ttl_s is None:
            expiry, ttl = 0, self.idle_ttl_ms
        else:
            ttl = max(1, int(ttl_s * 1000))
            expiry = now + ttl
        return [self.prefix, _field(location), expiry, ttl, _blob(keys), now]

    async def add(self, keys: list[int], location: Location, ttl_s: float | None = None) -> None:
        if keys:
            await self._add(args=self._add_args(keys, location, ttl_s))

    async def remove(self, keys: list[int], location: Location) -> None:
        if keys:
            await self._remove(args=[self.prefix, _field(location), _blob(keys)])

    async def _fields_of(self, instance: str, dp_rank: int | None) -> list[str]:
        fields = [_text(f) for f in await self._r.smembers(self.prefix + "locs")]
        return [
            f
            for f in fields
            if (loc := _location(f)).instance == instance
            and (dp_rank is None or loc.dp_rank == dp_rank)
        ]

    async def clear(self, instance: str, dp_rank: int | None = None) -> None:
        fields = await self._fields_of(instance, dp_rank)
        if fields:
            await self._clear(args=[self.prefix, *fields])

    async def apply(self, ops: list[Op]) -> None:
        """One pipeline per run of adds/removes; a clear is applied in order between runs."""
        pipe = self._r.pipeline(transaction=False)
        pending = 0
        for op in ops:
            if isinstance(op, Add) and op.keys:
                await self._add(args=self._add_args(op.keys, op.location, None), client=pipe)
                pending += 1
            elif isinstance(op, Remove) and op.keys:
                args: list[bytes | str] = [self.prefix, _field(op.location), _blob(op.keys)]
                await self._remove(args=args, client=pipe)
                pending += 1
            elif isinstance(op, Clear):
                if pending:
                    await pipe.execute()
                    pending = 0
                await self.clear(op.instance, op.dp_rank)
        if pending:
            await pipe.execute()

    async def locations(self) -> list[LocationInfo]:
        fields = [_text(f) for f in await self._r.smembers(self.prefix + "locs")]
        if not fields:
            return []
        now = _now_ms()
        pipe = self._r.pipeline(transaction=False)
        for f in fields:
            pipe.scard(self.prefix + "l:" + f)
            pipe.zcount(self.prefix + "s:" + f, f"({now}", "+inf")
        counts = await pipe.execute()
        return [
            LocationInfo(_location(f), int(counts[2 * i]) + int(counts[2 * i + 1]))
            for i, f in enumerate(fields)
        ]

    async def size(self) -> int:
        """Indexed (block, location) entries."""
        return sum(info.blocks for info in await self.locations())

    async def ping(self) -> None:
        await self._r.ping()

    async def close(self) -> None:
        await self._r.aclose()
