"""Registry completeness (foundation columns) and: every operator of the registry is
parseable and printable at each level it allows."""

from __future__ import annotations

import pytest

from mirage_cli import ops
from mirage_cli.builder import GraphBuilder
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.printer import print_graph

# Attribute values that fit an (8, 8) operand, for the required attributes.
REQUIRED = {"dim": 1, "width": 4, "scalar": 0.5, "d0": 64}


@pytest.mark.parametrize("name", sorted(ops.REGISTRY))
def test_opdef_is_complete(name: str) -> None:
    op = ops.get(name)
    assert op.name == name
    assert op.levels and op.levels <= {ops.KERNEL, ops.BLOCK}
    lo, hi = op.arity
    assert 1 <= lo <= hi
    assert callable(op.infer)
    assert op.doc.strip()
    assert (op.numpy is None) == (name == "custom")
    for spec in op.attrs:
        assert spec.required or spec.default is not None, (name, spec.name)
        assert not spec.required or spec.name in REQUIRED, f"no test value for {spec.name}"


def _attrs(op: ops.OpDef) -> dict[str, object]:
    return {s.name: REQUIRED[s.name] for s in op.attrs if s.required}


def _kernel_graph(op: ops.OpDef, arity: int) -> Graph:
    b = GraphBuilder(f"use_{op.name}")
    xs = [b.input(f"X{i}", (8, 8), "f16") for i in range(arity)]
    b.output(b.op(op.name, *xs, out="Y", **_attrs(op)))  # type: ignore[arg-type]
    return b.build()


def _block_graph(op: ops.OpDef, arity: int) -> Graph:
    b = GraphBuilder(f"use_{op.name}_in_a_kernel")
    xs = [b.input(f"X{i}", (8, 8), "f16") for i in range(arity)]
    k = b.custom((2, 1, 1), 128, 2)
    tiles = [k.load(x, (0, None, None), 1) for x in xs]
    y = k.op(op.name, *tiles, **_attrs(op))  # type: ignore[arg-type]
    if not op.is_accumulator:
        y = k.op("acc_sum", y)
    (z,) = k.finish([(y, "Z", (0, None, None))])
    b.output(z)
    return b.build()


CASES = [(name, level, arity) for name, op in sorted(ops.REGISTRY.items()) if name != "custom"
         for level in sorted(op.levels) for arity in range(op.arity[0], op.arity[1] + 1)]


@pytest.mark.parametrize("name,level,arity", CASES)
def test_operator_parses_and_prints(name: str, level: str, arity: int) -> None:
    op = ops.get(name)
    g = (_kernel_graph if level == ops.KERNEL else _block_graph)(op, arity)
    text = print_graph(g)
    assert f" = {name}(" in text
    assert parse_text(text, "<registry>") == g


def test_custom_is_printable() -> None:
    g = _block_graph(ops.get("exp"), 1)
    assert "custom(grid=(2, 1, 1), threads=128, forloop=2)" in print_graph(g)


def test_every_operator_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "language.md").read_text()
    table = doc[doc.index("## Operators"):doc.index("## Custom kernels")]
    words = set(table.replace("`", " ").replace("|", " ").split())
    missing = [n for n in ops.REGISTRY if n != "custom" and n not in words]
    assert not missing, f"operators missing from docs/language.md: {missing}"
