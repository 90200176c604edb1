"""Layered service settings: flags over environment over YAML file over defaults.

Every service (router, balancer, kvstore, mock) has one pydantic-settings model
that subclasses :class:`ServiceSettings`; ``load`` is the one way to build it.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

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


class ServiceSettings(BaseSettings):
    """Base for each service's settings; ``section`` names its key in a shared YAML file."""

    section: ClassVar[str] = ""
    model_config = SettingsConfigDict(extra="ignore", env_nested_delimiter="__")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

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
        token = _yaml_data.set(data)
        try:
            return cls(**given)
        finally:
            _yaml_data.reset(token)
