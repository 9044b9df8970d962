"""`mirage verify A B`: decide whether two µGraphs compute the same function.

A and B are `.mir` programs, `.ugraph.json` graphs or candidate lists, or Mirage
checkpoints (``--index-a``/``--index-b``, ``--index`` for B). Inputs and outputs are
matched by position. Exit 0 equivalent, 1 not equivalent or undecided, 2 bad input.
The verdict goes to stdout (``--json``: the certificate); progress to stderr.

``-D NAME=VALUE`` applies to each `.mir` operand that declares the parameter NAME;
every NAME must be declared by at least one `.mir` operand (else exit 2). A
`.ugraph.json` or checkpoint operand has fixed sizes and takes no ``-D``: when ``-D``
is given, a note on stderr says which operand it was not applied to.

Before the trials, the memory of both graphs' field and float64 evaluation is
estimated from their shapes (16 bytes per element of every tensor); over
``--max-memory`` the pair is refused with exit 2.
"""

from __future__ import annotations

import io
import json

import click
import numpy as np

from mirage_cli.commands.common import (
    check_graph_memory,
    defines_option,
    max_memory_option,
    parse_defines,
    parse_size,
)
from mirage_cli.console import console, info
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.util import write_atomic
from mirage_cli.verifier.api import DEFAULT_BOUND, Certificate, Verifier

FIELD_BYTES = 16  # per element: residues mod p and mod q (int64 each) in the trials


def _load_pair(paths: tuple[str, str], defines: dict[str, int],
               indexes: tuple[int | None, int | None]) -> tuple[Graph, Graph]:
    """Both operands, with ``-D`` applied per file by the rule of the module docstring."""
    from mirage_cli.loading import (
        display_name,
        graphs_from_text,
        is_program,
        pick,
        read_text,
    )

    graphs: list[Graph] = []
    declared: set[str] = set()
    for path, index in zip(paths, indexes):
        text = read_text(path)  # once: it may be standard input
        program = is_program(path, text)
        if defines and not program:
            info(f"note: -D is not applied to {display_name(path)} (a fixed-size µGraph)")
        g = pick(graphs_from_text(text, path, defines if program else None,
                                  strict_defines=False), path, index)
        if program:
            declared.update(n for n, _ in g.params)
        graphs.append(g)
    unknown = [n for n in defines if n not in declared]
    if unknown:
        raise MirageError(f"-D {unknown[0]}: no .mir operand declares a parameter "
                          f"'{unknown[0]}'")
    return graphs[0], graphs[1]


@click.command("verify")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@defines_option
@click.option("--index-a", type=int, default=None, help="Candidate of A to use.")
@click.option("--index-b", "--index", "index_b", type=int, default=None,
              help="Candidate of B to use.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option("--bound", type=float, default=None,
              help="Largest acceptable probability that a non-equivalent pair passes "
                   "[default: 2^-40].")
@click.option("--trials", type=int, default=None, help="Run exactly this many trials.")
@click.option("--no-float64", is_flag=True, help="Skip the float64 cross-check.")
@click.option("--counterexample", type=click.Path(dir_okay=False), default=None,
              help="On a mismatch, write inputs and both outputs to this .npz file.")
