"""docs/configuration.md is generated from the settings models and names every option."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from switchyard.cli.main import cli
from switchyard.core.settings import ServiceSettings, env_name
from tools.config_reference import DOC, SERVICES, reference, setting_names


def test_the_reference_is_what_the_models_generate() -> None:
    assert DOC.read_text() == reference(), (
        "docs/configuration.md is out of date: run `python -m tools.config_reference --write`"
    )


@pytest.mark.parametrize(("name", "model"), SERVICES, ids=[name for name, _ in SERVICES])
def test_every_option_of_the_help_is_in_the_reference(
    name: str, model: type[ServiceSettings]
) -> None:
    text = CliRunner().invoke(cli(), [name, "--help"], terminal_width=200).output
    flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text)) - {"--help", "--config"}
    assert len(flags) >= 10
    section = _section(name)
    missing = {flag for flag in flags if f"`{flag}" not in section and f"/ {flag}`" not in section}
    assert not missing, f"switchyard {name} --help options missing from the reference: {missing}"


@pytest.mark.parametrize(("name", "model"), SERVICES, ids=[name for name, _ in SERVICES])
def test_every_setting_is_in_the_reference_with_its_variable(
    name: str, model: type[ServiceSettings]
) -> None:
    section = _section(name)
    for path in setting_names(model):
        assert f"| `{path}` | `{env_name(model, path)}` |" in section, path


def test_hidden_old_flags_are_listed_as_old_names() -> None:
    command = cli().commands["router"]
    hidden = [p for p in command.params if isinstance(p, click.Option) and p.hidden]
    assert hidden
    old_names = _section("router").split("### router: old names")[1]
    for option in hidden:
        assert f"`{option.opts[0]}`" in old_names, option.opts[0]


def test_every_heading_names_real_fields() -> None:
    for _, model in SERVICES:
        for heading, names in model.headings.items():
            assert set(names) <= set(model.model_fields), heading


def _section(name: str) -> str:
    """The part of the reference about ``switchyard NAME``."""
    text = DOC.read_text()
    start = text.index(f"## `switchyard {name}`")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]
