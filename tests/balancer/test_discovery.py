"""Registry sources: a watched workers file and Kubernetes pods (against a local API stub)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.k8s import pod_spec
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, Role
from tests.balancer.fleet_stubs import StubFactory, eventually
from tests.router.stub_backend import StubBackend, StubReply, StubRequest

pytestmark = pytest.mark.timeout(30)


def settings(**overrides: Any) -> BalancerSettings:
    values: dict[str, Any] = dict(
        probe_interval_s=0.2, probe_timeout_s=0.2, scrape_interval_s=0.2, file_poll_interval_s=0.05
    )
    values.update(overrides)
    return BalancerSettings(**values)


# Watched file


async def test_file_discovery_follows_edits(tmp_path: Path, stub_engine: StubFactory) -> None:
    a, b = await stub_engine(), await stub_engine(models=("other",))
    path = tmp_path / "workers.yaml"
    path.write_text(f"- {a.url}\n")
    fleet = Fleet(settings(workers_file=str(path)))
    await fleet.start()
    try:
        assert [w.url for w in fleet.workers()] == [a.url]
        path.write_text(f"workers:\n  - {a.url}\n  - url: {b.url}\n    role: prefill\n")
        await eventually(lambda: fleet.get(b.url) is not None)
        assert fleet.get(b.url).role is Role.PREFILL
        await eventually(lambda: fleet.candidates("other", Role.PREFILL) != [])
        path.write_text(json.dumps([f"{b.url};role=decode"]))
        await eventually(lambda: fleet.get(a.url) is None)
        assert fleet.get(b.url).role is Role.DECODE
        assert fleet.candidates("m") == []
    finally:
        await fleet.stop()


async def test_broken_file_edit_keeps_the_last_good_fleet(
    tmp_path: Path, stub_engine: StubFactory
) -> None:
    a = await stub_engine()
    path = tmp_path / "workers.yaml"
    path.write_text(f"- {a.url}\n")
    fleet = Fleet(settings(workers_file=str(path)))
    await fleet.start()
    try:
        path.write_text("- [unclosed\n")
        await asyncio.sleep(0.2)
        assert [w.url for w in fleet.workers()] == [a.url]
    finally:
        await fleet.stop()


async def test_file_removal_lets_inflight_requests_finish(
    tmp_path: Path, stub_engine: StubFactory
) -> None:
    a = await stub_engine()
    path = tmp_path / "workers.yaml"
    path.write_text(f"- {a.url}\n")
    fleet = Fleet(settings(workers_file=str(path)))
    await fleet.start()
    try:
        ticket = fleet.begin(fleet.get(a.url))
        path.write_text("[]\n")
        await eventually(lambda: fleet.get(a.url).draining)
        assert fleet.candidates(None) == []
        fleet.end(ticket, Outcome.SUCCESS)
        assert fleet.get(a.url) is None
    finally:
        await fleet.stop()


# Kubernetes


class KubeStub:
    """Just enough of the Kubernetes API: list and watch pods in a namespace by label selector."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.changed = asyncio.Condition()
        self.watches = 0
        self._server = StubBackend(self._pods)

    @property
    def url(self) -> str:
        return self._server.url

    @staticmethod
    def _selected(pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def put(self, name: str, pod: dict[str, Any], kind: str | None = None) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        kind = kind or ("MODIFIED" if name in self.pods else "ADDED")
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        self.history.append((self.version, kind, json.loads(json.dumps(pod))))
        async with self.changed:
            self.changed.notify_all()

    async def delete(self, name: str) -> None:
        await self.put(name, self.pods[name], "DELETED")

    async def _pods(self, request: StubRequest) -> StubReply:
        if request.method != "GET" or not (
            request.path.startswith("/api/v1/namespaces/") and request.path.endswith("/pods")
        ):
            return StubReply.json({"kind": "Status", "code": 404}, 404)
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1", "True"):
            items = [p for p in self.pods.values() if self._selected(p, selector)]
            return StubReply.json(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        self.watches += 1
        since = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or 30)
        return StubReply(
            content_type="application/json", stream=self._events(since, selector, timeout)
        )

    async def _events(self, since: int, selector: str, timeout: float) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            for version, kind, pod in self.history:
                if version > since and self._selected(pod, selector):
                    line = json.dumps({"type": kind, "object": pod}) + "\n"
                    yield line.encode()
                    since = version
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
                except TimeoutError:
                    break

    async def start(self) -> KubeStub:
        await self._server.open()
        return self

    async def stop(self) -> None:
        await self._server.close()


def pod(name: str, port: int, *, ready: bool = True, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "labels": {"app": "engine", "switchyard.io/role": annotations.pop("role", "unified")},
            "annotations": {"switchyard.io/port": str(port)}
            | {f"switchyard.io/{k.replace('_', '-')}": v for k, v in annotations.items()},
        },
        "spec": {"containers": [{"name": "engine", "image": "mock"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@pytest.fixture
async def kube() -> AsyncIterator[KubeStub]:
    stub = await KubeStub().start()
    yield stub
    await stub.stop()


def kube_settings(kube: KubeStub) -> BalancerSettings:
    return settings(
        kubernetes=True,
        kubernetes_host=kube.url,
        kubernetes_namespace="llm",
        kubernetes_selector="app=engine",
        kubernetes_watch_timeout_s=2,
    )


async def test_kubernetes_discovery_adds_and_removes_workers_as_pods_change(
    kube: KubeStub, stub_engine: StubFactory
) -> None:
    e1, e2 = await stub_engine(), await stub_engine()
    await kube.put("engine-0", pod("engine-0", e1.port, dp_size="2", kv_events_port="5557"))
    fleet = Fleet(kube_settings(kube))
    await fleet.start()
    try:
        await eventually(lambda: fleet.get(e1.url) is not None, timeout=10)
        w1 = fleet.get(e1.url)
        assert w1.source == "kubernetes" and w1.dp_size == 2
        assert w1.spec.kv_events == "tcp://127.0.0.1:5557"
        await eventually(lambda: fleet.candidates("m") == [w1])

        await kube.put("engine-1", pod("engine-1", e2.port, role="prefill"))
        await eventually(lambda: fleet.get(e2.url) is not None)
        assert fleet.get(e2.url).role is Role.PREFILL

        await kube.delete("engine-0")
        await eventually(lambda: fleet.get(e1.url) is None)
        assert [w.url for w in fleet.workers()] == [e2.url]
    finally:
        await fleet.stop()


async def test_kubernetes_pod_that_is_not_ready_is_no_worker(
    kube: KubeStub, stub_engine: StubFactory
) -> None:
    e1 = await stub_engine()
    await kube.put("engine-0", pod("engine-0", e1.port, ready=False))
    fleet = Fleet(kube_settings(kube))
    await fleet.start()
    try:
        await eventually(lambda: kube.watches >= 1, timeout=10)
        assert fleet.workers() == []
        await kube.put("engine-0", pod("engine-0", e1.port, ready=True))
        await eventually(lambda: fleet.get(e1.url) is not None)
        await kube.put("engine-0", pod("engine-0", e1.port, ready=False))
        await eventually(lambda: fleet.get(e1.url) is None)
    finally:
        await fleet.stop()


async def test_kubernetes_watch_resumes_after_the_server_ends_it(
    kube: KubeStub, stub_engine: StubFactory
) -> None:
    e1 = await stub_engine()
    fleet = Fleet(kube_settings(kube).model_copy(update={"kubernetes_watch_timeout_s": 1}))
    await fleet.start()
    try:
        await eventually(lambda: kube.watches >= 2, timeout=10)
        await kube.put("engine-0", pod("engine-0", e1.port))
        await eventually(lambda: fleet.get(e1.url) is not None)
        assert kube.watches >= 2 and fleet.get(e1.url) is not None
    finally:
        await fleet.stop()


def test_pod_annotations_map_to_the_worker_spec() -> None:
    spec = pod_spec(
        pod("p", 9000, role="decode", dp_size="4", models="a,b", bootstrap_port="8998"), 8000
    )
    assert spec.url == "http://127.0.0.1:9000"
    assert spec.role is Role.DECODE and spec.dp_size == 4
    assert spec.models == ["a", "b"] and spec.bootstrap_port == 8998
