"""The clock-independent engine model and its two drivers (real asyncio clock, virtual clock)."""
