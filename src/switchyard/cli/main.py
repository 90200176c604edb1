"""The one ``switchyard`` command; each package adds its own subcommands.

The services' commands (router, balancer, kvstore, mock) are generated from their
settings models (``switchyard.core.cliopts``); the tools (bench, demo, mock-fleet,
simulate, plan) are plain click commands. Help is click help, which wraps at any width
instead of truncating option names, and every usage error is one line on stderr, exit 2.
``switchyard --version`` prints the installed version.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from switchyard.balancer.cli import command as balancer_command
from switchyard.cli.doctor import command as doctor_command
from switchyard.core.version import version
from switchyard.kvstore.cli import command as kvstore_command
from switchyard.loadtest.cli import bench_group, demo_command
from switchyard.loadtest.simcli import plan_command, simulate_command
from switchyard.mock.cli import command as mock_command
from switchyard.mock.cli import fleet_command
from switchyard.router.cli import command as router_command

HELP = "Switchyard: router, DP balancer, KV metadata store and mock engines for LLM fleets."


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"switchyard {version()}")
        ctx.exit(0)


def cli() -> click.Group:
    """The whole command tree."""
    show_version = click.Option(
        ["--version"],
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_print_version,
        help="Print the installed version and exit.",
    )
    group = click.Group("switchyard", help=HELP, no_args_is_help=True, params=[show_version])
    for command in (router_command(), mock_command(), balancer_command(), kvstore_command()):
        group.add_command(command)
    group.add_command(doctor_command())
    for tool in (fleet_command, bench_group, demo_command, simulate_command, plan_command):
        group.add_command(tool)
    return group


def run(argv: Sequence[str] | None = None) -> int:
    """Run one invocation; a usage error prints one line on stderr and returns 2."""
    group = cli()
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        code = group.main(
            args=args,
            prog_name="switchyard",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else HELP)
        return 0
    except click.ClickException as exc:
        sub = _sub(exc, group, args)
        where = f"switchyard {sub}" if sub else "switchyard"
        click.echo(f"{where}: {' '.join(exc.format_message().split())}", err=True)
        return 2 if isinstance(exc, click.UsageError) else exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("switchyard: aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


def _sub(exc: click.ClickException, group: click.Group, args: list[str]) -> str | None:
    """The subcommand an error belongs to, ``bench run`` for a nested one. Usage errors and
    ``CliError`` carry a context; an option's missing value does not, so the command
    named first stands in for it."""
    ctx: click.Context | None = getattr(exc, "ctx", None)
    if ctx is None:
        return args[0] if args and args[0] in group.commands else None
    if ctx.parent is None:
        return None
    return ctx.command_path.partition(" ")[2] or None


def main() -> None:
    sys.exit(run())
