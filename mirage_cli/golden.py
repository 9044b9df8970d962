"""Golden files: `python -m mirage_cli.golden` (the `make golden` target) refreshes them.

Two kinds, both checked by the tests (which fail on any difference):
- per example: for every ``examples/**/*.mir``, ``golden/<same path>.ugraph.json``
  (what ``mirage parse`` writes) and ``golden/<same path>.mir`` (what ``mirage fmt``
  prints: the canonical form with the example's comments);
- bad inputs: for every case of ``tests/bad_inputs`` (see ``cases.txt`` there), the
  exact stderr of the command line in ``<case>.stderr``.

Paths are relative to the repository root, which must be the working directory.
Review the diff of a refresh before committing it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path("examples")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
GOLDEN = Path("golden")
BAD_INPUTS = Path("tests/bad_inputs")


@dataclass(frozen=True)
class Case:
    """One bad-input case: its name and the `mirage` arguments that must fail."""

    name: str
    args: tuple[str, ...]

    @property
    def golden(self) -> Path:
        return BAD_INPUTS / f"{self.name}.stderr"


def bad_input_cases(root: Path = BAD_INPUTS) -> list[Case]:
    """The default case of each input file, overridden/extended by ``cases.txt``."""
    cases: dict[str, tuple[str, ...]] = {}
    for p in sorted(root.iterdir()):
        if p.suffix == ".mir":
            cases[p.stem] = ("parse", str(BAD_INPUTS / p.name))
        elif p.suffix == ".json":
            name = p.name.removesuffix(".json").removesuffix(".ugraph")
            cases[name] = ("fmt", str(BAD_INPUTS / p.name))
    listing = root / "cases.txt"
    if listing.exists():
        for line in listing.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, args = line.partition(":")
                cases[name.strip()] = tuple(shlex.split(args))
    return [Case(n, a) for n, a in sorted(cases.items())]


def run_cli(args: tuple[str, ...]) -> tuple[int, str, str]:
    """Run `mirage ARGS` in-process; returns (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from mirage_cli.cli import main

    result = CliRunner().invoke(main, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})
    # The console is set up once per process (FORCE_COLOR may be set): compare text only.
    return result.exit_code, result.stdout, _ANSI.sub("", result.stderr)


def example_files(root: Path = EXAMPLES) -> list[Path]:
    return sorted(root.rglob("*.mir"))


def example_goldens(example: Path) -> dict[Path, str]:
    """The golden files of one example and their expected text."""
    from mirage_cli import serialize
    from mirage_cli.codegen.emit import emit
    from mirage_cli.codegen.lower import lower
    from mirage_cli.comments import format_source
    from mirage_cli.parser import parse_text

    text = example.read_text(encoding="utf-8")
    g = parse_text(text, str(example))
    base = GOLDEN / example.relative_to(EXAMPLES)
    cu, h = emit(lower(g))  # what `mirage codegen` writes
    plans = [k.plan for k in lower(g).kernels if k.plan is not None]  # `mirage plan --json`
    extra = {base.with_suffix(".plan.json"): json.dumps(plans, indent=2, sort_keys=True) + "\n"}
    return {**(extra if plans else {}), base.with_suffix(".ugraph.json"): serialize.dumps(g),
            base.with_suffix(".mir"): format_source(text, str(example)),
            base.with_suffix(".cu"): cu, base.with_suffix(".h"): h}


def refresh() -> int:
    from mirage_cli.util import write_atomic

    changed = 0
    wanted: dict[Path, str] = {}
    for ex in example_files():
        wanted.update(example_goldens(ex))
    for case in bad_input_cases():
        code, _, err = run_cli(case.args)
        if code != 2:
            print(f"warning: case {case.name} exited {code}, not 2")
        wanted[case.golden] = err
    for path, text in wanted.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_atomic(path, text)
            print(f"updated {path}")
            changed += 1
    print(f"{len(wanted)} golden files, {changed} updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(refresh())
