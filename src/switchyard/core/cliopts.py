"""Command-line flags generated from a service's settings model, so each flag is written once.

Every field becomes ``--kebab-name`` with its type, its ``description`` as help and the
model's default shown; list fields repeat, ``dict`` fields take JSON, booleans get a
``--no-`` form, and a group (the router's ``timeouts``) is flattened as
``--timeouts-connect-s``. ``--help`` lists the options under their group's heading.
Fields marked ``NO_FLAG`` get no flag: they are set through YAML and the environment.
A renamed or moved setting keeps its old flag for one release, hidden from ``--help``,
with a one-line warning naming the new spelling.
Unset flags stay ``None``, so the environment and the YAML file still apply beneath them.

Every mistake on the command line, in the environment or the YAML file ends as
:class:`CliError`: one line on stderr and exit status 2 (see ``switchyard.cli.main``).
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import click
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import SettingsError

from switchyard.core.settings import (
    ServiceSettings,
    env_name,
    field_at,
    group_of,
    on_command_line,
    renamed,
)

S = TypeVar("S", bound=ServiceSettings)

# Flags written in full elsewhere (README, deploy/) get their short spelling here.
Aliases = Mapping[str, Sequence[str]]


class CliError(click.ClickException):
    """A bad invocation: printed as one line, exit status 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.ctx = click.get_current_context(silent=True)


class JsonType(click.ParamType):
    """A JSON object on the command line; a parse error names its position."""

    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"not valid JSON: {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("expected a JSON object", param, ctx)
        return parsed


class SettingOption(click.Option):
    """A flag of one setting: ``setting`` is its dotted name, ``section`` its heading."""

    def __init__(self, decls: list[str], *, setting: str, section: str, **kwargs: Any) -> None:
        super().__init__(decls, **kwargs)
        self.setting = setting
        self.section = section


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists options under their settings' headings."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "section", "Other"), []).append(record)
        for heading, rows in sections.items():
            with formatter.section(heading):
                formatter.write_dl(rows)


def settings_command(
    name: str,
    model: type[S],
    run: Callable[[S, Path | None], None],
    *,
    help: str,
    aliases: Aliases | None = None,
) -> click.Command:
    """A click command whose options are ``model``'s fields; ``run`` gets the loaded settings."""
    options = _options(model, model, (), aliases or {})
    visible = {o for option in options for o in option.opts}
    old_flags = _old_flags(model, visible)
    config = SettingOption(
        ["--config", "config"],
        setting="",
        section=model.heading_of(next(iter(model.model_fields))),
        type=click.Path(dir_okay=False, path_type=Path),
        help=f"YAML config file (its '{model.section}' section, or a flat file).",
    )
    by_setting = {option.setting: option for option in options}

    def callback(config: Path | None, **values: Any) -> None:
        for option, old in old_flags:
            value = values.pop(option.name or "", None)
            if value in (None, ()):
                continue
            dest = option.setting.replace(".", "__")
            new = by_setting.get(option.setting)
            use = new.opts[0] if new is not None else _elsewhere(model, option.setting)
            click.echo(f"warning: {old} is deprecated; use {use}", err=True)
            if values.get(dest) in (None, ()):
                values[dest] = value
        settings = load_settings(model, config, _nest(values))
        run(settings, config)

    params: list[click.Parameter] = [config, *options, *(o for o, _ in old_flags)]
    return SettingsCommand(name, params=params, callback=callback, help=help)


def _elsewhere(model: type[ServiceSettings], setting: str) -> str:
    """Where a setting without a flag is set instead."""
    return f"{model.section}.{setting} in the YAML file or {env_name(model, setting)}"


def load_settings(model: type[S], config: Path | None, flags: dict[str, Any]) -> S:
    """``model.load`` with every way it can fail turned into a one-line :class:`CliError`."""
    if config is not None and not config.is_file():
        raise CliError(f"--config {config}: no such file")
    try:
        return model.load(config, **flags)
    except ValidationError as exc:
        raise CliError(validation_message(exc)) from None
    except SettingsError as exc:
        raise CliError(settings_error_message(model, exc)) from None
    except yaml.YAMLError as exc:
        raise CliError(f"--config {config}: not valid YAML: {_one_line(str(exc))}") from None
    except (OSError, ValueError) as exc:
        raise CliError(_one_line(str(exc))) from None


