"""deploy/ specs: every config loads through the real settings models, every manifest
field is a real Kubernetes field, the engine pods are what our discovery reads, the compose
file only uses real CLI flags, and the dashboard only queries metrics that are exported."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client as k8s
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from switchyard.balancer.k8s import pod_ready, pod_spec
from switchyard.balancer.settings import BalancerSettings
from switchyard.core.settings import ServiceSettings, group_of
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.mock.fleet import plan_fleet
from switchyard.mock.settings import MockSettings
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.server import build_app, worker_specs
from switchyard.router.settings import RouterSettings
from tests.support import REPO, TOKENIZER_DIR, Server, free_port, free_port_block, redis_server

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
EXAMPLE = DEPLOY / "switchyard.yaml"
LOCAL = DEPLOY / "local-stack.yaml"
DASHBOARD = DEPLOY / "grafana" / "switchyard-dashboard.json"
IMAGE = "switchyard:latest"
MODELS: dict[str, type[ServiceSettings]] = {
    "router": RouterSettings,
    "balancer": BalancerSettings,
    "kvstore": KVStoreSettings,
    "mock": MockSettings,
}

pytestmark = pytest.mark.timeout(90)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests(*dirs: str) -> list[dict[str, Any]]:
    """The resources each directory's kustomization deploys from its own files (no patches)."""
    docs = []
    for name in dirs:
        kust = yaml.safe_load((K8S / name / "kustomization.yaml").read_text())
        for ref in kust["resources"]:
            if (K8S / name / ref).is_file():
                docs += load_docs(K8S / name / ref)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def configmap_file(tmp_path: Path) -> Path:
    """The switchyard.yaml the ConfigMap mounts into the pods, as a file."""
    cm = find(manifests("base"), "ConfigMap", "switchyard-config")
    path = tmp_path / "switchyard.yaml"
    path.write_text(cm["data"]["switchyard.yaml"])
    return path


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector ('k=v,k2=v2'), the form our discovery setting uses."""
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k.strip()) == v.strip() for k, v in terms)


@functools.cache
def cli_flags(command: str) -> frozenset[str]:
    env = dict(os.environ, COLUMNS="240", NO_COLOR="1", TERM="dumb")
    out = subprocess.run(
        [sys.executable, "-m", "switchyard", command, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out))


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


# -- every file parses ---------------------------------------------------------------------


def test_every_yaml_file_under_deploy_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 12
    for path in files:
        assert load_docs(path), f"{path} is empty"


def test_dashboard_is_valid_json_with_unique_panel_ids() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] == "switchyard"


# -- example configs load through the settings models ----------------------------------------


def unknown_keys(model: type[BaseModel], values: dict[str, Any], where: str = "") -> set[str]:
    """Keys that name no field, at any depth of the groups (``router.timeouts.connect_s``)."""
    unknown = set()
    for key, value in values.items():
        field = model.model_fields.get(key)
        if field is None:
            unknown.add(where + key)
            continue
        group = group_of(field.annotation)
        if group is not None and isinstance(value, dict):
            unknown |= unknown_keys(group, value, f"{where}{key}.")
    return unknown


@pytest.mark.parametrize("path", [EXAMPLE, LOCAL], ids=["switchyard", "local-stack"])
def test_config_keys_are_all_settings_fields(path: Path) -> None:
    """The models ignore unknown keys, so a misspelt key would silently do nothing."""
    raw = yaml.safe_load(path.read_text())
    for section, values in raw.items():
        unknown = unknown_keys(MODELS[section], values)
        assert not unknown, f"{path.name} {section}: unknown keys {unknown}"


def test_configmap_keys_are_all_settings_fields(tmp_path: Path) -> None:
    raw = yaml.safe_load(configmap_file(tmp_path).read_text())
    assert set(raw) == {"router", "balancer", "kvstore"}
    for section, values in raw.items():
        assert not unknown_keys(MODELS[section], values), section


def test_an_old_flat_key_is_caught_as_unknown() -> None:
    assert unknown_keys(RouterSettings, {"connect_timeout_s": 3, "timeouts": {"idle": 1}}) == {
        "connect_timeout_s",
        "timeouts.idle",
    }


def test_example_config_routes_kv_aware_with_events_per_worker() -> None:
    s = RouterSettings.load(EXAMPLE)
    assert s.policy == "kv_aware"
    assert s.tokenizer == "/models/Llama-3.1-8B-Instruct"
    assert s.redis_url == "redis://10.0.0.5:6379/0"
    assert s.admission.slo_ttft_ms == 2000
    specs = worker_specs(s)
    assert len(specs) == 3
    assert all(spec.kv_events and spec.kv_events.startswith("tcp://") for spec in specs)
    assert [spec.dp_size for spec in specs] == [1, 1, 4]
    assert build_scheduler(s.policy, s.policy_options).needs_prefix


def test_example_config_assembles_a_router_with_its_kv_store() -> None:
    """Everything but the model's tokenizer files, which only exist next to the real engines."""
    app = build_app(RouterSettings.load(EXAMPLE, tokenizer=str(TOKENIZER_DIR)), EXAMPLE)
    assert app.kv is not None
    assert app.fleet.settings.redis_url == "redis://10.0.0.5:6379/0"
    assert len(app.fleet.workers()) == 3


