"""A watched workers file (YAML or JSON): the fleet follows its edits.

The file is a list of spec strings or mappings (``WorkerSpec`` fields), or a
mapping with such a list under ``workers``. Polling mtime and size is enough for
config edits and works on every filesystem, including mounted ConfigMaps.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from switchyard.balancer.worker import WorkerSpec

if TYPE_CHECKING:
    from switchyard.balancer.fleet import Fleet

log = logging.getLogger("switchyard.balancer.file")


def read_specs(path: Path) -> list[WorkerSpec]:
    """Parse a workers file; raises ``ValueError`` on a malformed one."""
    raw: Any = yaml.safe_load(path.read_text()) or []
    if isinstance(raw, dict):
        raw = raw.get("workers", [])
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of workers")
    return [WorkerSpec.from_any(item) for item in raw]


class FileSource:
    """Adds, updates and drains-then-removes the workers listed in one file."""

    source = "file"

    def __init__(self, fleet: Fleet, path: str | Path) -> None:
        self.fleet = fleet
        self.path = Path(path)
        self.owned: set[str] = set()
        self._stamp: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.poll()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="balancer:file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.fleet.settings.file_poll_interval_s)
            self.poll()

    def poll(self) -> None:
        """Apply the file if it changed since the last poll; a broken file changes nothing."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            specs = read_specs(self.path) if stamp is not None else []
        except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            log.error("ignoring unreadable workers file %s: %s", self.path, exc)
            return
        self.apply(specs)

    def apply(self, specs: list[WorkerSpec]) -> None:
        wanted = {spec.url: spec for spec in specs}
        for url in sorted(self.owned - wanted.keys()):
            self.fleet.drain(url, remove_when_idle=True)
        for url, spec in wanted.items():
            existing = self.fleet.get(url)
            if existing is not None and existing.source != self.source:
                continue
            self.fleet.add(spec, source=self.source)
        self.owned = {url for url in wanted if self._owns(url)}

    def _owns(self, url: str) -> bool:
        worker = self.fleet.get(url)
        return worker is not None and worker.source == self.source
