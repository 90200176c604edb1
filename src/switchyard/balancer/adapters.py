"""LoRA adapters placed on the fleet: which workers get one, loading and unloading it there.

An adapter is a model with a parent: a worker lists it in ``/v1/models`` with ``parent``
its base model, and only workers that list it are candidates for its requests (a worker
that serves the base model but does not list the adapter would answer 404). The admin
API loads an adapter through vLLM's ``POST /v1/load_lora_adapter`` (engines started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) on every worker of its base model, or on N of
them chosen by rendezvous hashing of its name: the same N while the fleet stays, and the
fewest moves when a worker comes or goes. An adapter registered with ``replicas: 0`` is
only remembered, with its path: the first request that names it, when no worker lists it,
loads it on the first rendezvous choice before it is routed (on-demand placement).

What is registered lives in this process. With several router processes or replicas,
load adapters through the admin API (every process then finds them in the workers'
models) rather than rely on on-demand placement, which only the process that took the
registration can do.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Worker
from switchyard.net.control import async_client

log = logging.getLogger("switchyard.balancer.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    path: str
    base_model: str
    replicas: int | None  # None: every worker of the base model; 0: on demand only


def rendezvous(name: str, workers: list[Worker]) -> list[Worker]:
    """``workers`` in the adapter's rendezvous order (highest random weight first)."""

    def weight(w: Worker) -> bytes:
        return hashlib.blake2b(f"{name}\0{w.id}".encode(), digest_size=8).digest()

    return sorted(workers, key=weight, reverse=True)


class Adapters:
    """The adapters this process placed or may place, over ``fleet``."""

    def __init__(self, fleet: FleetView, timeout_s: float = 60.0) -> None:
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.registered: dict[str, AdapterSpec] = {}
        self._placing: dict[str, asyncio.Task[None]] = {}

    def base_models(self) -> list[str]:
        """Models some worker serves that are not adapters."""
        return sorted({m for w in self.fleet.workers() for m in w.models if m not in w.adapters})

    def base_workers(self, base_model: str) -> list[Worker]:
        """Workers that may take the base model's requests now."""
        return [w for w in self.fleet.candidates(base_model) if base_model not in w.adapters]

    def describe(self) -> list[dict[str, Any]]:
        """Every adapter registered here or listed by a worker, with where it is listed."""
        listed: dict[str, dict[str, Any]] = {}
        for w in self.fleet.workers():
            for name, base in w.adapters.items():
                entry = listed.setdefault(
                    name, {"name": name, "base_model": base, "path": None, "replicas": None}
                )
                entry.setdefault("workers", []).append(w.id)
        for spec in self.registered.values():
            entry = listed.setdefault(spec.name, {"workers": []})
            entry.update(asdict(spec))
            entry["registered"] = True
        for entry in listed.values():
            entry.setdefault("workers", [])
            entry.setdefault("registered", False)
            entry["workers"] = sorted(entry["workers"])
        return [listed[n] for n in sorted(listed)]

    async def load(self, spec: AdapterSpec) -> dict[str, str]:
        """Register ``spec`` and load it where it belongs: worker id -> "loaded", "listed"
        (it was already there) or the error."""
        self.registered[spec.name] = spec
        workers = rendezvous(spec.name, self.base_workers(spec.base_model))
        if spec.replicas is not None:
            workers = workers[: spec.replicas]
        results = dict(await asyncio.gather(*(self._load_on(w, spec) for w in workers)))
        await self.fleet.refresh_models(workers)
        return results

    async def unload(self, name: str) -> dict[str, str]:
        """Unload from every worker listing it and forget it: worker id -> result."""
        self.registered.pop(name, None)
        workers = [w for w in self.fleet.workers() if name in w.adapters]
        results = dict(await asyncio.gather(*(self._unload_on(w, name) for w in workers)))
        await self.fleet.refresh_models(workers)
        return results

    async def resolve(self, model: str) -> list[Worker]:
        """Candidates for a model no candidate lists: the workers' models read again, then,
        for a registered adapter still unlisted, its on-demand placement."""
        await self.fleet.refresh_models()
        found = self.fleet.candidates(model)
        spec = self.registered.get(model)
        if found or spec is None:
            return found
        task = self._placing.get(model)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._place(spec))
            self._placing[model] = task
        await asyncio.shield(task)
        return self.fleet.candidates(model)

    async def _place(self, spec: AdapterSpec) -> None:
        """Load on the first rendezvous choice that takes it."""
        for worker in rendezvous(spec.name, self.base_workers(spec.base_model)):
            _, result = await self._load_on(worker, spec)
            if result in ("loaded", "listed"):
                await self.fleet.refresh_models([worker])
                log.info("placed adapter %s on %s", spec.name, worker.id)
                return
            log.warning("adapter %s not placed on %s: %s", spec.name, worker.id, result)

    async def _load_on(self, worker: Worker, spec: AdapterSpec) -> tuple[str, str]:
        if spec.name in worker.models:
            return worker.id, "listed"
        body = {"lora_name": spec.name, "lora_path": spec.path}
        return worker.id, await self._post_all(worker, LOAD_PATH, body, "loaded")

    async def _unload_on(self, worker: Worker, name: str) -> tuple[str, str]:
        return worker.id, await self._post_all(worker, UNLOAD_PATH, {"lora_name": name}, "unloaded")

    async def _post_all(self, worker: Worker, path: str, body: dict[str, str], ok: str) -> str:
        """POST to the worker (each rank's URL in "urls" mode); ``ok`` or the first error."""
        urls = worker.spec.rank_urls or [worker.url]
        try:
            async with async_client(timeout=self.timeout_s) as client:
                for url in urls:
                    r = await client.post(url + path, json=body)
                    if r.status_code != 200:
                        return f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return ok
