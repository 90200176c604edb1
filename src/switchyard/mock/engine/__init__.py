"""The clock-independent engine model and its two drivers (real asyncio clock, virtual clock).

- ``config``: ``EngineConfig`` (capacity, scheduler limits, BLIS-fit step-time constants).
- ``core``: ``EngineCore``, the vLLM V1-like scheduler; ``step(now)`` is one forward pass.
- ``blocks``: paged KV blocks, prefix cache, LRU free queue and eviction.
- ``hashing``: chained block hashes as vLLM / SGLang compute and publish them.
- ``events``: engine-neutral ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
- ``driver``: ``RealClockEngine`` (``api.AsyncEngine``, one DP rank) and ``make_ranks``.
- ``virtual``: ``simulate`` and ``VirtualFleet`` (discrete events, routing hook).
- ``api``: the contract the HTTP server codes against.
"""
