"""Worker specs as written in flags, files and the admin API."""

from __future__ import annotations

import pytest

from switchyard.balancer.worker import MAX_DP_SIZE, Role, WorkerSpec


def test_plain_url_is_a_unified_single_rank_worker_without_trailing_slash() -> None:
    spec = WorkerSpec.parse("http://10.0.0.1:8000/")
    assert spec.url == "http://10.0.0.1:8000"
    assert (spec.role, spec.dp_size, spec.dp_mode, spec.models) == (Role.UNIFIED, 1, "header", [])


def test_options_after_semicolons_fill_the_spec() -> None:
    spec = WorkerSpec.parse(
        "http://h:8000;role=prefill;dp=4;kv=tcp://h:5557;models=a,b;flavor=sglang;bootstrap=8998"
    )
    assert spec.role is Role.PREFILL and spec.dp_size == 4
    assert spec.kv_events == "tcp://h:5557" and spec.models == ["a", "b"]
    assert spec.flavor == "sglang" and spec.bootstrap_port == 8998


def test_rank_urls_switch_to_urls_mode_and_set_dp_size() -> None:
    spec = WorkerSpec.parse("http://h:8000;ranks=http://h:8000|http://h:8001/")
    assert spec.dp_mode == "urls" and spec.dp_size == 2
    assert spec.rank_urls == ["http://h:8000", "http://h:8001"]


def test_mapping_form_ignores_unknown_keys() -> None:
    spec = WorkerSpec.from_any({"url": "h:9", "role": "decode", "comment": "rack 3"})
    assert spec.url == "http://h:9" and spec.role is Role.DECODE


@pytest.mark.parametrize(
    "text",
    ["http://h:1;colour=red", "http://h:1;dp=0", "http://h:1;flavor=trt", "http://h:1;role=x"],
)
def test_bad_specs_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        WorkerSpec.parse(text)


def test_a_dp_size_beyond_the_bound_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(ValueError, match="dp_size"):
        WorkerSpec.parse(f"http://h:8000;dp={MAX_DP_SIZE + 1}")


def test_a_bootstrap_port_outside_tcp_range_is_refused() -> None:
    with pytest.raises(ValueError, match="bootstrap_port"):
        WorkerSpec.parse("http://h:8000;bootstrap=70000")