def test_local_stack_assembles_a_kv_aware_router() -> None:
    app = build_app(RouterSettings.load(LOCAL), LOCAL)
    assert app.kv is not None and len(app.fleet.workers()) == 4


def test_configmap_assembles_a_router_that_discovers_engines(tmp_path: Path) -> None:
    path = configmap_file(tmp_path)
    app = build_app(RouterSettings.load(path, tokenizer=str(TOKENIZER_DIR)), path)
    assert app.kv is not None
    assert app.fleet.settings.kubernetes and app.fleet.workers() == []


def test_example_config_loads_balancer_section() -> None:
    s = BalancerSettings.load(EXAMPLE)
    assert s.dp_policy == "step_balanced"
    assert s.slow_start_s == 10.0
    assert s.kubernetes is False


def test_example_config_loads_kvstore_section() -> None:
    s = KVStoreSettings.load(EXAMPLE)
    assert s.redis_prefix == "switchyard:kv:"
    assert s.lookup_timeout_ms == 20.0
    assert s.capacity_blocks == 2_000_000


def test_flags_and_environment_override_the_example_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_PORT", "9100")
    s = RouterSettings.load(EXAMPLE, policy="least_load")
    assert (s.port, s.policy) == (9100, "least_load")


def test_local_stack_router_lists_exactly_the_mock_fleet_ports() -> None:
    """`mock-fleet --config local-stack.yaml --count 4` serves what the router expects."""
    router = RouterSettings.load(LOCAL)
    fleet = plan_fleet(LOCAL, {}, 4, 8100, 0, 0, 5557)
    expected = {f"http://127.0.0.1:{m.port}": f"tcp://127.0.0.1:{m.kv_events_port}" for m in fleet}
    assert {spec.url: spec.kv_events for spec in worker_specs(router)} == expected
    assert router.policy == "kv_aware"
    assert all(m.block_size == router.kv.block_size for m in fleet)


def test_local_stack_routes_a_shared_prefix_to_the_engine_that_caches_it(tmp_path: Path) -> None:
    """The documented two commands, moved to free ports: later turns hit the engine's cache."""
    base, kv_base, port = free_port_block(4), free_port_block(4), free_port()
    raw = yaml.safe_load(LOCAL.read_text())
    fleet = plan_fleet(LOCAL, {}, 4, base, 0, 0, kv_base)
    raw["router"]["port"] = port
    raw["router"]["workers"] = [f"http://127.0.0.1:{m.port}" for m in fleet]
    raw["router"]["kv"]["events"] = [
        f"http://127.0.0.1:{m.port}=tcp://127.0.0.1:{m.kv_events_port}" for m in fleet
    ]
    config = tmp_path / "local-stack.yaml"
    config.write_text(yaml.safe_dump(raw))
    engines = Server(
        f"mock-fleet --config {LOCAL} --count 4 --base-port {base} "
        f"--kv-events-base-port {kv_base} --speed 50".split(),
        base,
    )
    with engines, Server(["router", "--config", str(config)], port) as router:
        cached = _chat_cached_tokens(router.url, 4)
    assert cached[0] == 0
    assert min(cached[1:]) >= 16 * 10


