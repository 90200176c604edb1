"""Command-line flags generated from a service's settings model, so each flag is written once.

Every field becomes ``--kebab-name`` with its type, its ``description`` as help and the
model's default shown; list fields repeat, ``dict`` fields take JSON, booleans get a
``--no-`` form, and a nested model (the router's ``pd``) is flattened as ``--pd-protocol``.
A field renamed through ``AliasChoices(new, old)`` keeps a hidden ``--old-name`` flag.
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
from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import SettingsError

from switchyard.core.settings import ServiceSettings

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


def settings_command(
    name: str,
    model: type[S],
    run: Callable[[S, Path | None], None],
    *,
    help: str,
    aliases: Aliases | None = None,
) -> click.Command:
    """A click command whose options are ``model``'s fields; ``run`` gets the loaded settings."""
    options, renamed = _options(model, (), aliases or {})
    config = click.Option(
        ["--config", "config"],
        type=click.Path(dir_okay=False, path_type=Path),
        help=f"YAML config file (its '{model.section}' section, or a flat file).",
    )

    def callback(config: Path | None, **values: Any) -> None:
        for old, new in renamed.items():
            value = values.pop(old, None)
            if value not in (None, ()):
                click.echo(
                    f"switchyard {name}: {_flag(tuple(old.split('__')))} is now "
                    f"{_flag(tuple(new.split('__')))}; the old flag works until the next release",
                    err=True,
                )
                if values.get(new) in (None, ()):
                    values[new] = value
        settings = load_settings(model, config, _nest(values))
        run(settings, config)

    return click.Command(name, params=[config, *options], callback=callback, help=help)


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
    model: type[BaseModel], prefix: tuple[str, ...], aliases: Aliases
) -> tuple[list[click.Option], dict[str, str]]:
    """The options of every field (nested models flattened) and hidden old name -> new name."""
    options: list[click.Option] = []
    renamed: dict[str, str] = {}
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        annotation = _strip_optional(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested, nested_renamed = _options(annotation, path, aliases)
            options += nested
            renamed.update(nested_renamed)
            continue
        dest = "__".join(path)
        names = list(aliases.get(".".join(path), ())) or [_flag(path)]
        options.append(_option(names, dest, annotation, field, hidden=False))
        for old in _old_names(field, name):
            if _flag((*prefix, old)) in names:
                continue
            old_dest = "__".join((*prefix, old))
            options.append(_option([_flag((*prefix, old))], old_dest, annotation, field, True))
            renamed[old_dest] = dest
    return options, renamed


def _option(
    names: list[str], dest: str, annotation: Any, field: FieldInfo, hidden: bool
) -> click.Option:
    multiple = get_origin(annotation) is list
    help_text = field.description or ""
    if multiple and "repeatable" not in help_text:
        help_text += ", repeatable"
    default = _default(field)
    if default is not None:
        help_text += f" [default: {default}]"
    inner = _strip_optional(get_args(annotation)[0]) if multiple else annotation
    if inner is bool and not multiple:
        decls = [f"{n}/--no-{n.removeprefix('--')}" if n.startswith("--") else n for n in names]
        return click.Option([*decls, dest], default=None, help=help_text, hidden=hidden)
    return click.Option(
        [*names, dest],
        type=_click_type(inner),
        multiple=multiple,
        default=None,
        help=help_text,
        hidden=hidden,
    )


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


def _old_names(field: FieldInfo, name: str) -> list[str]:
    alias = field.validation_alias
    if not isinstance(alias, AliasChoices):
        return []
    return [c for c in alias.choices if isinstance(c, str) and c != name]


def _flag(path: tuple[str, ...]) -> str:
    return "--" + "-".join(path).replace("_", "-")


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """``pd__protocol=x`` -> ``{"pd": {"protocol": x}}``, dropping unset flags."""
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
