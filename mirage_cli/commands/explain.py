"""`mirage explain FILE [--json]`: why the search chose this µGraph.

FILE is a candidates file (``mirage search -o``: the first candidate is the chosen one,
the others its rivals), a single µGraph (``.best.ugraph.json``), or a ``.mir`` program,
which is searched first (through the result cache, with the default search options)
and whose unfused form is then explained beside the candidates. ``--program`` names
the program of a ``.json`` FILE so its unfused form is shown too.

Prints, per kernel, the cost model's terms, the term that binds and the tight
constraints; the design decisions apart from the tuning values; for each rival the
term that made it lose; and the tie rule. A table on a terminal, plain text when
piped, JSON with ``--json`` (schema: :mod:`mirage_cli.search.explain`).
"""

from __future__ import annotations

import json

import click

from mirage_cli import serialize
from mirage_cli.commands.common import ARCHS, defines_option, parse_defines
from mirage_cli.commands.search import DEFAULT_BUDGET
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph, read_text
from mirage_cli.profiles import target_option
from mirage_cli.search.cost import use_profile
from mirage_cli.search.explain import COLUMNS, entry_lines, explain, kernel_rows, render_text

Json = dict


def load_candidates(path: str, defines: dict[str, int], program: str | None, jobs: int,
                    budget: float) -> tuple[list[tuple[Graph, Json]], Graph | None]:
    """The ranked candidates of FILE and the program they implement (when known)."""
    if path.endswith(".mir"):
        from mirage_cli.search.display import progress_display
        from mirage_cli.search.driver import SearchOptions, cached_search

        prog = load_graph(path, defines)
        with progress_display() as show:
            out = cached_search(prog, SearchOptions(), budget, jobs, True, show)
        return out.candidates, prog
    cands = serialize.loads_candidates(read_text(path), path)
    return cands, None if program is None else load_graph(program, defines)


@click.command("explain")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="The explanation as JSON on stdout.")
@click.option("--program", type=click.Path(dir_okay=False),
              help="The .mir program of a .json FILE (shows its unfused form).")
@defines_option
@click.option("--arch", type=click.Choice(ARCHS),
              default="sm_90", show_default=True, help="Target of the kernel plans.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Search workers (a .mir FILE not in the cache).")
@click.option("--budget", type=click.FloatRange(min=0.1), default=DEFAULT_BUDGET,
              show_default=True,
              help="Search safety stop, seconds (a .mir FILE not in the cache).")
@target_option
def command(file: str, as_json: bool, program: str | None, defines: tuple[str, ...],
            arch: str, jobs: int, budget: float, target: str) -> None:
    """Explain the choice of the first µGraph of FILE over its rivals."""
    use_profile(target)
    if file.endswith(".mir") and _explain_parts(file, parse_defines(defines), as_json):
        return
    cands, prog = load_candidates(file, parse_defines(defines), program, jobs, budget)
    doc = explain(cands, prog, arch)
    layer = cands[0][1].get("layer") if cands else None
    if layer is not None:  # a whole layer (mirage opt): its parts, and why they end there
        doc["layer"] = layer
    carried = _carried(cands[0][1]) if cands else None
    if carried is not None:  # a shape reuse's certificate (verifier/carry.py)
        doc["certificate"] = carried
    if as_json:
        click.echo(json.dumps(doc, indent=1, sort_keys=True))
        return
    if layer is not None:
        from mirage_cli.search.layer import render_parts

        click.echo("\n".join(render_parts(layer)) + "\n")
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        click.echo(render_text(doc), nl=False)
    else:
        _rich(out, doc)
    if carried is not None:
        click.echo(carried["text"])


def _carried(meta: Json) -> Json | None:
    """Where the chosen candidate's certificate was computed, when a shape reuse
    carried it along a pointwise size parameter (``verification.carried``)."""
    ver = meta.get("verification")
    if not isinstance(ver, dict) or not isinstance(ver.get("carried"), dict):
        return None
    how = ver["carried"]
    at = how.get("certified_at") or {}
    cert = ver.get("certificate") or {}
    sizes = ", ".join(f"{k}={v}" for k, v in sorted(at.items()))
    text = (f"certificate: carried along '{how.get('dimension')}' from {how.get('from')} "
            f"to {how.get('to')}: finite-field trials at {sizes} (bound "
            f"{cert.get('bound')}), no trials at these sizes (docs/verification.md §10)")
    return {**how, "text": text}


def _explain_parts(path: str, defines: dict[str, int], as_json: bool) -> bool:
    """A program that ``mirage opt`` cuts into parts (:mod:`mirage_cli.search.layer`):
    the parts and why each ends where it does, without searching them (``mirage opt
    --save-temps DIR`` keeps the searched result, which explain reads from
    ``DIR/NAME.cands.ugraph.json``). False for a program searched whole."""
    from mirage_cli.search.layer import needs_layering, plan_parts, render_parts

    prog = load_graph(path, defines)
    if not needs_layering(prog):
        return False
    doc = {"parts": [p.as_json() for p in plan_parts(prog)]}
    if as_json:
        click.echo(json.dumps({"layer": doc}, indent=1, sort_keys=True))
    else:
        click.echo("\n".join(render_parts(doc)) + "\n")
    return True


def _rich(out: object, doc: Json) -> None:
    """The explanation as rich tables (a terminal)."""
    from rich.console import Console
    from rich.table import Table

    assert isinstance(out, Console)
    entries = [doc["chosen"], *doc["rivals"]] + ([doc["unfused"]] if doc["unfused"] else [])
    for e in entries:
        lines = entry_lines(e)
        t = Table(title=lines[0], title_justify="left", show_edge=False)
        for c in COLUMNS:
            t.add_column(c, justify="right" if c not in ("kind", "binds") else "left")
        for row in kernel_rows(e):
            t.add_row(*row)
        if "loses_on" in e:
            out.print(lines[1].strip(), markup=False, highlight=False, style="yellow")
        out.print(t)
        # After the title, the loss line and the table (its header and one row a kernel).
        rest = lines[(2 if "loses_on" in e else 1) + len(e["kernels"]) + 1:]
        for ln in rest:
            out.print(ln, markup=False, highlight=False)
        out.print()
    out.print(f"tie rule: {doc['tie_rule']}", markup=False)
