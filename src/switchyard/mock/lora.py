"""The LoRA adapters a mock engine knows, and vLLM's routes that load and unload them.

As in vLLM (``vllm/entrypoints/openai/models/serving.py``): an adapter is *known* once it
was given at start (``--lora-modules name=path``) or loaded through
``POST /v1/load_lora_adapter`` (served only when runtime updating is allowed); a request
names it as its ``model``, ``/v1/models`` lists it with ``parent`` (the base model) and
``root`` (its path), and unloading only forgets the name. Which adapters sit in the GPU
slots (``--max-loras``, least recently used evicted) is the engine core's business.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import orjson

# vLLM reads this variable to serve the load and unload routes; the mock honours it too.
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
INVALID = "InvalidUserInput"


def runtime_updating_allowed(setting: bool) -> bool:
    return setting or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    lora_id: int  # vLLM's lora_int_id: 1, 2, ... in load order, kept on an in-place reload


def _error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return status, orjson.dumps(body)


class Adapters:
    """Known adapters by name; ``load``/``unload`` answer as vLLM's routes do."""

    def __init__(self, base_model: str, modules: dict[str, str]) -> None:
        self.base_model = base_model
        self.known: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        for name, path in modules.items():
            self.known[name] = Adapter(name, path, next(self._ids))

    def get(self, name: str) -> Adapter | None:
        return self.known.get(name)

    def cards(self, created: int, owner: str, permission: dict[str, Any]) -> list[dict[str, Any]]:
        """``/v1/models`` entries: vLLM's ``ModelCard`` of an adapter (no ``max_model_len``)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": owner,
                "root": a.path,
                "parent": self.base_model,
                "max_model_len": None,
                "permission": [permission],
            }
            for a in self.known.values()
        ]

    def load(self, data: dict[str, Any]) -> tuple[int, bytes]:
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            return _error(400, message, INVALID)
        if name == self.base_model:
            return _error(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                INVALID,
            )
        previous = self.known.get(name)
        if previous is not None and not data.get("load_inplace"):
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                INVALID,
            )
        lora_id = previous.lora_id if previous is not None else next(self._ids)
        self.known[name] = Adapter(name, path, lora_id)
        return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()

    def unload(self, data: dict[str, Any]) -> tuple[int, bytes]:
        name = data.get("lora_name")
        if not isinstance(name, str) or not name:
            message = "'lora_name' needs to be provided to unload a LoRA adapter."
            return _error(400, message, INVALID)
        if name not in self.known:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.known[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode()