def test_local_stack_tokenizer_is_the_mock_engines_tokenizer() -> None:
    router = RouterSettings.load(LOCAL)
    assert (REPO / router.tokenizer).resolve() == TOKENIZER_DIR.resolve()


def test_configmap_discovers_engines_with_the_default_selector(tmp_path: Path) -> None:
    path = configmap_file(tmp_path)
    balancer = BalancerSettings.load(path)
    assert balancer.kubernetes is True
    assert balancer.kubernetes_selector == BalancerSettings().kubernetes_selector
    assert balancer.kubernetes_namespace == "switchyard"
    router = RouterSettings.load(path)
    assert router.workers == [] and router.host == "0.0.0.0"
    assert router.redis_url == balancer.redis_url == KVStoreSettings.load(path).redis_url


# -- Kubernetes manifests --------------------------------------------------------------------


def _model(kind: str) -> Any:
    return getattr(k8s, "V1" + kind)


def _check_fields(value: Any, type_name: str, where: str) -> None:
    """Every key must be a field of the official client's model; string maps hold strings."""
    inner = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if inner:
        assert isinstance(value, list), f"{where}: expected a list"
        for i, item in enumerate(value):
            _check_fields(item, inner.group(1), f"{where}[{i}]")
        return
    mapping = re.fullmatch(r"(?:dict\(str, |Dict\[str, )(.+)[\)\]]", type_name)
    if mapping:
        assert isinstance(value, dict), f"{where}: expected a mapping"
        for key, item in value.items():
            _check_fields(item, mapping.group(1), f"{where}.{key}")
        return
    model = getattr(k8s, type_name, None)
    if model is None or not hasattr(model, "attribute_map"):
        if type_name == "str":
            assert isinstance(value, str), f"{where}: {value!r} must be a string"
        elif type_name == "int":
            assert isinstance(value, int), f"{where}: {value!r} must be an integer"
        elif type_name == "bool":
            assert isinstance(value, bool), f"{where}: {value!r} must be a boolean"
        return
    assert isinstance(value, dict), f"{where}: expected a {type_name} mapping"
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, item in value.items():
        assert key in by_json, f"{where}: {key!r} is not a field of {type_name}"
        _check_fields(item, model.openapi_types[by_json[key]], f"{where}.{key}")


def test_every_manifest_field_is_a_kubernetes_api_field() -> None:
    docs = manifests("base", "services-mode")
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"} <= kinds
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        _check_fields(doc, "V1" + doc["kind"], name)
        assert _model(doc["kind"]).attribute_map["api_version"] == "apiVersion"


@pytest.mark.parametrize("directory", ["base", "services-mode"])
def test_kustomization_lists_every_manifest_of_its_directory(directory: str) -> None:
    kust = yaml.safe_load((K8S / directory / "kustomization.yaml").read_text())
    local = {r for r in kust["resources"] if not r.startswith("..")}
    patches = {p["path"] for p in kust.get("patches", [])}
    on_disk = {p.name for p in (K8S / directory).glob("*.yaml")} - {"kustomization.yaml"}
    assert local | patches == on_disk
    for ref in kust["resources"]:
        assert (K8S / directory / ref).exists(), ref


def test_top_level_kustomization_deploys_the_base() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["resources"] == ["base"]


def _deployments(*dirs: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests(*dirs) if d["kind"] == "Deployment"}