@click.option("--json", "as_json", is_flag=True, help="Print the certificate as JSON.")
@max_memory_option
def command(a: str, b: str, defines: tuple[str, ...], index_a: int | None,
            index_b: int | None, seed: int, bound: float | None, trials: int | None,
            no_float64: bool, counterexample: str | None, as_json: bool,
            max_memory: str | None) -> None:
    """Check that A and B compute the same function (inputs/outputs by position).

    -D applies to each .mir operand that declares the parameter (see the docs)."""
    if bound is not None and trials is not None:
        raise MirageError("give either --bound or --trials, not both")
    if a == "-" and b == "-":
        raise MirageError("only one of A and B can be standard input")
    limit = parse_size(max_memory)
    ga, gb = _load_pair((a, b), parse_defines(defines), (index_a, index_b))
    check_graph_memory([(ga, a), (gb, b)], limit, "verify", FIELD_BYTES)
    info(f"verifying {ga.name} against {gb.name} (seed {seed})")
    v = Verifier(ga, seed=seed, bound=bound if bound is not None else DEFAULT_BOUND,
                 trials=trials)
    with console.status("finite-field trials and float64 cross-check ..."):
        cert = v.certify(gb, crosscheck_float64=not no_float64)
    if counterexample and cert.verdict != "equivalent":
        _write_counterexample(counterexample, v, gb, cert)
    if as_json:
        click.echo(json.dumps(cert.to_json(), indent=2, sort_keys=True))
    else:
        click.echo(render(cert, ga, gb))
    raise SystemExit(cert.exit_code)


def render(cert: Certificate, ga: Graph, gb: Graph) -> str:
    """The human-readable verdict."""
    fv = cert.field_verdict
    lines = [f"{cert.verdict}: {ga.name} vs {gb.name}"]
    if fv.equivalent:
        lines.append(f"  finite field: {fv.trials} trial(s) passed (seed {cert.seed}, "
                     f"{fv.discarded} discarded); P(non-equivalent pair passes) <= "
                     f"{cert.final_bound:.3g} (per trial {cert.bound.per_trial:.3g})")
    elif fv.equivalent is False and fv.mismatch is not None:
        lines.append(f"  finite field: trial {fv.failing_trial} differs: "
                     f"{fv.mismatch.describe()}")
    else:
        lines.append(f"  finite field: undecided ({fv.reason})")
    cc = cert.crosscheck
    if cc is not None:
        name = ga.outputs[cc.worst_output]
        lines.append(f"  float64: {'close' if cc.close else 'different'} (max abs err "
                     f"{cc.max_abs_err:.3g}, max rel err {cc.max_rel_err:.3g} on output "
                     f"'{name}'; rtol {cc.rtol:g})")
    modelled = {k: t for k, t in cert.treatments.items() if not t.startswith("exact")}
    for k, t in modelled.items():
        lines.append(f"  {k}: {t}")
    if fv.equivalent:
        lines.append(f"  the bound assumes: {'; '.join(a.split(' (')[0] for a in cert.assumptions)}"
                     " (details: --json, docs/verification.md)")
    if cert.disagreement:
        lines.append(f"  disagreement: {cert.disagreement}")
    return "\n".join(lines)


def _write_counterexample(path: str, v: Verifier, gb: Graph, cert: Certificate) -> None:
    """Inputs and both graphs' outputs (float64 and, on a field mismatch, the field
    trial's residues), written atomically."""
    arrays: dict[str, np.ndarray] = {}
    ga = v.reference
    cc = cert.crosscheck
    if cc is not None:
        for ia, ib in zip(ga.inputs, gb.inputs):
            arrays[f"input/{ia.value.name}"] = cc.inputs[ib.value.name]
        for k, (x, y) in enumerate(zip(cc.outputs_a, cc.outputs_b)):
            arrays[f"output_a/{ga.outputs[k]}"] = x
            arrays[f"output_b/{gb.outputs[k]}"] = y
    t = cert.field_verdict.failing_trial
    if t is not None:
        for ia, fx in zip(ga.inputs, v.trial_inputs(t)):
            arrays[f"field_input_p/{ia.value.name}"] = fx.p
            q = fx.q
            if q is not None:
                arrays[f"field_input_q/{ia.value.name}"] = q
        ref, _, _ = v.reference_outputs(t)
        out, _, _ = v.run_trial(gb, t)
        for k, (x, y) in enumerate(zip(ref or [], out or [])):
            arrays[f"field_output_a/{ga.outputs[k]}"] = x
            arrays[f"field_output_b/{gb.outputs[k]}"] = y
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    write_atomic(path, buf.getvalue())
    info(f"counterexample written to {path}")
