"""deploy/kubernetes/autoscaling/ specs: the HPAs are autoscaling/v2 objects field for field
(the official client's models), the KEDA ScaledObject matches KEDA's documented spec (a
hand-written schema in tests/fixtures/keda), every target is a Deployment of the base
manifests, and every metric they name is served by the shipped prometheus-adapter rules
from a recording rule of deploy/prometheus/alerts.yaml or a metric the router exports.
That the queries return what an autoscaler needs on a live Prometheus is
tests/deploy/test_prometheus_live.py's part."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import yaml

from bench.dashboards import AUTOSCALING, RULES, SHIPPED_MODEL, autoscaler_expressions
from tests.deploy.test_deploy_configs import (
    _check_fields,
    _deployments,
    find,
    load_docs,
    manifests,
)
from tests.support import REPO

SCHEMA = REPO / "tests" / "fixtures" / "keda" / "scaledobject.schema.json"
KUSTOMIZATIONS = [REPO / "deploy" / "kubernetes" / "kustomization.yaml"]


def one(name: str) -> dict[str, Any]:
    (doc,) = load_docs(AUTOSCALING / name)
    return doc


def recorded() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def test_the_folder_holds_the_documented_files() -> None:
    names = sorted(p.name for p in AUTOSCALING.iterdir())
    assert names == [
        "hpa-engines.yaml",
        "hpa-router.yaml",
        "keda-engines.yaml",
        "prometheus-adapter.yaml",
    ]
    readme = (REPO / "deploy" / "README.md").read_text()
    assert all(f"autoscaling/{name}" in readme for name in names)


def test_no_kustomization_deploys_the_autoscalers() -> None:
    """They need KEDA's CRD or prometheus-adapter, which a plain cluster lacks."""
    for path in [*KUSTOMIZATIONS, *(REPO / "deploy" / "kubernetes").glob("*/kustomization.yaml")]:
        assert "autoscaling" not in path.read_text(), path


def test_hpas_are_autoscaling_v2_objects_field_for_field() -> None:
    for name in ("hpa-engines.yaml", "hpa-router.yaml"):
        hpa = one(name)
        assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
        _check_fields(hpa, "V2HorizontalPodAutoscaler", name)
        spec = hpa["spec"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        for metric in spec["metrics"]:
            assert metric["type"].lower() in metric, name
            target = metric[metric["type"].lower()]["target"]
            assert target["type"] in ("Utilization", "Value", "AverageValue"), name


def test_keda_scaled_object_matches_kedas_documented_spec() -> None:
    scaled = one("keda-engines.yaml")
    jsonschema.validate(scaled, json.loads(SCHEMA.read_text()))
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    _check_fields(behavior, "V2HorizontalPodAutoscalerBehavior", "keda behavior")
    assert {t["name"] for t in scaled["spec"]["triggers"]} == {"queue", "saturation"}


def test_the_keda_schema_refuses_a_misspelt_field() -> None:
    scaled = one("keda-engines.yaml")
    scaled["spec"]["triggers"][0]["metadata"]["treshold"] = "4"
    try:
        jsonschema.validate(scaled, json.loads(SCHEMA.read_text()))
    except jsonschema.ValidationError as error:
        assert "treshold" in error.message
    else:
        raise AssertionError("a misspelt trigger field passed")


def test_every_autoscaler_targets_a_deployment_of_the_base_manifests() -> None:
    deployments = _deployments("base")
    targets = {
        "hpa-engines.yaml": "vllm",
        "keda-engines.yaml": "vllm",
        "hpa-router.yaml": "switchyard-router",
    }
    for name, deployment in targets.items():
        doc = one(name)
        ref = doc["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
            "apps/v1",
            "Deployment",
            deployment,
        )
        assert doc["metadata"]["namespace"] == deployments[deployment]["metadata"]["namespace"]


def test_engines_scale_on_the_model_the_engines_serve() -> None:
    template = _deployments("base")["vllm"]["spec"]["template"]
    assert template["metadata"]["annotations"]["switchyard.io/models"] == SHIPPED_MODEL
    keda = [e for e in autoscaler_expressions() if e.kind == "keda"]
    assert keda and all(f'model="{SHIPPED_MODEL}"' in e.expr for e in keda)
    for metric in one("hpa-engines.yaml")["spec"]["metrics"]:
        assert metric["external"]["metric"]["selector"]["matchLabels"]["model"] == SHIPPED_MODEL


def test_the_router_hpa_needs_the_cpu_request_the_router_pods_make() -> None:
    router = _deployments("base")["switchyard-router"]["spec"]["template"]["spec"]
    assert router["containers"][0]["resources"]["requests"]["cpu"]
    pdb = find(manifests("base"), "PodDisruptionBudget", "switchyard-router")
    assert one("hpa-router.yaml")["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]


def _adapter() -> dict[str, Any]:
    adapter = yaml.safe_load((AUTOSCALING / "prometheus-adapter.yaml").read_text())
    assert set(adapter) == {"rules", "externalRules"}
    for rule in adapter["rules"] + adapter["externalRules"]:
        # the fields of prometheus-adapter's rule (docs/config.md)
        assert set(rule) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
        assert set(rule["name"]) <= {"matches", "as"}
        assert set(rule["resources"]) <= {"overrides", "template", "namespaced"}
        assert (
            "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        )
    return adapter


def test_every_hpa_metric_is_served_by_an_adapter_rule() -> None:
    adapter = _adapter()
    external = {r["name"]["as"] for r in adapter["externalRules"]}
    pods = {r["name"]["as"] for r in adapter["rules"]}
    for name in ("hpa-engines.yaml", "hpa-router.yaml"):
        for metric in one(name)["spec"]["metrics"]:
            if metric["type"] == "External":
                assert metric["external"]["metric"]["name"] in external
            elif metric["type"] == "Pods":
                assert metric["pods"]["metric"]["name"] in pods


def test_external_rules_read_recording_rules_without_a_namespace() -> None:
    for rule in _adapter()["externalRules"]:
        series = re.fullmatch(r'\{__name__="([^"]+)"\}', rule["seriesQuery"])
        assert series is not None and series.group(1) in recorded()
        assert re.fullmatch(rule["name"]["matches"], series.group(1))
        assert rule["resources"] == {"namespaced": False}


def test_keda_triggers_read_recording_rules() -> None:
    for trigger in one("keda-engines.yaml")["spec"]["triggers"]:
        names = set(re.findall(r"switchyard:[a-z0-9_:]+", trigger["metadata"]["query"]))
        assert names and names <= recorded(), trigger["name"]


def test_the_pods_rule_reads_the_routers_request_counter() -> None:
    (rule,) = _adapter()["rules"]
    assert rule["seriesQuery"].startswith("switchyard_router_requests_total{")
    assert re.fullmatch(rule["name"]["matches"], "switchyard_router_requests_total")
    assert "rate(" in rule["metricsQuery"]