def test_every_container_has_readiness_and_liveness_probes() -> None:
    for name, dep in _deployments("base", "services-mode").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, f"{name}/{c['name']}"
            ports = {p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                target = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                if target is not None:
                    assert target["port"] in ports, f"{name}: {probe} names an unknown port"


def test_router_is_ready_on_ready_and_alive_on_health() -> None:
    router = _deployments("base")["switchyard-router"]
    c = router["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["spec"]["replicas"] == 2


def test_tokenizer_init_container_fills_the_path_the_config_names(tmp_path: Path) -> None:
    config = configmap_file(tmp_path)
    wanted = {RouterSettings.load(config).tokenizer, KVStoreSettings.load(config).tokenizer}
    assert wanted == {"/models/tokenizer"}
    for name in ("switchyard-router", "switchyard-kvstore"):
        pod = _deployments("base", "services-mode")[name]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        script = init["args"][0]
        compile(script, "fetch-tokenizer", "exec")
        assert 'local_dir="/models/tokenizer"' in script
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        main = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["tokenizer"] == main["tokenizer"] == "/models"
        assert {"name": "tokenizer", "emptyDir": {}} in pod["volumes"]


def test_router_replicas_share_one_redis_service(tmp_path: Path) -> None:
    docs = manifests("base")
    service = find(docs, "Service", "redis")
    assert RouterSettings.load(configmap_file(tmp_path)).redis_url == "redis://redis:6379/0"
    assert service["spec"]["ports"][0]["port"] == 6379
    redis = _deployments("base")["redis"]
    assert selector_matches(
        ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items()),
        redis["spec"]["template"]["metadata"]["labels"],
    )


def test_role_allows_list_and_watch_on_pods_for_the_discovering_service_account() -> None:
    docs = manifests("base", "services-mode")
    role = find(docs, "Role", "switchyard-pod-discovery")
    pod_rules = [r for r in role["rules"] if "pods" in r["resources"] and "" in r["apiGroups"]]
    assert pod_rules and {"list", "watch"} <= set(pod_rules[0]["verbs"])
    binding = find(docs, "RoleBinding", "switchyard-pod-discovery")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "switchyard-pod-discovery",
    }
    account = binding["subjects"][0]["name"]
    find(docs, "ServiceAccount", account)
    for name in ("switchyard-router", "switchyard-balancer"):
        pod = _deployments("base", "services-mode")[name]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == account


