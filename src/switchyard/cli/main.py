"""The one ``switchyard`` command; each package adds its own subcommands.

The services' commands (router, balancer, kvstore, mock) are generated from their
settings models (``switchyard.core.cliopts``); the tools (bench, demo, mock-fleet) are
typer commands. Help is plain click help, which wraps at any width instead of
truncating option names, and every usage error is one line on stderr, exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click
import typer

from switchyard.balancer.cli import command as balancer_command
from switchyard.cli.doctor import command as doctor_command
from switchyard.core.cliopts import CliError
from switchyard.kvstore.cli import command as kvstore_command
from switchyard.loadtest.cli import register as register_loadtest
from switchyard.loadtest.simcli import register as register_simulate
from switchyard.loadtest.simcli import register_plan
from switchyard.mock.cli import command as mock_command
from switchyard.mock.cli import register as register_mock_fleet
from switchyard.router.cli import command as router_command

HELP = "Switchyard: router, DP balancer, KV metadata store and mock engines for LLM fleets."


def cli() -> click.Group:
    """The whole command tree."""
    group = click.Group("switchyard", help=HELP, no_args_is_help=True)
    for command in (router_command(), mock_command(), balancer_command(), kvstore_command()):
        group.add_command(command)
    group.add_command(doctor_command())
    tools = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)
    register_mock_fleet(tools)
    register_loadtest(tools)
    register_simulate(tools)
    register_plan(tools)
    for name, help_text in TOOLS.items():
        group.add_command(_typer_tool(tools, name, help_text))
    return group


# Commands written with typer (no settings model behind them), handed their arguments as-is.
TOOLS = {
    "mock-fleet": "Run many mock engines (one process or K), print a JSON description.",
    "bench": "Load tests against mock fleets.",
    "demo": "A local stack (router + mock engines) and a short routing comparison.",
    "simulate": "The router's own policies over thousands of simulated engines, no HTTP.",
    "plan": "The fewest simulated engines that meet a TTFT/TPOT objective at a rate.",
}


def _typer_tool(tools: typer.Typer, name: str, help_text: str) -> click.Command:
    """A click command that runs ``switchyard NAME ...`` through the typer app ``tools``."""

    def callback(args: tuple[str, ...]) -> None:
        command = typer.main.get_command(tools)
        try:
            command.main(args=[name, *args], prog_name="switchyard", standalone_mode=False)
        except typer.Exit as exc:
            if exc.exit_code:
                raise click.exceptions.Exit(exc.exit_code) from None
        except typer.TyperException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                click.echo(exc.format_message())
                return
            raise CliError(exc.format_message()) from None

    return click.Command(
        name,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        callback=callback,
        help=help_text,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


def run(argv: Sequence[str] | None = None) -> int:
    """Run one invocation; a usage error prints one line on stderr and returns 2."""
    group = cli()
    try:
        code = group.main(
            args=list(argv) if argv is not None else None,
            prog_name="switchyard",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else HELP)
        return 0
    except click.ClickException as exc:
        where = f"switchyard {_sub(exc)}" if _sub(exc) else "switchyard"
        click.echo(f"{where}: {' '.join(exc.format_message().split())}", err=True)
        return 2 if isinstance(exc, click.UsageError) else exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("switchyard: aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


def _sub(exc: click.ClickException) -> str | None:
    """The subcommand an error belongs to (usage errors and ``CliError`` carry a context)."""
    ctx: click.Context | None = getattr(exc, "ctx", None)
    return ctx.info_name if ctx is not None and ctx.parent is not None else None


def main() -> None:
    sys.exit(run())
