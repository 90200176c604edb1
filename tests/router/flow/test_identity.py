"""Who a request is: priority from ``x-priority`` (or smg's ``x-smg-priority``), clamped per
tenant; the deadline; the tenant from the key or a trusted header."""

from __future__ import annotations

import pytest

from switchyard.router.flow.identity import (
    DEFAULT_TENANT,
    PRIORITY_NAMES,
    Identity,
    clamp_priority,
    parse_deadline_ms,
    parse_priority,
    resolve_tenant,
)


def test_no_header_is_normal() -> None:
    assert parse_priority(None) == PRIORITY_NAMES["normal"] == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("high", 1), ("normal", 0), ("low", -1), ("HIGH", 1), ("  Low ", -1)],
)
def test_priority_names_are_case_insensitive_and_trimmed(value: str, expected: int) -> None:
    assert parse_priority(value) == expected


@pytest.mark.parametrize(("value", "expected"), [("3", 3), ("-5", -5), ("+2", 2), ("0", 0)])
def test_integer_priorities_are_bands_of_their_own(value: str, expected: int) -> None:
    assert parse_priority(value) == expected


@pytest.mark.parametrize("value", ["", "urgent", "1.5", "--1", "0x10", "½", "99999", " - 1"])
def test_a_bad_priority_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="x-priority|out of range"):
        parse_priority(value)


def test_negative_priority_is_sheddable_and_normal_is_not() -> None:
    assert Identity("t", parse_priority("low"), None).sheddable
    assert Identity("t", -5, None).sheddable
    assert not Identity("t", parse_priority("normal"), None).sheddable
    assert not Identity("t", 3, 250.0).sheddable


@pytest.mark.parametrize(
    ("smg", "expected"),
    [("system", 1), ("interactive", 1), ("Default", 0), ("BULK", -1), (" bulk ", -1)],
)
def test_smg_classes_map_onto_our_bands_no_higher_than_high(smg: str, expected: int) -> None:
    assert parse_priority(None, smg=smg) == expected


def test_smg_alias_also_takes_our_names_and_integers() -> None:
    assert parse_priority(None, smg="low") == -1
    assert parse_priority(None, smg="-3") == -3


def test_an_unknown_smg_class_degrades_to_normal_as_smg_does() -> None:
    assert parse_priority(None, smg="premium") == 0
    assert parse_priority(None, smg="") == 0


def test_x_priority_wins_over_the_smg_alias() -> None:
    assert parse_priority("low", smg="system") == -1
    with pytest.raises(ValueError):
        parse_priority("nonsense", smg="system")


def test_clamp_lowers_to_the_tenants_ceiling_and_never_raises() -> None:
    ceilings = {"batch": -1, "gold": 5}
    assert clamp_priority(1, "batch", ceilings) == -1
    assert clamp_priority(-3, "batch", ceilings) == -3
    assert clamp_priority(4, "gold", ceilings) == 4
    assert clamp_priority(9, "gold", ceilings) == 5
    assert clamp_priority(-1, "gold", ceilings) == -1


def test_a_tenant_not_named_gets_the_star_ceiling_else_high() -> None:
    assert clamp_priority(7, "anyone", {}) == PRIORITY_NAMES["high"]
    assert clamp_priority(7, "anyone", {"*": 0}) == 0
    assert clamp_priority(7, "anyone", {}, default=10) == 7
    assert clamp_priority(7, "gold", {"*": 0, "gold": 3}) == 3


def test_deadline_is_milliseconds_or_none() -> None:
    assert parse_deadline_ms(None) is None
    assert parse_deadline_ms("250") == 250.0
    assert parse_deadline_ms(" 1.5 ") == 1.5


@pytest.mark.parametrize("value", ["soon", "0", "-10", "nan", "inf", ""])
def test_a_bad_deadline_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="x-slo-ttft-ms"):
        parse_deadline_ms(value)


def test_tenant_comes_from_the_key_else_default() -> None:
    assert resolve_tenant("acme", {}) == "acme"
    assert resolve_tenant(None, {}) == DEFAULT_TENANT == "default"


def test_a_tenant_header_is_ignored_unless_configured() -> None:
    headers = {"x-tenant": "mallory", "x-llm-d-inference-fairness-id": "mallory"}
    assert resolve_tenant("acme", headers) == "acme"


def test_the_configured_tenant_header_names_the_tenant() -> None:
    assert resolve_tenant("acme", {"x-tenant": "blue"}, "X-Tenant") == "blue"
    assert resolve_tenant(None, {"x-llm-d-inference-fairness-id": "green"}, "x-tenant") == "green"
    assert resolve_tenant("acme", {"x-tenant": " "}, "x-tenant") == "acme"
    both = {"x-tenant": "blue", "x-llm-d-inference-fairness-id": "green"}
    assert resolve_tenant(None, both, "x-tenant") == "blue"
