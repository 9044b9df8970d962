"""The syntax of `.mir`: loading the Lark grammar, the syntax tree, and syntax errors.

The grammar lives in ``grammar/mir.lark`` (shipped as the package
``mirage_cli.grammar``). This module turns Lark's parse tree into a small tree of
frozen dataclasses with a :class:`~mirage_cli.diagnostics.Span` on every node
(:class:`ToAst`, a Lark ``Transformer`` kept apart from the grammar), and Lark's
parse errors into :class:`~mirage_cli.diagnostics.MirageError` with plain words
("expected ';'", "'load' is a reserved word") instead of terminal names.

What the syntax tree *means* (names, types, tiling) is decided in
:mod:`mirage_cli.parser`, which builds the µGraph from it.

Limits that keep hostile text from exhausting the process (each a located error):
the parse tree may nest at most :data:`MAX_DEPTH` levels (long ``1 + 1 + ...`` chains
and ``- - - x`` nest one level per operator); an integer literal must fit in 63 bits;
a name is at most :data:`MAX_NAME` characters. :func:`check_name` is the one grammar of
names, shared with the `.ugraph.json` loader.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, assert_never

import lark
from lark import Token, Transformer, v_args
from lark.tree import Meta

from mirage_cli.diagnostics import MirageError, Span, source_lines

# Reserved words of the language (a name may not be one of these).
KEYWORDS = ("program", "input", "output", "custom", "load", "store", "imap", "fmap", "omap",
            "true", "false")

MAX_NAME = 64  # characters in a name
MAX_DEPTH = 200  # levels of the parse tree (each is a few Python frames downstream)
MAX_INT = 2**63 - 1  # largest integer literal (an int64)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_name(name: object, reserved_ok: bool = False) -> str | None:
    """Why ``name`` is not a valid name (tensor, program, parameter, attribute key),
    or None. A name is ASCII ``[A-Za-z_][A-Za-z0-9_]*``, at most :data:`MAX_NAME`
    characters, and not a reserved word, so that every name can be written in `.mir`
    (``reserved_ok``: an operator name, where ``custom`` is one)."""
    if not isinstance(name, str):
        return "a name must be a string"
    if not name:
        return "a name cannot be empty"
    if len(name) > MAX_NAME:
        return f"a name has at most {MAX_NAME} characters, this one has {len(name)}"
    if not _NAME.match(name):
        return ("a name is an ASCII letter or '_' followed by letters, digits or '_', got "
                + ascii(name))
    if name in KEYWORDS and not reserved_ok:
        return f"'{name}' is a reserved word and cannot be used as a name"
    return None

# ---------------------------------------------------------------------------
# Loading the grammar
# ---------------------------------------------------------------------------


def grammar_text() -> str:
    """The grammar: from the source checkout if present, else from the installed
    package ``mirage_cli.grammar``."""
    local = Path(__file__).resolve().parent.parent / "grammar" / "mir.lark"
    if local.is_file():
        return local.read_text(encoding="utf-8")
    return importlib.resources.files("mirage_cli.grammar").joinpath("mir.lark").read_text(
        encoding="utf-8")


@functools.lru_cache(maxsize=1)
def lark_parser() -> lark.Lark:
    """The one LALR parser (built once). The basic lexer makes keywords always
    keyword tokens, so `input load: ...` is a reported misuse, not a silent name."""
    return lark.Lark(grammar_text(), parser="lalr", lexer="basic", propagate_positions=True,
                     start=["start", "dim_expr"], maybe_placeholders=True)


# ---------------------------------------------------------------------------
# The syntax tree
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    text: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Num:
    value: int | float
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Var:
    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Lit:
    """``true``, ``false`` or a string."""

    value: bool | str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span = field(compare=False)


@dataclass(frozen=True)
class BinOp:
    op: str  # one of + - * /
    left: Expr
    right: Expr
    span: Span = field(compare=False)


@dataclass(frozen=True)
class TupleExpr:
    items: tuple[Expr, ...]
    span: Span = field(compare=False)


Expr = Num | Var | Lit | Neg | BinOp | TupleExpr


@dataclass(frozen=True)
class Operand:
    name: Name


@dataclass(frozen=True)
class NestedCall:
    op: Name
    span: Span


@dataclass(frozen=True)
class AttrArg:
    key: Name
    value: Expr


Arg = Operand | NestedCall | AttrArg


@dataclass(frozen=True)
class InputStmt:
    name: Name
    dtype: Name
    dims: tuple[Expr, ...]
    span: Span
    qualifier: Name | None = None  # `weight` (checked by the parser)


@dataclass(frozen=True)
class Qualifier:
    """The word after an input's type (a transformer intermediate)."""

    name: Name


