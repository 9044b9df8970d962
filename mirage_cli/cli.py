"""The `mirage` command line: one click group, one module per command.

Conventions (DESIGN.md §6): data to stdout, diagnostics and progress to stderr through
rich; exit 0 success, 1 a negative answer, 2 bad input or usage (a located
diagnostic, never a traceback), 3 internal error (traceback only with ``--debug``).
Commands live in :mod:`mirage_cli.commands`; each module defines one click command
and is listed in ``COMMANDS`` below.
"""

from __future__ import annotations

import _thread
import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import click

from mirage_cli import __version__
from mirage_cli.commands.common import verbosity_params
from mirage_cli.console import console, set_verbosity
from mirage_cli.diagnostics import MirageError
from mirage_cli.sourcefile import attach_source

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
    ("explain", "explain"),
    ("tune", "tune"),
    ("calibrate", "calibrate"),
)


class MirageGroup(click.Group):
    """Turns MirageError into exit 2, Ctrl-C into exit 130 and anything unexpected
    into exit 3; a standard output that cannot be written (``> /dev/full``, a closed
    pipe) is exit 2 with one line on stderr, never a traceback at interpreter exit."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                with interrupts_survive_finalizers():
                    return super().main(*args, **kwargs)
            finally:
                sys.stdout.flush()  # the data goes out now, while errors can be reported
        except KeyboardInterrupt:
            _interrupted()
        except OSError as e:
            _stdout_failed(e)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MirageError as e:
            console.quiet = False  # -q hides progress, never errors
            attach_source(e)
            console.print(e.render(), style="red", markup=False, highlight=False, soft_wrap=True)
            sys.exit(2)
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            _interrupted()
        except Exception as e:
            if _is_interrupt(e):
                _interrupted()
            if isinstance(e, OSError) and _is_write_error(e):
                _stdout_failed(e)
            if ctx.obj and ctx.obj.get("debug"):
                raise
            console.quiet = False
            console.print(f"internal error: {type(e).__name__}: {e}\n"
                          f"(run with --debug for a traceback)", style="red", markup=False)
            sys.exit(3)


@contextlib.contextmanager
def interrupts_survive_finalizers() -> Iterator[None]:
    """Ctrl-C that lands while a finalizer runs (Z3's ``AstRef.__del__`` during the
    search) is raised there and ignored by Python ("Exception ignored in ..."): the
    command would go on to the end of its budget. Such an interrupt is delivered again
    to the main thread, where it stops the command as any other: by a timer thread a
    moment later, once the hook has returned (raised within the hook, it would be
    ignored too; should it land in a finalizer again, this repeats)."""
    default = sys.unraisablehook

    def hook(u: Any) -> None:
        if isinstance(u.exc_value, KeyboardInterrupt):
            timer = threading.Timer(0.05, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
        else:
            default(u)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:  # not once interrupted: see _interrupted
            sys.unraisablehook = default


def _is_write_error(e: OSError) -> bool:
    """A failed write of the output (a full disk or device, a closed pipe): the
    environment, not a bug. Errors naming a file are reported where they occur."""
    import errno

    return e.errno in (errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EDQUOT) and \
        not e.filename


def _is_interrupt(e: Exception) -> bool:
    """Ctrl-C inside the conversion of a ctypes call's arguments (Z3's and the CUDA
    bindings' calls): ctypes reports it as ``ArgumentError: argument N:
    KeyboardInterrupt``, not as the KeyboardInterrupt it is."""
    import ctypes

    return isinstance(e, ctypes.ArgumentError) and "KeyboardInterrupt" in str(e)


def _interrupted() -> None:
    """Ctrl-C: exit 130 (128 + SIGINT), as a shell reports a process it interrupted.
    Outputs are written atomically at the very end of each command, so none is left.

    From here on, errors raised in finalizers are dropped: they are the interrupt's
    aftermath, not news. A Ctrl-C that lands inside a constructor (a Z3 sort's
    ``__init__``) leaves a half-built object whose ``__del__`` fails when it is
    collected at exit, and that traceback must not follow the word "interrupted"."""
    sys.unraisablehook = _after_interrupt
    console.print("interrupted", style="red")
    sys.exit(130)


def _after_interrupt(u: Any) -> None:
    """The unraisable hook once a command is interrupted: says nothing."""


def _stdout_failed(e: OSError) -> None:
    # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    console.quiet = False
    console.print(f"error: cannot write the output: {e.strerror or e}", style="red",
                  markup=False)
    sys.exit(2)


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


def _add_commands() -> None:
    try:
        for module, name in COMMANDS:
            cmd = importlib.import_module(f"mirage_cli.commands.{module}").command
            if not any("-q" in getattr(p, "opts", ()) for p in cmd.params):
                cmd.params.extend(verbosity_params())  # -q/-v after the subcommand too
            main.add_command(cmd, name)
    except KeyboardInterrupt:  # Ctrl-C while starting up: the same exit as later
        _interrupted()


_add_commands()
