"""The fleet's admin API: one FastAPI router, mounted by the router and the balancer service.

Both answer the same paths, parameters, bodies, status codes and errors, so a script that
adds, drains, undrains and removes a worker works against either:

- ``GET /admin/workers``: every worker and its state;
- ``POST /admin/workers``: add a worker (201), or update the one with the same URL;
- ``DELETE /admin/workers?url=URL``: remove it;
- ``POST /admin/workers/drain?url=URL[&remove_when_idle=true]``: no new requests;
- ``POST /admin/workers/undrain?url=URL``: take new requests again;
- ``GET /admin/adapters``: LoRA adapters, registered here or listed by a worker;
- ``POST /admin/adapters``: register an adapter and load it on every worker of its base
  model, or on ``replicas`` of them (rendezvous-chosen; 0: on a request's demand);
- ``DELETE /admin/adapters?name=NAME``: unload it everywhere and forget it.

A worker is named by its URL, normalised as in worker specs (``host:8000/`` is
``http://host:8000``). Every endpoint needs the admin key; without one configured the
API is off (403).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from switchyard.balancer.adapters import Adapters, AdapterSpec
from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Role, Worker, WorkerSpec, normalise_url
from switchyard.core.auth import RequireKey
from switchyard.core.errors import APIError


class WorkerIn(BaseModel):
    """A worker to add: its URL, with options either in WorkerSpec syntax inside ``url``
    (``http://h:8000;role=prefill;dp=2``) or as fields; a field given wins over the URL's."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL, optionally followed by ';key=value' options.")
    models: list[str] | None = Field(None, description="Served models (else asked of /v1/models).")
    role: Role | None = None
    flavor: str | None = Field(None, description="'vllm' or 'sglang'.")
    dp_size: int | None = Field(None, description="Data-parallel ranks behind the URL.")
    dp_mode: str | None = Field(None, description="'header' or 'urls'.")
    rank_urls: list[str] | None = Field(None, description="One URL per DP rank.")
    kv_events: str | None = Field(None, description="KV-event publisher, tcp://HOST:PORT.")
    bootstrap_port: int | None = Field(None, description="SGLang P/D bootstrap port.")

    def to_spec(self) -> WorkerSpec:
        values = WorkerSpec.parse(self.url).to_dict()
        values.update(self.model_dump(exclude={"url"}, exclude_none=True))
        return WorkerSpec.from_any(values)


class AdapterIn(BaseModel):
    """A LoRA adapter to place: loaded with vLLM's ``/v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The adapter's model name.")
    path: str = Field(min_length=1, description="Where the engines load it from.")
    base_model: str | None = Field(
        None, description="The model it adapts (default: the fleet's only base model)."
    )
    replicas: int | None = Field(
        None,
        ge=0,
        description="Workers to load it on (rendezvous-chosen); none: every worker of the "
        "base model; 0: registered only, loaded where the first request for it goes.",
    )


URL = Annotated[str, Query(description="The worker's URL (its id).")]


def admin_router(
    fleet: FleetView, access: RequireKey, adapters: Adapters | None = None
) -> APIRouter:
    """The admin endpoints over ``fleet``, behind ``access``; ``adapters``: the registry a
    router's requests place adapters from (else one of the API's own)."""
    api = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(access)])
    placed = adapters if adapters is not None else Adapters(fleet)

    def known(url: str) -> Worker:
        worker = fleet.get(normalise_url(url))
        if worker is None:
            raise APIError(404, f"No worker {url}", param="url", code="worker_not_found")
        return worker

    @api.get("/workers", summary="Workers and their state")
    async def list_workers() -> dict[str, Any]:
        return {"workers": [w.describe() for w in fleet.workers()]}

    @api.post("/workers", status_code=201, summary="Add a worker")
    async def add_worker(worker: WorkerIn) -> dict[str, Any]:
        try:
            spec = worker.to_spec()
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="url", code="invalid_worker_spec") from None
        return fleet.add(spec, source="admin").describe()

    @api.delete("/workers", summary="Remove a worker")
    async def remove_worker(url: URL) -> dict[str, str]:
        worker = known(url)
        fleet.remove(worker.id)
        return {"removed": worker.id}

    @api.post("/workers/drain", summary="Send it no new requests")
    async def drain_worker(
        url: URL,
        remove_when_idle: Annotated[
            bool, Query(description="Remove it once its in-flight requests end.")
        ] = False,
    ) -> dict[str, Any]:
        worker = known(url)
        fleet.drain(worker.id, remove_when_idle=remove_when_idle)
        return worker.describe()

    @api.post("/workers/undrain", summary="Send it new requests again")
    async def undrain_worker(url: URL) -> dict[str, Any]:
        worker = known(url)
        fleet.undrain(worker.id)
        return worker.describe()

    @api.get("/adapters", summary="LoRA adapters and the workers listing them")
    async def list_adapters() -> dict[str, Any]:
        return {"adapters": placed.describe()}

    @api.post("/adapters", summary="Register a LoRA adapter and load it")
    async def load_adapter(adapter: AdapterIn) -> dict[str, Any]:
        base = adapter.base_model
        if base is None:
            bases = placed.base_models()
            if len(bases) != 1:
                raise APIError(
                    400,
                    f"base_model is required: the fleet serves {len(bases)} base models",
                    param="base_model",
                    code="base_model_required",
                )
            base = bases[0]
        if not placed.base_workers(base) and adapter.replicas != 0:
            raise APIError(
                404, f"No worker serves model '{base}'", param="base_model", code="model_not_found"
            )
        spec = AdapterSpec(adapter.name, adapter.path, base, adapter.replicas)
        results = await placed.load(spec)
        failed = {w: r for w, r in results.items() if r not in ("loaded", "listed")}
        if results and len(failed) == len(results):
            message = f"No worker loaded adapter '{adapter.name}': {failed}"
            raise APIError(502, message, code="adapter_not_loaded")
        return {"adapter": adapter.name, "base_model": base, "workers": results}

    @api.delete("/adapters", summary="Unload a LoRA adapter everywhere and forget it")
    async def unload_adapter(
        name: Annotated[str, Query(description="The adapter's model name.")],
    ) -> dict[str, Any]:
        if name not in placed.registered and fleet.parent_of(name) is None:
            raise APIError(404, f"No adapter {name}", param="name", code="adapter_not_found")
        return {"adapter": name, "workers": await placed.unload(name)}

    return api