@dataclass(frozen=True)
class OpStmt:
    out: Name
    op: Name
    args: tuple[Arg, ...]
    span: Span  # the operator name


@dataclass(frozen=True)
class MapClause:
    kind: str  # imap, fmap or omap
    items: tuple[tuple[Name, Expr], ...]  # imap/omap: (axis, dim); fmap: one ("", dim)
    span: Span


@dataclass(frozen=True)
class LoadStmt:
    out: Name
    source: Name
    clauses: tuple[MapClause, ...]
    span: Span
    keyword: Span


@dataclass(frozen=True)
class StoreStmt:
    source: Name
    target: Name
    clauses: tuple[MapClause, ...]
    span: Span
    keyword: Span
    dtype: Name | None = None  # the device tensor's, where it is not the tile's


@dataclass(frozen=True)
class OutputStmt:
    names: tuple[Name, ...]
    keyword: Span


@dataclass(frozen=True)
class CustomStmt:
    outs: tuple[Name, ...]
    args: tuple[Arg, ...]
    body: tuple[Stmt, ...]
    span: Span  # the `custom(...)` header
    close: Span  # the closing brace


Stmt = InputStmt | OpStmt | CustomStmt | LoadStmt | StoreStmt | OutputStmt


@dataclass(frozen=True)
class Param:
    name: Name
    default: Expr


@dataclass(frozen=True)
class Program:
    name: Name
    params: tuple[Param, ...]
    stmts: tuple[Stmt, ...]
    close: Span


# ---------------------------------------------------------------------------
# Parse tree -> syntax tree
# ---------------------------------------------------------------------------


def _tok_span(file: str, t: Token) -> Span:
    end = t.end_column if t.end_line == t.line else None
    return Span(file, t.line or 1, t.column or 1, end)


def _meta_span(file: str, m: Meta) -> Span:
    if getattr(m, "empty", False):
        return Span(file, 1, 1)
    end = m.end_column if m.end_line == m.line else None
    return Span(file, m.line, m.column, end)


