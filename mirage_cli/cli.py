"""The `mirage` command line: one click group, one module per command.

Conventions (DESIGN.md §6): data to stdout, diagnostics and progress to stderr through
rich; exit 0 success, 1 a negative answer, 2 bad input or usage (a located
diagnostic, never a traceback), 3 internal error (traceback only with ``--debug``).
Commands live in :mod:`mirage_cli.commands`; each module defines one click command
and is listed in ``COMMANDS`` below.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from mirage_cli import __version__
from mirage_cli.commands.common import verbosity_params
from mirage_cli.console import console, set_verbosity
from mirage_cli.diagnostics import MirageError

# Module name in mirage_cli.commands -> command name.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("parse", "parse"),
    ("fmt", "fmt"),
    ("run", "run"),
    ("import_mirage", "import-mirage"),
    ("verify", "verify"),
    ("plan", "plan"),
    ("codegen", "codegen"),
    ("compile", "compile"),
    ("bench", "bench"),
    ("search", "search"),
    ("opt", "opt"),
)


class MirageGroup(click.Group):
    """Turns MirageError into exit 2 and anything unexpected into exit 3."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MirageError as e:
            console.quiet = False  # -q hides progress, never errors
            console.print(e.render(), style="red", markup=False, highlight=False, soft_wrap=True)
            sys.exit(2)
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            console.print("interrupted", style="red")
            sys.exit(130)
        except Exception as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            console.quiet = False
            console.print(f"internal error: {type(e).__name__}: {e}\n"
                          f"(run with --debug for a traceback)", style="red", markup=False)
            sys.exit(3)


@click.group(cls=MirageGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mirage")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.option("-v", "--verbose", count=True, help="More detail on stderr.")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
@click.pass_context
def main(ctx: click.Context, quiet: bool, verbose: int, debug: bool) -> None:
    """mirage: a superoptimizer for tensor programs on NVIDIA GPUs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    set_verbosity(-1 if quiet else verbose)


for _module, _name in COMMANDS:
    _cmd = importlib.import_module(f"mirage_cli.commands.{_module}").command
    if not any("-q" in getattr(p, "opts", ()) for p in _cmd.params):
        _cmd.params.extend(verbosity_params())  # -q/-v after the subcommand too
    main.add_command(_cmd, _name)
