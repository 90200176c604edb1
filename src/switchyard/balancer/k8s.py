"""Kubernetes discovery: engine pods selected by label become workers while they are Ready.

The official ``kubernetes`` client is synchronous, so list+watch runs in a daemon
thread and hands raw pod objects to the event loop; the fleet is only touched there.
Labels and annotations (``switchyard.io/...``) say role, port, DP size, models and
the KV-events and bootstrap ports.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from switchyard.balancer.worker import Role, WorkerSpec

if TYPE_CHECKING:
    from switchyard.balancer.fleet import Fleet

log = logging.getLogger("switchyard.balancer.k8s")

PREFIX = "switchyard.io/"


def missing_client() -> str | None:
    """Why discovery cannot run, in one line, when the ``[k8s]`` extra is not installed."""
    if importlib.util.find_spec("kubernetes") is not None:
        return None
    return "Kubernetes discovery needs the kubernetes client: pip install 'switchyard[k8s]'"


def _meta(pod: dict[str, Any], key: str) -> str | None:
    metadata = pod.get("metadata") or {}
    for bag in (metadata.get("annotations") or {}, metadata.get("labels") or {}):
        if PREFIX + key in bag:
            return str(bag[PREFIX + key])
    return None


def pod_ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return True


def _container_port(pod: dict[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return None


def pod_spec(pod: dict[str, Any], default_port: int) -> WorkerSpec:
    """The worker a pod stands for (whether or not it is ready)."""
    ip = (pod.get("status") or {}).get("podIP") or ""
    port = int(_meta(pod, "port") or _container_port(pod) or default_port)
    host = f"[{ip}]" if ":" in ip else ip
    models = _meta(pod, "models")
    kv_port = _meta(pod, "kv-events-port")
    bootstrap = _meta(pod, "bootstrap-port")
    return WorkerSpec(
        url=f"http://{host}:{port}",
        models=[m for m in (models or "").split(",") if m],
        role=Role(_meta(pod, "role") or "unified"),
        flavor=_meta(pod, "flavor"),
        dp_size=int(_meta(pod, "dp-size") or 1),
        dp_mode=_meta(pod, "dp-mode") or "header",
        kv_events=f"tcp://{host}:{kv_port}" if kv_port else None,
        bootstrap_port=int(bootstrap) if bootstrap else None,
    )


def _pod_key(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


class KubernetesSource:
    """List then watch pods; resync (relist) whenever the watch ends or fails."""

    source = "kubernetes"

    def __init__(self, fleet: Fleet) -> None:
        missing = missing_client()
        if missing is not None:
            raise RuntimeError(missing)
        self.fleet = fleet
        self.pods: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: Any = None
        self.synced = asyncio.Event()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="balancer-k8s", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _client(self) -> Any:
        from kubernetes import client, config

        s = self.fleet.settings
        if s.kubernetes_host:
            configuration = client.Configuration()
            configuration.host = s.kubernetes_host
            return client.CoreV1Api(client.ApiClient(configuration))
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return client.CoreV1Api()

    def _run(self) -> None:
        from kubernetes import watch

        s = self.fleet.settings
        api = None
        while not self._stop.is_set():
            try:
                api = api or self._client()
                resp = api.list_namespaced_pod(
                    s.kubernetes_namespace,
                    label_selector=s.kubernetes_selector,
                    _preload_content=False,
                    _request_timeout=10,
                )
                listing = json.loads(resp.data)
                self._post(self._apply_list, listing.get("items") or [])
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    api.list_namespaced_pod,
                    s.kubernetes_namespace,
                    label_selector=s.kubernetes_selector,
                    resource_version=listing.get("metadata", {}).get("resourceVersion"),
                    timeout_seconds=s.kubernetes_watch_timeout_s,
                    _request_timeout=s.kubernetes_watch_timeout_s + 5,
                ):
                    if self._stop.is_set():
                        break
                    self._post(self._apply_event, event["type"], event["raw_object"])
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("kubernetes list/watch failed, relisting: %s", exc)
                self._stop.wait(1.0)

    def _post(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._stop.is_set():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                self._stop.set()

    def _apply_list(self, pods: list[dict[str, Any]]) -> None:
        seen = set()
        for pod in pods:
            seen.add(_pod_key(pod))
            self._apply_event("MODIFIED", pod)
        for key in set(self.pods) - seen:
            self.fleet.drain(self.pods.pop(key), remove_when_idle=True)
        self.synced.set()

    def _apply_event(self, kind: str, pod: dict[str, Any]) -> None:
        key = _pod_key(pod)
        previous = self.pods.get(key)
        if kind == "DELETED" or not pod_ready(pod):
            if previous is not None:
                del self.pods[key]
                self.fleet.drain(previous, remove_when_idle=True)
            return
        if kind not in ("ADDED", "MODIFIED"):
            return
        try:
            spec = pod_spec(pod, self.fleet.settings.kubernetes_port)
        except (ValueError, TypeError) as exc:
            log.error("pod %s has bad switchyard annotations: %s", key, exc)
            return
        if previous is not None and previous != spec.url:
            self.fleet.drain(previous, remove_when_idle=True)
        self.pods[key] = spec.url
        self.fleet.add(spec, source=self.source)