@v_args(inline=True)
class ToAst(Transformer):  # type: ignore[type-arg]
    """Builds the :class:`Program` tree; every node gets the span of its text."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _n(self, t: Token) -> Name:
        if len(t) > MAX_NAME:
            raise MirageError(f"a name has at most {MAX_NAME} characters, this one has "
                              f"{len(t)}", _tok_span(self.file, t))
        return Name(str(t), _tok_span(self.file, t))

    def _s(self, t: Token) -> Span:
        return _tok_span(self.file, t)

    # --- expressions -------------------------------------------------------
    def int_lit(self, t: Token) -> Expr:
        digits = str(t).lstrip("0")
        # Compare digits before converting: int() of a 4,301-digit string raises.
        if len(digits) > len(str(MAX_INT)) or (digits and int(digits) > MAX_INT):
            raise MirageError(f"integer literal is too large (at most 2^63 - 1; this one has "
                              f"{len(digits)} digits)", self._s(t))
        return Num(int(t), self._s(t))

    def float_lit(self, t: Token) -> Expr:
        v = float(t)
        if not math.isfinite(v):
            raise MirageError(f"number {_short(str(t))} is out of the range of a double",
                              self._s(t))
        return Num(v, self._s(t))

    def var(self, t: Token) -> Expr:
        return Var(str(t), self._s(t))

    def true_lit(self, t: Token) -> Expr:
        return Lit(True, self._s(t))

    def false_lit(self, t: Token) -> Expr:
        return Lit(False, self._s(t))

    def string_lit(self, t: Token) -> Expr:
        try:
            value = json.loads(str(t))
        except ValueError as e:  # an escape JSON does not know (\q), a raw control char
            bad = getattr(e, "pos", None)
            span = self._s(t)
            if bad is not None and t.line == t.end_line:
                span = Span(self.file, span.line, span.col + bad)
            msg = getattr(e, "msg", str(e))
            raise MirageError(f"invalid string literal: {msg.lower()} (strings use JSON "
                              f"escapes: \\\" \\\\ \\n \\t \\uXXXX)", span) from None
        return Lit(str(value), self._s(t))

    @v_args(meta=True, inline=True)
    def neg(self, meta: Meta, x: Expr) -> Expr:
        return Neg(x, _meta_span(self.file, meta))

    def _bin(self, op: str, meta: Meta, a: Expr, b: Expr) -> Expr:
        return BinOp(op, a, b, _meta_span(self.file, meta))

    @v_args(meta=True, inline=True)
    def add(self, meta: Meta, a: Expr, b: Expr) -> Expr:
        return self._bin("+", meta, a, b)

    @v_args(meta=True, inline=True)
    def sub(self, meta: Meta, a: Expr, b: Expr) -> Expr:
        return self._bin("-", meta, a, b)

    @v_args(meta=True, inline=True)
    def mul(self, meta: Meta, a: Expr, b: Expr) -> Expr:
        return self._bin("*", meta, a, b)

    @v_args(meta=True, inline=True)
    def div(self, meta: Meta, a: Expr, b: Expr) -> Expr:
        return self._bin("/", meta, a, b)

    @v_args(meta=True, inline=False)
    def tuple_lit(self, meta: Meta, items: list[Expr]) -> Expr:
        return TupleExpr(tuple(items), _meta_span(self.file, meta))

    def dim_expr(self, e: Expr) -> Expr:
        return e

    # --- arguments and map clauses ------------------------------------------
    def arg_operand(self, t: Token) -> Arg:
        return Operand(self._n(t))

    @v_args(meta=True, inline=True)
    def arg_nested(self, meta: Meta, t: Token, *_: Any) -> Arg:
        return NestedCall(self._n(t), _meta_span(self.file, meta))

    def arg_attr(self, t: Token, value: Expr) -> Arg:
        return AttrArg(self._n(t), value)

    def axis_item(self, t: Token, value: Expr) -> tuple[Name, Expr]:
        return (self._n(t), value)

    @v_args(meta=True, inline=True)
    def imap_clause(self, meta: Meta, kw: Token, *items: Any) -> MapClause:
        return MapClause("imap", tuple(i for i in items if i is not None),
                         _meta_span(self.file, meta))

    @v_args(meta=True, inline=True)
    def omap_clause(self, meta: Meta, kw: Token, *items: Any) -> MapClause:
        return MapClause("omap", tuple(i for i in items if i is not None),
                         _meta_span(self.file, meta))

    @v_args(meta=True, inline=True)
    def fmap_clause(self, meta: Meta, kw: Token, dim: Expr) -> MapClause:
        span = _meta_span(self.file, meta)
        return MapClause("fmap", ((Name("", span), dim),), span)

    # --- statements -----------------------------------------------------------
    @v_args(meta=True, inline=True)
    def input_stmt(self, meta: Meta, name: Token, dtype: Token, *rest: Any) -> Stmt:
        qual = rest[-1].name if rest and isinstance(rest[-1], Qualifier) else None
        dims = tuple(d for d in rest if d is not None and not isinstance(d, Qualifier))
        return InputStmt(self._n(name), self._n(dtype), dims, _meta_span(self.file, meta),
                         qual)

    def qualifier(self, word: Token) -> Qualifier:
        return Qualifier(self._n(word))

    def op_stmt(self, out: Token, op: Token, *rest: Any) -> Stmt:
        args = tuple(a for a in rest if isinstance(a, (Operand, NestedCall, AttrArg)))
        return OpStmt(self._n(out), self._n(op), args, self._s(op))

    @v_args(meta=True, inline=True)
    def load_stmt(self, meta: Meta, out: Token, kw: Token, source: Token, *clauses: Any
                  ) -> Stmt:
        return LoadStmt(self._n(out), self._n(source), tuple(clauses),
                        _meta_span(self.file, meta), self._s(kw))

    @v_args(meta=True, inline=True)
    def store_stmt(self, meta: Meta, kw: Token, source: Token, target: Token,
                   dtype: Token | None, *clauses: Any) -> Stmt:
        return StoreStmt(self._n(source), self._n(target), tuple(clauses),
                         _meta_span(self.file, meta), self._s(kw),
                         self._n(dtype) if dtype is not None else None)

    def output_stmt(self, kw: Token, *names: Token) -> Stmt:
        return OutputStmt(tuple(self._n(n) for n in names), self._s(kw))

    @v_args(meta=True, inline=True)
    def custom_body(self, meta: Meta, kw: Token, *rest: Any) -> tuple[Any, ...]:
        args = tuple(a for a in rest if isinstance(a, (Operand, NestedCall, AttrArg)))
        body = tuple(s for s in rest if not isinstance(s, (Operand, NestedCall, AttrArg, Token))
                     and s is not None)
        close = Span(self.file, meta.end_line, max(1, meta.end_column - 1))
        return (self._s(kw), args, body, close)

    def _custom(self, outs: tuple[Token, ...], body: tuple[Any, ...]) -> Stmt:
        kw, args, stmts, close = body
        return CustomStmt(tuple(self._n(o) for o in outs), args, stmts, kw, close)

    def custom_one(self, out: Token, body: tuple[Any, ...]) -> Stmt:
        return self._custom((out,), body)

    def custom_many(self, *rest: Any) -> Stmt:
        return self._custom(tuple(rest[:-1]), rest[-1])

    def param(self, name: Token, default: Expr) -> Param:
        return Param(self._n(name), default)

    @v_args(meta=True, inline=True)
    def program(self, meta: Meta, name: Token, *rest: Any) -> Program:
        params = tuple(p for p in rest if isinstance(p, Param))
        stmts = tuple(s for s in rest if s is not None and not isinstance(s, Param))
        end = Span(self.file, meta.end_line, max(1, meta.end_column - 1))
        return Program(self._n(name), params, stmts, end)

    def start(self, p: Program) -> Program:
        return p


# ---------------------------------------------------------------------------
# Parsing, with friendly syntax errors
# ---------------------------------------------------------------------------

# Plain words for the regular-expression terminals; string terminals print as '<text>'.
_WORDS = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
          "$END": "the end of the file"}
_STATEMENT = {"INPUT", "OUTPUT", "STORE", "NAME", "LPAR"}
_VALUE = {"INT", "FLOAT", "NAME", "LPAR", "MINUS", "TRUE", "FALSE", "STRING"}


def _terminal_word(name: str) -> str:
    if name in _WORDS:
        return _WORDS[name]
    try:
        pattern = lark_parser().get_terminal(name).pattern
    except KeyError:
        return name
    return f"'{pattern.value}'"


def _expected_words(expected: set[str]) -> str:
    exp = set(expected)
    words: list[str] = []
    if _STATEMENT <= exp:
        exp -= _STATEMENT
        words.append("a statement")
    if _VALUE <= exp:
        exp -= _VALUE
        words.append("a value")
    if {"CUSTOM", "LOAD", "NAME"} <= exp:  # after `NAME =`
        exp -= {"NAME"}
        words.append("an operator name")
    words += sorted(_terminal_word(e) for e in exp)
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _token_words(t: Token) -> str:
    if t.type == "$END":
        return "end of file"
    if t.type in ("NAME", "INT", "FLOAT"):
        return f"{_WORDS[t.type].split(' ', 1)[1]} '{t}'"
    return f"'{t}'"


def _previous_token(text: str, pos: int) -> Token | None:
    """The last token that starts before ``pos`` (to point at a missing ';')."""
    prev = None
    try:
        for t in lark_parser().lex(text):
            if t.start_pos is None or t.start_pos >= pos:
                break
            prev = t
    except lark.exceptions.LarkError:
        pass
    return prev


def _end_span(file: str, text: str) -> Span:
    lines = source_lines(text) or [""]
    return Span(file, len(lines), len(lines[-1]) + 1)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _char_words(ch: str) -> str:
    """A character as a diagnostic shows it: quoted, with its Unicode name when it is
    not plain ASCII (U+2028 LINE SEPARATOR), escaped when it is invisible."""
    if ch.isascii() and ch.isprintable():
        return f"'{ch}'"
    name = unicodedata.name(ch, "")
    return f"'{ascii(ch)[1:-1] if not ch.isprintable() else ch}' (U+{ord(ch):04X}" + \
        (f" {name})" if name else ")")


def syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str) -> MirageError:
    """A :class:`MirageError` in plain words for a Lark parse error."""
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        pos = e.pos_in_stream or 0
        ch = text[pos] if pos < len(text) else "?"
        what = ("a '\"' that starts an unterminated string" if ch == '"'
                else f"character {_char_words(ch)}")
        return MirageError(f"unexpected {what}", Span(file, e.line, e.column), source=text)
    if isinstance(e, lark.exceptions.UnexpectedToken):
        return _unexpected_token(e, text, file)
    if isinstance(e, lark.exceptions.UnexpectedEOF):
        return MirageError(f"unexpected end of file; expected {_expected_words(set(e.expected))}",
                           _end_span(file, text), source=text)
    return MirageError(f"syntax error: {e}", file=file, source=text)


def _unexpected_token(e: lark.exceptions.UnexpectedToken, text: str, file: str) -> MirageError:
    t = e.token
    expected = set(e.expected)
    if t.type == "$END":
        return MirageError(f"unexpected end of file; expected {_expected_words(expected)}",
                           _end_span(file, text), source=text)
    span = _tok_span(file, t)
    if t.type == "PROGRAM" and expected == {"$END"}:
        return MirageError("a file holds one program; this is a second 'program'", span,
                           source=text)
    if str(t) in KEYWORDS and "NAME" in expected:
        return MirageError(f"'{t}' is a reserved word and cannot be used as a name", span,
                           source=text)
    if expected == {"SEMICOLON"} or ("SEMICOLON" in expected and "RPAR" not in expected):
        prev = _previous_token(text, t.start_pos or 0)
        if prev is not None and prev.end_line is not None and prev.end_line < (t.line or 0):
            # The statement ended on an earlier line: point just after it.
            where = Span(file, prev.end_line, (prev.end_column or 1))
            return MirageError("expected ';' at the end of the statement", where, source=text)
    return MirageError(f"unexpected {_token_words(t)}; expected {_expected_words(expected)}",
                       span, source=text)


def parse_program(text: str, file: str) -> Program:
    """The syntax tree of a whole `.mir` program, or a located syntax error."""
    try:
        tree = lark_parser().parse(text, start="start")
    except lark.exceptions.UnexpectedInput as e:
        raise syntax_error(e, text, file) from None
    result: Program = _transform(tree, file, text)
    return result


def parse_dim_expr(text: str, file: str = "<dims>") -> Expr:
    """One dimension expression (as kept in an input's ``dims_src``)."""
    try:
        tree = lark_parser().parse(text, start="dim_expr")
    except lark.exceptions.UnexpectedInput as e:
        raise syntax_error(e, text, file) from None
    result: Expr = _transform(tree, file, text)
    return result


def _transform(tree: lark.Tree, file: str, text: str) -> Any:  # type: ignore[type-arg]
    """The syntax tree of a parse tree whose depth was checked first (the transformer
    and everything after it recurse along the tree)."""
    _check_depth(tree, file, text)
    try:
        return ToAst(file).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, MirageError):
            raise e.orig_exc.with_source(text) from None
        raise


