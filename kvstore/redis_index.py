"""Redis prefix index: shared by router replicas.

Layout under a key prefix (namespace) ``P``:
- ``P b:<8-byte key>``: hash, field ``instance \\t rank \\t tier`` -> expiry in ms (0 = held
  until removed). The key itself carries an idle TTL refreshed on every store, so blocks
  of a vanished engine age out; put Redis in ``allkeys-lru`` to bound memory by LRU too.
- ``P l:<field>``: set of the block keys a location holds (to clear it).
- ``P locs``: set of known location fields.

Every update and the lookup run as Lua scripts: each is atomic, and the lookup walks
the blocks server-side in one round trip, stopping at the first miss.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import redis.asyncio as aioredis

from kvstore.index import (
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
local lset = p .. 'l:' .. f
redis.call('SADD', p .. 'locs', f)
for off = 1, #blob, 8 do
  local kid = string.sub(blob, off, off + 7)
  local k = p .. 'b:' .. kid
  local cur = redis.call('HGET', k, f)
  if exp == 0 or not cur or (cur ~= '0' and tonumber(cur) < exp) then
    redis.call('HSET', k, f, ARGV[3])
  end
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
  redis.call('SADD', lset, kid)
end
if redis.call('PTTL', lset) < ttl then redis.call('PEXPIRE', lset, ttl) end
return 1
"""

_REMOVE = """
local p, f, blob = ARGV[1], ARGV[2], ARGV[3]
local lset = p .. 'l:' .. f
for off = 1, #blob, 8 do
  local kid = string.sub(blob, off, off + 7)
  redis.call('HDEL', p .. 'b:' .. kid, f)
  redis.call('SREM', lset, kid)
end
return 1
"""

_CLEAR = """
local p = ARGV[1]
for i = 2, #ARGV do
  local f = ARGV[i]
  local lset = p .. 'l:' .. f
  for _, kid in ipairs(redis.call('SMEMBERS', lset)) do
    redis.call('HDEL', p .. 'b:' .. kid, f)
  end
  redis.call('DEL', lset)
  redis.call('SREM', p .. 'locs', f)
end
return 1
"""

_LOOKUP = """
local p, now, blob = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local allowed = nil
if #ARGV > 3 then
  allowed = {}
  for i = 4, #ARGV do allowed[ARGV[i]] = true end
end
local flat = redis.call('HGETALL', p .. 'b:' .. string.sub(blob, 1, 8))
local alive, out = {}, {}
for j = 1, #flat, 2 do
  local e = flat[j + 1]
  if (e == '0' or tonumber(e) > now)
      and (allowed == nil or allowed[string.match(flat[j], '^[^\t]*')]) then
    alive[#alive + 1] = flat[j]
  end
end
local done = 0
if #alive > 0 then done = 1 end
for off = 9, #blob, 8 do
  if #alive == 0 then break end
  local vals = redis.call('HMGET', p .. 'b:' .. string.sub(blob, off, off + 7), unpack(alive))
  local keep = nil
  for j = 1, #alive do
    local e = vals[j]
    if not e or (e ~= '0' and tonumber(e) <= now) then
      if keep == nil then
        keep = {}
        for q = 1, j - 1 do keep[q] = alive[q] end
      end
      out[#out + 1] = alive[j]
      out[#out + 1] = done
    elseif keep ~= nil then
      keep[#keep + 1] = alive[j]
    end
  end
  if keep ~= nil then alive = keep end
  if #alive > 0 then done = done + 1 end
end
for j = 1, #alive do
  out[#out + 1] = alive[j]
  out[#out + 1] = done
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


class RedisIndex:
    kind: BackendKind = "redis"

    def __init__(
        self,
        url: str,
        block_size: int = 16,
        prefix: str = "switchyard:kv:",
        idle_ttl_s: float = 3600.0,
        socket_timeout_s: float = 1.0,
    ) -> None:
        self.block_size = block_size
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
        self, keys: list[int], candidates: Collection[str] | None = None
    ) -> list[Match]:
        if not keys:
            return []
        args: list[bytes | str | int] = [self.prefix, int(time.time() * 1000), _blob(keys)]
        if candidates is not None:
            if not candidates:
                return []
            args.extend(candidates)
        flat = await self._lookup(args=args)
        bs = self.block_size
        out = []
        for i in range(0, len(flat), 2):
            n = int(flat[i + 1])
            if n:
                loc = _location(flat[i].decode())
                out.append(Match(loc.instance, loc.dp_rank, loc.tier, n * bs))
        return rank_matches(out)

    def _add_args(self, keys: list[int], location: Location, ttl_s: float | None) -> list:
        if ttl_s is None:
            expiry, ttl = 0, self.idle_ttl_ms
        else:
            ttl = max(1, int(ttl_s * 1000))
            expiry = int(time.time() * 1000) + ttl
        return [self.prefix, _field(location), expiry, ttl, _blob(keys)]

    async def add(self, keys: list[int], location: Location, ttl_s: float | None = None) -> None:
        if keys:
            await self._add(args=self._add_args(keys, location, ttl_s))

    async def remove(self, keys: list[int], location: Location) -> None:
        if keys:
            await self._remove(args=[self.prefix, _field(location), _blob(keys)])

    async def _fields_of(self, instance: str, dp_rank: int | None) -> list[str]:
        fields = [f.decode() for f in await self._r.smembers(self.prefix + "locs")]
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
                args = [self.prefix, _field(op.location), _blob(op.keys)]
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
        fields = [f.decode() for f in await self._r.smembers(self.prefix + "locs")]
        pipe = self._r.pipeline(transaction=False)
        for f in fields:
            pipe.scard(self.prefix + "l:" + f)
        counts = await pipe.execute() if fields else []
        return [LocationInfo(_location(f), int(c)) for f, c in zip(fields, counts, strict=True)]

    async def size(self) -> int:
        """Distinct block keys, counted by SCAN (for /metrics and tests, not the hot path)."""
        n = 0
        async for _ in self._r.scan_iter(match=self.prefix + "b:*", count=1000):
            n += 1
        return n

    async def ping(self) -> None:
        await self._r.ping()

    async def close(self) -> None:
        await self._r.aclose()
