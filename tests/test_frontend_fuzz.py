"""Mutated programs never crash the frontend: each either parses (and then round-trips
through the printer) or fails with a located MirageError."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from mirage_cli.diagnostics import MirageError
from mirage_cli.parser import parse_text
from mirage_cli.printer import print_graph
from mirage_cli.syntax import lark_parser

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p.read_text() for p in (ROOT / "examples").rglob("*.mir")) + \
    sorted(p.read_text(errors="replace") for p in (ROOT / "tests/bad_inputs").glob("*.mir"))
PIECES = ["(", ")", "{", "}", ";", ",", "=", "->", "-", "*", "/", "+", "[", "]", ":", "#",
          "load", "store", "custom", "input", "output", "imap(x=1)", "fmap(0)", "omap(y=0)",
          "acc_sum", "matmul", "x", "X", "0", "1", "-1", "1e-6", "true", "\"s\"", "\n", " ",
          "@", "\t", "dim=", "grid=(2, 2)", "forloop=2", "é"]


# Lark's names for tokens, which must never reach a user.
TERMINALS = {t.name for t in lark_parser().terminals} | {"$END"}


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        match draw(st.sampled_from(("delete", "insert", "replace"))):
            case "delete":
                text = text[:i] + text[j:]
            case "insert":
                text = text[:i] + draw(st.sampled_from(PIECES)) + text[i:]
            case _:
                text = text[:i] + draw(st.sampled_from(PIECES)) + text[j:]
    return text


@settings(max_examples=250, deadline=None)
@given(mutated())
def test_mutations_fail_cleanly(text: str) -> None:
    try:
        g = parse_text(text, "m.mir")
    except MirageError as e:
        rendered = e.render()
        assert rendered.startswith("m.mir:"), rendered
        unquoted = re.sub(r"'[^']*'", "", e.message)
        assert not TERMINALS & set(re.findall(r"[A-Z_$][A-Z_0-9]*", unquoted)), e.message
        if e.span is not None:
            assert 1 <= e.span.line <= max(1, len(text.splitlines()) + 1)
        return
    assert parse_text(print_graph(g), "p.mir") == g
