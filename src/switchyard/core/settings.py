"""Layered service settings: flags over environment over YAML file over defaults.

Every service (router, balancer, kvstore, mock) has one pydantic-settings model
that subclasses :class:`ServiceSettings`; ``load`` is the one way to build it, and
``switchyard.core.cliopts`` turns its fields into the service's command-line flags.

Durations and sizes carry their unit in the name (``_s``, ``_ms``, ``_us``, ``_bytes``).
A renamed setting keeps its old name for one release through
``validation_alias=AliasChoices(new, old)``: the old name still works as a YAML key,
an environment variable (with the service's prefix) and a flag.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

log = logging.getLogger("switchyard.core.settings")

_yaml_data: ContextVar[dict[str, Any] | None] = ContextVar("_yaml_data", default=None)

S = TypeVar("S", bound="ServiceSettings")

# A YAML file naming any of these is sectioned; a flat file configures one service.
SECTIONS = frozenset({"router", "balancer", "kvstore", "mock", "loadtest", "demo"})


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the section of the YAML file that belongs to the service being loaded."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _yaml_data.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get() or {})


class _Canonical(PydanticBaseSettingsSource):
    """Wraps a source so a value given under a field's old name lands on the field's name.

    Sources are merged key by key before validation; without this an old-named key from
    a lower source (YAML ``redis``) would survive next to the new name from a higher one
    (env ``..._REDIS_URL``) and whichever alias pydantic tried first would win.
    """

    def __init__(self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self._inner = inner
        self._names = old_names(settings_cls)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self._inner().items():
            name = self._names.get(key.lower(), key)
            if name != key:
                _renamed(key, name)
            if name == key or name not in out:
                out[name] = value
        return out


def _renamed(old: str, new: str) -> None:
    log.warning("%s is now called %s; the old name is read until the next release", old, new)


def old_names(model: type[BaseSettings]) -> dict[str, str]:
    """Old (aliased) name -> field name, for every renamed field of ``model``."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            for choice in field.validation_alias.choices:
                if isinstance(choice, str) and choice != name:
                    out[choice.lower()] = name
    return out


class ServiceSettings(BaseSettings):
    """Base for each service's settings; ``section`` names its key in a shared YAML file.

    ``env_prefix_target="all"`` puts the service prefix on old names too, so a renamed
    field reads ``SWITCHYARD_ROUTER_REDIS`` and never a bare ``REDIS`` variable.
    """

    section: ClassVar[str] = ""
    model_config = SettingsConfigDict(
        extra="ignore", env_nested_delimiter="__", env_prefix_target="all"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            _Canonical(settings_cls, init_settings),
            _Canonical(settings_cls, env_settings),
            _Canonical(settings_cls, _YamlSource(settings_cls)),
        )

    @classmethod
    def load(cls: type[S], config_file: str | Path | None = None, **flags: Any) -> S:
        """Build settings; flags that are ``None`` (or empty lists) are treated as unset."""
        data: dict[str, Any] = {}
        if config_file:
            raw = yaml.safe_load(Path(config_file).read_text()) or {}
            if not isinstance(raw, dict):
                raise ValueError(f"{config_file}: top level must be a mapping")
            section: Any = raw
            if cls.section and (cls.section in raw or set(raw) & SECTIONS):
                section = raw.get(cls.section) or {}
            data = section if isinstance(section, dict) else {}
        given = {k: v for k, v in flags.items() if v is not None and v != [] and v != ()}
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        for old, new in old_names(cls).items():
            if prefix + old.upper() in os.environ:
                _renamed(prefix + old.upper(), prefix + new.upper())
        token = _yaml_data.set(data)
        try:
            return cls(**given)
        finally:
            _yaml_data.reset(token)