def test_engine_pods_match_the_default_discovery_selector_and_components_do_not() -> None:
    selector = BalancerSettings().kubernetes_selector
    deployments = _deployments("base", "services-mode")
    engines = [
        n
        for n, d in deployments.items()
        if selector_matches(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert engines == ["vllm"]


def _as_running_pod(template: dict[str, Any], ip: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "switchyard", "name": "vllm-0", **template["metadata"]},
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_discovery_reads_the_engine_pods_role_port_models_and_kv_events() -> None:
    template = _deployments("base")["vllm"]["spec"]["template"]
    pod = _as_running_pod(template, "10.1.2.3")
    assert pod_ready(pod)
    spec = pod_spec(pod, BalancerSettings().kubernetes_port)
    assert spec.url == "http://10.1.2.3:8000"
    assert spec.role == "unified" and spec.flavor == "vllm" and spec.dp_size == 1
    assert spec.models == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert spec.kv_events == "tcp://10.1.2.3:5557"


def test_engine_publishes_kv_events_where_its_annotation_says() -> None:
    template = _deployments("base")["vllm"]["spec"]["template"]
    c = template["spec"]["containers"][0]
    port = template["metadata"]["annotations"]["switchyard.io/kv-events-port"]
    config = c["args"][c["args"].index("--kv-events-config") + 1]
    assert f"tcp://*:{port}" in config and '"enable_kv_cache_events": true' in config
    assert int(port) in {p["containerPort"] for p in c["ports"]}
    assert "--enable-prefix-caching" in c["args"]


def test_switchyard_pods_carry_prometheus_scrape_annotations_on_their_http_port() -> None:
    for name, dep in _deployments("base", "services-mode").items():
        if name == "redis":
            continue
        template = dep["spec"]["template"]
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", name
        assert notes["prometheus.io/path"] == "/metrics", name
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert int(notes["prometheus.io/port"]) in ports, name


def test_pod_disruption_budget_selects_the_router_pods() -> None:
    pdb = find(manifests("base"), "PodDisruptionBudget", "switchyard-router")
    router = _deployments("base")["switchyard-router"]["spec"]
    labels = router["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    assert pdb["spec"]["minAvailable"] < router["replicas"]


def test_every_service_selects_a_deployment_and_targets_a_named_port() -> None:
    docs = manifests("base", "services-mode")
    deployments = _deployments("base", "services-mode")
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        targets = [
            d
            for d in deployments.values()
            if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
        ]
        assert len(targets) == 1, svc["metadata"]["name"]
        names = {
            p["name"]
            for c in targets[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, svc["metadata"]["name"]


def _switchyard_containers(*dirs: str) -> list[tuple[str, list[str]]]:
    found = []
    for name, dep in _deployments(*dirs).items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"] == IMAGE:
                found.append((name, c["args"]))
    return found


def test_switchyard_containers_use_real_commands_and_flags() -> None:
    containers = _switchyard_containers("base", "services-mode")
    assert {args[0] for _, args in containers} == {"router", "balancer", "kvstore"}
    for name, args in containers:
        assert set(flags_of(args)) <= cli_flags(args[0]), name


def strategic_merge(base: Any, patch: Any) -> Any:
    """The subset of kubectl's strategic merge our patches use: maps merge, null deletes,
    lists of named items (containers) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and all("name" in i for i in patch):
        by_name = {item["name"]: item for item in patch}
        merged_list = [strategic_merge(i, by_name.pop(i["name"], {})) for i in base]
        return merged_list + list(by_name.values())
    return patch


def services_mode_deployments() -> dict[str, dict[str, Any]]:
    """Services mode as kustomize renders it: base and overlay resources, patches applied."""
    deployments = _deployments("base", "services-mode")
    kust = yaml.safe_load((K8S / "services-mode" / "kustomization.yaml").read_text())
    for entry in kust["patches"]:
        patch = load_docs(K8S / "services-mode" / entry["path"])[0]
        name = patch["metadata"]["name"]
        assert patch["kind"] == "Deployment" and name in deployments, entry["path"]
        deployments[name] = strategic_merge(deployments[name], patch)
    return deployments


def test_services_mode_patches_only_existing_containers() -> None:
    base = _deployments("base")
    for name, dep in services_mode_deployments().items():
        if name in base:
            containers = dep["spec"]["template"]["spec"]["containers"]
            before = base[name]["spec"]["template"]["spec"]["containers"]
            assert [c["name"] for c in containers] == [c["name"] for c in before]


def test_services_mode_points_the_router_at_the_balancer_and_kvstore_services() -> None:
    router = services_mode_deployments()["switchyard-router"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["router", "--config", "/etc/switchyard/switchyard.yaml"]
    assert set(flags_of(args)) <= cli_flags("router")
    services = {
        d["metadata"]["name"]: d["spec"]["ports"][0]["port"]
        for d in manifests("services-mode")
        if d["kind"] == "Service"
    }
    for flag in ("--balancer", "--kvstore"):
        url = httpx.URL(args[args.index(flag) + 1])
        assert services[url.host] == url.port


def _secret_env(deployment: dict[str, Any]) -> dict[str, tuple[str, str]]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_services_mode_router_sends_the_keys_the_kvstore_and_balancer_require() -> None:
    deployments = services_mode_deployments()
    router = _secret_env(deployments["switchyard-router"])
    kvstore = _secret_env(deployments["switchyard-kvstore"])
    balancer = _secret_env(deployments["switchyard-balancer"])
    kvstore_key = kvstore["SWITCHYARD_KVSTORE_ADMIN_API_KEY"]
    balancer_key = balancer["SWITCHYARD_BALANCER_ADMIN_API_KEY"]
    assert router["SWITCHYARD_ROUTER_KVSTORE_API_KEY"] == kvstore_key
    assert router["SWITCHYARD_ROUTER_BALANCER_API_KEY"] == balancer_key


def test_services_mode_engines_leave_prefixes_to_approximate_mode() -> None:
    template = services_mode_deployments()["vllm"]["spec"]["template"]
    spec = pod_spec(_as_running_pod(template, "10.1.2.3"), 8000)
    assert spec.kv_events is None and spec.flavor == "vllm"


def _chat_warm_up(base_url: str) -> None:
    openai = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    openai.chat.completions.create(
        model="mock-model", messages=[{"role": "user", "content": "warm up"}], max_tokens=1
    )


def _chat_cached_tokens(base_url: str, turns: int) -> list[int]:
    """Cached prompt tokens per turn of a conversation sharing one long system prompt."""
    openai = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    system = "You are a careful assistant who answers in one line. " * 20
    cached = []
    for turn in range(turns):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {turn}"},
        ]
        reply = openai.chat.completions.create(model="mock-model", messages=messages, max_tokens=4)
        details = reply.usage.prompt_tokens_details if reply.usage else None
        cached.append(details.cached_tokens if details else 0)
        time.sleep(0.3)
    return cached


def test_configmap_in_services_mode_routes_a_shared_prefix_through_both_services(
    tmp_path: Path,
) -> None:
    """The ConfigMap on loopback: static workers instead of discovery, the overlay's router
    flags, one Redis, engines without KV events (as the overlay leaves them)."""
    raw = yaml.safe_load(configmap_file(tmp_path).read_text())
    router_port, balancer_port, kvstore_port = free_port(), free_port(), free_port()
    mocks = [free_port(), free_port()]
    workers = [f"http://127.0.0.1:{p}" for p in mocks]
    with redis_server() as (redis_url, _), contextlib.ExitStack() as stack:
        # The mock engines' tokenizer stands where the init container puts the model's.
        tok = str(TOKENIZER_DIR)
        raw["router"].update(host="127.0.0.1", port=router_port, redis_url=redis_url, tokenizer=tok)
        raw["balancer"].update(
            host="127.0.0.1",
            port=balancer_port,
            kubernetes=False,
            redis_url=redis_url,
            probe_interval_s=0.2,
        )
        raw["kvstore"].update(
            host="127.0.0.1", port=kvstore_port, redis_url=redis_url, tokenizer=tok
        )
        # What the overlay's Secret gives each service: placements need the kvstore's admin key.
        raw["kvstore"]["admin_api_key"] = raw["balancer"]["admin_api_key"] = "deploy-admin"
        raw["router"].update(kvstore_api_key="deploy-admin", balancer_api_key="deploy-admin")
        config = tmp_path / "services.yaml"
        config.write_text(yaml.safe_dump(raw))
        for port in mocks:
            stack.enter_context(Server(f"mock --port {port} --speed 50".split(), port))
        # The workers discovery would find, given to the balancer service alone.
        found = [arg for w in workers for arg in ("-w", w)]
        stack.enter_context(Server(["balancer", "--config", str(config), *found], balancer_port))
        stack.enter_context(Server(["kvstore", "--config", str(config)], kvstore_port))
        args = services_mode_deployments()["switchyard-router"]["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        args = [str(config) if a == "/etc/switchyard/switchyard.yaml" else a for a in args]
        args[args.index("--balancer") + 1] = f"http://127.0.0.1:{balancer_port}"
        args[args.index("--kvstore") + 1] = f"http://127.0.0.1:{kvstore_port}"
        router = stack.enter_context(Server(args, router_port, health_path="/ready"))
        # A cold kvstore service's first lookup can exceed the router's remote-lookup
        # budget and route without prefix knowledge.
        _chat_warm_up(router.url)
        cached = _chat_cached_tokens(router.url, 4)
    assert cached[0] == 0
    assert min(cached[1:]) >= 16 * 10


# -- compose ---------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_runs_redis_a_router_and_four_mock_engines() -> None:
    services = _compose()["services"]
    assert sorted(services) == ["mock-0", "mock-1", "mock-2", "mock-3", "redis", "router"]
    assert all(
        services[n]["build"]["dockerfile"] == "deploy/Dockerfile" for n in services if n != "redis"
    )


def test_compose_commands_use_real_cli_flags() -> None:
    for name, svc in _compose()["services"].items():
        if svc.get("image") != IMAGE:
            continue
        command = svc["command"]
        assert set(flags_of(command)) <= cli_flags(command[0]), name


def _option(command: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in command if a.startswith(flag + "=")]


def test_compose_router_command_loads_and_names_each_mock_with_its_kv_events() -> None:
    services = _compose()["services"]
    command = services["router"]["command"]
    settings = RouterSettings.load(
        None,
        workers=_option(command, "--worker"),
        kv={"events": _option(command, "--kv-events")},
        policy=_option(command, "--policy")[0],
    )
    specs = worker_specs(settings)
    hosts = {httpx.URL(s.url).host for s in specs}
    assert hosts == {n for n in services if n.startswith("mock-")}
    for spec in specs:
        mock = services[httpx.URL(spec.url).host]["command"]
        port = mock[mock.index("--kv-events-port") + 1]
        assert spec.kv_events == f"tcp://{httpx.URL(spec.url).host}:{port}"
    assert set(services["router"]["depends_on"]) == set(services) - {"router"}


# -- Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_installs_every_package_of_the_project() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    # The wheel is built from src/ alone; the manifests need Kubernetes discovery.
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    assert "COPY src ./src" in text and "pip install '.[k8s]'" in text
    assert "k8s" in project["project"]["optional-dependencies"]
    assert 'ENTRYPOINT ["switchyard"]' in text
    assert "/opt/switchyard/mock-tokenizer" in text


# -- dashboard over real metric names --------------------------------------------------------


def exported_names(text: str) -> set[str]:
    """Series names a Prometheus server stores for an exposition (counters get _total)."""
    names = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Run a KV-aware router, a P/D router, a balancer and a kvstore against one mock engine.

    The routers run one process each: several sum their metrics through prometheus_client's
    multiprocess files, which hold no family that has no sample yet (the P/D ones here)."""
    mock_port, kv_port = free_port(), free_port()
    worker = f"http://127.0.0.1:{mock_port}"
    events = f"tcp://127.0.0.1:{kv_port}"
    tok = str(TOKENIZER_DIR)
    mock = Server(
        f"mock --port {mock_port} --speed 100 --kv-events-port {kv_port}".split(), mock_port
    )
    p = [free_port() for _ in range(4)]
    dead = f"http://127.0.0.1:{free_port()}"
    servers = [
        Server(
            f"router --port {p[0]} -w {worker} --policy kv_aware --tokenizer {tok} "
            f"--kv-events {worker}={events} --processes 1".split(),
            p[0],
        ),
        Server(
            f"router --port {p[1]} --pd-protocol vllm --prefill {dead} --decode {worker} "
            "--processes 1".split(),
            p[1],
        ),
        Server(f"balancer --port {p[2]} -w {worker}".split(), p[2]),
        Server(
            f"kvstore --port {p[3]} --subscribe {worker}={events} --tokenizer {tok}".split(), p[3]
        ),
    ]
    try:
        mock.start()
        for server in servers:
            server.start()
        body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(servers[0].url + "/v1/chat/completions", json=body, timeout=10)
        httpx.post(servers[3].url + "/v1/lookup", json={"model": "mock-model", "prompt": "hi"})
        names: set[str] = set()
        for server in servers:
            names |= exported_names(httpx.get(server.url + "/metrics", timeout=5).text)
        return names
    finally:
        for server in [*servers, mock]:
            server.stop()


def dashboard_metrics() -> set[str]:
    return set(re.findall(r"\bswitchyard_[a-z0-9_]+", DASHBOARD.read_text()))


def test_dashboard_queries_only_metrics_the_services_export(exported: set[str]) -> None:
    queried = dashboard_metrics()
    assert len(queried) >= 30
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_dashboard_covers_router_balancer_and_kvstore(exported: set[str]) -> None:
    queried = dashboard_metrics()
    for service in ("router", "router_pd", "balancer", "kvstore"):
        assert any(m.startswith(f"switchyard_{service}_") for m in queried), service
    for core in (
        "switchyard_router_requests_total",
        "switchyard_router_time_to_first_byte_seconds_bucket",
        "switchyard_router_inflight_requests",
        "switchyard_router_fleet_hit_rate",
        "switchyard_router_decision_reasons_total",
    ):
        assert core in queried and core in exported
