"""Layered service settings: flags over environment over YAML file over defaults.

Every service (router, balancer, kvstore, mock) has one pydantic-settings model
that subclasses :class:`ServiceSettings`; ``load`` is the one way to build it, and
``switchyard.core.cliopts`` turns its fields into the service's command-line flags.

Related settings are grouped as a nested :class:`Group` (the router's ``timeouts``,
``limits``, ``retry`` ...), the way httpx passes ``Timeout`` and ``Limits`` as whole
objects: YAML takes ``router: {timeouts: {connect_s: 5}}``, the environment
``SWITCHYARD_ROUTER_TIMEOUTS__CONNECT_S`` and the command line ``--timeouts-connect-s``.

Durations and sizes carry their unit in the name (``_s``, ``_ms``, ``_us``, ``_bytes``).
A renamed setting keeps its old name for one release, with a one-line warning: through
``validation_alias=AliasChoices(new, old)`` when it kept its place, through the model's
``moved`` map (old flat name -> new dotted path) when it moved into a group. Either way
the old name still works as a YAML key, an environment variable and a flag.
"""

from __future__ import annotations

import json
import logging
import os
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import AliasChoices, BaseModel
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

# ``Field(json_schema_extra=NO_FLAG)``: settable through YAML and the environment only,
# so ``--help`` keeps to the knobs an operator reaches for.
NO_FLAG: dict[str, Any] = {"flag": False}


class Group(BaseModel):
    """A group of related settings, passed around as one value with a readable repr."""

    # The heading of this group in ``--help`` and in docs/configuration.md.
    heading: ClassVar[str] = ""


def group_of(annotation: Any) -> type[BaseModel] | None:
    """The nested settings model an annotation holds (``X`` or ``X | None``), if any."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def on_command_line(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("flag") is False)


def field_at(model: type[BaseModel], path: str) -> FieldInfo:
    """The field a dotted path (``timeouts.connect_s``) names."""
    *parents, leaf = path.split(".")
    for name in parents:
        sub = group_of(model.model_fields[name].annotation)
        if sub is None:
            raise KeyError(path)
        model = sub
    return model.model_fields[leaf]


def renamed(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[str, str]:
    """Old dotted name -> new dotted name, for every setting of ``model`` that was renamed."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            for choice in field.validation_alias.choices:
                if isinstance(choice, str) and choice != name:
                    out[".".join((*prefix, choice))] = ".".join((*prefix, name))
        sub = group_of(field.annotation)
        if sub is not None:
            out.update(renamed(sub, (*prefix, name)))
    moved: Mapping[str, str] = getattr(model, "moved", {})
    out.update({".".join((*prefix, old)): ".".join((*prefix, new)) for old, new in moved.items()})
    return out


def env_name(model: type[BaseSettings], path: str) -> str:
    """The environment variable of a dotted setting name."""
    prefix = str(model.model_config.get("env_prefix", ""))
    return (prefix + path.replace(".", "__")).upper()


def deprecated(old: str, new: str) -> None:
    """The one-line warning every old name gets, wherever it was given."""
    log.warning("%s is deprecated; use %s", old, new)


def relocate(
    data: dict[str, Any],
    renames: Mapping[str, str],
    warn: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """``data`` with each value under an old name moved to its new name (which wins if both
    are given), calling ``warn(old, new)`` once per old name found."""
    out = dict(data)
    for old, new in renames.items():
        value, found = _pop(out, old.split("."))
        if not found:
            continue
        if warn is not None:
            warn(old, new)
        _put(out, new.split("."), value)
    return out


def _pop(data: dict[str, Any], path: list[str]) -> tuple[Any, bool]:
    node: Any = data
    for name in path[:-1]:
        node = node.get(name) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, False
    for key in list(node):
        if key.lower() == path[-1]:
            return node.pop(key), True
    return None, False


def _put(data: dict[str, Any], path: list[str], value: Any) -> None:
    """Set unless already set; copies the dicts it walks through, never the caller's."""
    node = data
    for name in path[:-1]:
        child = node.get(name)
        if child is None:
            child = {}
        elif isinstance(child, dict):
            child = dict(child)
        else:
            return  # a whole group given as a value: the new name wins
        node[name] = child
        node = child
    node.setdefault(path[-1], value)


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the section of the YAML file that belongs to the service being loaded."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _yaml_data.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get() or {})


class _Canonical(PydanticBaseSettingsSource):
    """Wraps a source so a value given under a setting's old name lands on its new name.

    Sources are merged key by key before validation; without this an old-named key from
    a lower source (YAML ``redis``) would survive next to the new name from a higher one
    (env ``..._REDIS_URL``) and whichever alias pydantic tried first would win.
    """

    def __init__(
        self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource, kind: str
    ):
        super().__init__(settings_cls)
        self._inner = inner
        self._kind = kind
        self._renames = renamed(settings_cls)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        data = self._inner()
        if self._kind == "env":
            # Warned here, where the variable's name is known; pydantic-settings hands
            # the old names it reads (aliases) on under the field's name or the alias.
            return relocate({**self._old_env(), **data}, self._renames)
        return relocate(data, self._renames, self._warn)

    def _warn(self, old: str, new: str) -> None:
        section = getattr(self.settings_cls, "section", "")
        if self._kind == "yaml" and section:
            deprecated(f"YAML key {section}.{old}", f"{section}.{new}")
        else:
            deprecated(old, new)

    def _old_env(self) -> dict[str, Any]:
        """Old variables that are set, each warned about; the values of moved settings,
        which pydantic-settings knows no field for."""
        environ = {k.upper(): v for k, v in os.environ.items()}
        moved: Mapping[str, str] = getattr(self.settings_cls, "moved", {})
        out: dict[str, Any] = {}
        for old, new in self._renames.items():
            name = env_name(self.settings_cls, old)
            if name not in environ:
                continue
            deprecated(name, env_name(self.settings_cls, new))
            if old not in moved:
                continue
            value: Any = environ[name]
            if _complex(field_at(self.settings_cls, new).annotation):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{name} is not valid JSON: {exc}") from None
            out[old] = value
        return out


def _complex(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_complex(a) for a in get_args(annotation) if a is not type(None))
    return origin in (list, dict) or annotation in (list, dict)


class ServiceSettings(BaseSettings):
    """Base for each service's settings; ``section`` names its key in a shared YAML file.

    ``env_prefix_target="all"`` puts the service prefix on old names too, so a renamed
    field reads ``SWITCHYARD_ROUTER_REDIS`` and never a bare ``REDIS`` variable.
    """

    section: ClassVar[str] = ""
    # Settings that moved into a group: old flat name -> new dotted name, for one release.
    moved: ClassVar[Mapping[str, str]] = {}
    # Headings of ``--help`` and docs/configuration.md for top-level fields; fields not
    # listed fall under the first heading, groups under their own.
    headings: ClassVar[Mapping[str, tuple[str, ...]]] = {}
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
            _Canonical(settings_cls, init_settings, "init"),
            _Canonical(settings_cls, env_settings, "env"),
            _Canonical(settings_cls, _YamlSource(settings_cls), "yaml"),
        )

    @classmethod
    def heading_of(cls, name: str) -> str:
        """The ``--help`` heading a top-level field belongs under."""
        sub = group_of(cls.model_fields[name].annotation)
        if sub is not None and issubclass(sub, Group) and sub.heading:
            return sub.heading
        for heading, names in cls.headings.items():
            if name in names:
                return heading
        return next(iter(cls.headings), "Options")

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