def validation_message(exc: ValidationError) -> str:
    """The first problem of a settings validation error, as one line naming the setting.

    The rejected value is echoed, except for keys: a bad key list must not land on stderr.
    """
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or exc.title
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    secret = str(first["loc"][-1]).endswith("key") if first["loc"] else False
    shown = "input" in first and first["type"] != "missing" and not secret
    given = f" (got {first['input']!r})" if shown else ""
    return f"invalid setting {where}: {first['msg']}{given}{more}"


def settings_error_message(model: type[ServiceSettings], exc: SettingsError) -> str:
    """pydantic-settings' message (bad JSON in an environment variable) with the variable."""
    match = re.search(r'field "([^"]+)" from source "(\w+)"', str(exc))
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    if match and match.group(2) == "EnvSettingsSource":
        env = str(model.model_config.get("env_prefix", "")) + match.group(1).upper()
        return f"{env} is not valid JSON{cause}"
    return _one_line(f"{exc}{cause}")


def require_tokenizer(path: str | None, setting: str) -> None:
    """Fail before start-up, naming the path, when a tokenizer directory is unusable."""
    if path is None:
        return
    where = Path(path)
    relative = "" if where.is_absolute() else f" (relative to {Path.cwd()})"
    if not where.is_dir():
        raise CliError(f"{setting} {path}: no such directory{relative}; a HF tokenizer dir")
    if not (where / "tokenizer.json").is_file():
        raise CliError(f"{setting} {path}: no tokenizer.json in this directory{relative}")


def _options(
    service: type[ServiceSettings],
    model: type[BaseModel],
    prefix: tuple[str, ...],
    aliases: Aliases,
) -> list[SettingOption]:
    """The options of every field with a flag, groups flattened, in field order."""
    options: list[SettingOption] = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        sub = group_of(field.annotation)
        if sub is not None:
            options += _options(service, sub, path, aliases)
            continue
        if not on_command_line(field):
            continue
        names = list(aliases.get(".".join(path), ())) or [_flag(path)]
        options.append(_option(names, path, field, service.heading_of(path[0]), hidden=False))
    return options


def _old_flags(model: type[ServiceSettings], visible: set[str]) -> list[tuple[SettingOption, str]]:
    """A hidden option per old name whose flag is not still a current flag, and its flag."""
    out: list[tuple[SettingOption, str]] = []
    for old, new in renamed(model).items():
        flag = _flag(tuple(old.split(".")))
        if flag in visible:
            continue
        field = field_at(model, new)
        option = _option([flag], tuple(new.split(".")), field, "", hidden=True)
        option.name = "old__" + "__".join(old.split("."))
        out.append((option, flag))
    return out


def _option(
    names: list[str], path: tuple[str, ...], field: FieldInfo, section: str, hidden: bool
) -> SettingOption:
    annotation = _strip_optional(field.annotation)
    dest = "__".join(path)
    multiple = get_origin(annotation) is list
    help_text = field.description or ""
    if multiple and "repeatable" not in help_text:
        help_text += ", repeatable"
    default = _default(field)
    if default is not None:
        help_text += f" [default: {default}]"
    inner = _strip_optional(get_args(annotation)[0]) if multiple else annotation
    common: dict[str, Any] = {
        "setting": ".".join(path),
        "section": section,
        "default": None,
        "help": help_text,
        "hidden": hidden,
    }
    if inner is bool and not multiple:
        decls = [f"{n}/--no-{n.removeprefix('--')}" if n.startswith("--") else n for n in names]
        return SettingOption([*decls, dest], **common)
    return SettingOption([*names, dest], type=_click_type(inner), multiple=multiple, **common)


def _click_type(annotation: Any) -> click.ParamType:
    if get_origin(annotation) is Literal:
        return click.Choice([str(v) for v in get_args(annotation)])
    if annotation is int:
        return click.INT
    if annotation is float:
        return click.FLOAT
    if annotation is dict or get_origin(annotation) is dict:
        return JsonType()
    return click.STRING


def _default(field: FieldInfo) -> str | None:
    """The model's default as help text; none shown for unset or empty defaults."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return None
    else:
        value = field.default
    if value is None or value == [] or value == {}:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _flag(path: tuple[str, ...]) -> str:
    return "--" + "-".join(path).replace("_", "-")


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """``timeouts__connect_s=x`` -> ``{"timeouts": {"connect_s": x}}``, dropping unset flags."""
    out: dict[str, Any] = {}
    for dest, value in values.items():
        if value is None or value == ():
            continue
        *parents, leaf = dest.split("__")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())