def _check_depth(tree: lark.Tree, file: str, text: str) -> None:  # type: ignore[type-arg]
    """A located error where the parse tree nests deeper than :data:`MAX_DEPTH`
    (iterative: the check itself must not recurse)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            meta = node.meta
            span = Span(file, getattr(meta, "line", 1), getattr(meta, "column", 1))
            raise MirageError(f"the program nests too deeply here (more than {MAX_DEPTH} "
                              f"levels of expressions or blocks); split it into simpler "
                              f"statements", span, source=text)
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


# ---------------------------------------------------------------------------
# Expressions back to text
# ---------------------------------------------------------------------------

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def expr_text(e: Expr) -> str:
    """Canonical text of an expression: single spaces around binary operators and
    only the parentheses the structure needs (left-associative operators)."""
    match e:
        case Num(value=v):
            return repr(v)
        case Var(name=n):
            return n
        case Lit(value=v):
            return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)
        case Neg(operand=x):
            inner = expr_text(x)
            return f"-{inner}" if isinstance(x, (Num, Var, Neg)) else f"-({inner})"
        case BinOp(op=op, left=a, right=b):
            return f"{_operand_text(a, _PREC[op], False)} {op} {_operand_text(b, _PREC[op], True)}"
        case TupleExpr(items=items):
            return "(" + ", ".join(expr_text(i) for i in items) + ")"
    assert_never(e)


def _operand_text(e: Expr, prec: int, right: bool) -> str:
    text = expr_text(e)
    if isinstance(e, BinOp) and (_PREC[e.op] < prec or (right and _PREC[e.op] == prec)):
        return f"({text})"
    return text
