"""The frontend on the examples and through the command line: parse, fmt, run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mirage_cli import serialize
from mirage_cli.diagnostics import MirageError
from mirage_cli.golden import EXAMPLES, GOLDEN, example_files, example_goldens, run_cli
from mirage_cli.ir import attr
from mirage_cli.parser import parse_file, parse_text
from mirage_cli.printer import print_graph

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_FILES = [p.relative_to(ROOT) for p in example_files(ROOT / EXAMPLES)]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_there_are_examples() -> None:
    assert len(EXAMPLE_FILES) >= 2


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=str)
def test_example_fmt_then_parse_is_identical(example: Path) -> None:
    code, parsed, err = run_cli(("parse", str(example)))
    assert code == 0, err
    code, text, err = run_cli(("fmt", str(example)))
    assert code == 0, err
    assert serialize.dumps(parse_text(text, "<fmt>")) == parsed
    assert print_graph(parse_text(text, "<fmt>")) == print_graph(parse_file(example))


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=str)
def test_example_goldens(example: Path) -> None:
    for path, text in example_goldens(example).items():
        assert path.exists(), f"missing {path}: run python -m mirage_cli.golden"
        assert path.read_text(encoding="utf-8") == text, f"{path} differs"


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=str)
def test_example_fmt_is_idempotent_and_keeps_comments(example: Path) -> None:
    from mirage_cli.comments import format_source, scan_comments

    text = example.read_text()
    once = format_source(text, str(example))
    assert format_source(once, "<fmt>") == once
    kept = [c.text for c in scan_comments(once) if c.text]
    assert kept == [c.text for c in scan_comments(text) if c.text]


def test_no_stale_goldens() -> None:
    wanted = {p for ex in EXAMPLE_FILES for p in example_goldens(ex)}
    present = {p.relative_to(ROOT) for p in (ROOT / GOLDEN).rglob("*") if p.is_file()}
    assert present <= wanted, f"goldens without an example: {sorted(present - wanted)}"


# ---------------------------------------------------------------------------
# The language
# ---------------------------------------------------------------------------

SMALL = """program small(m = 4, k = 2 * m, n = k / 2) {
  input X: f16[m,k];   # spacing and comments are not kept
  input W: f16[(k), ((n + m) * 2) / 2];
  Y = rms_norm(X, eps=1e-6);
  S = sum(Y, dim=-1, keepdim=true);
  Z = matmul(Y, W);
  (A, B) = custom(grid=(2), forloop=2) {
    w = load W imap(x=1) fmap(0);
    x = load X fmap(1);
    m = matmul(x, w);
    s = acc_sum(m);
    r = acc_rms_ld(x);
    store r -> B omap(x=1);
    o = div(s, r);
    store o -> A omap(x=1);
  };
  output Z, S;
  output A, B;
}
"""


def test_parse_details() -> None:
    g = parse_text(SMALL, "small.mir")
    assert g.params == (("m", 4), ("k", 8), ("n", 4))
    assert g.inputs[1].dims_src == ("k", "(n + m) * 2 / 2")
    assert g.inputs[0].value.type.shape == (4, 8)
    assert attr(g.ops[1].attrs, "dim") == 1  # -1 normalised against rank 2
    custom = g.ops[3]
    assert custom.block is not None
    assert custom.block.grid == (2, 1, 1)
    assert (custom.block.threads, custom.block.forloop) == (128, 2)
    assert [v.name for v in custom.outputs] == ["A", "B"]  # left-hand side order
    assert g.outputs == ("Z", "S", "A", "B")
    assert custom.span is not None and custom.span.line == 7


def test_print_is_canonical_and_round_trips() -> None:
    g = parse_text(SMALL, "small.mir")
    text = print_graph(g)
    assert "  input X: f16[m, k];" in text
    assert "(A, B) = custom(grid=(2, 1, 1), threads=128, forloop=2) {" in text
    lines = text.splitlines()
    assert lines[7:9] == ["    w = load W imap(x=1) fmap(0);", "    x = load X fmap(1);"]
    assert lines[13:15] == ["    store o -> A omap(x=1);", "    store r -> B omap(x=1);"]
    assert "rms_norm(X, eps=1e-06)" in text
    assert "program small(m = 4, k = 8, n = 4) {" in text
    assert parse_text(text, "printed.mir") == g
    assert print_graph(parse_text(text, "printed.mir")) == text


def test_a_store_may_convert_to_another_dtype() -> None:
    """``store t -> X: f32``: the device tensor's dtype where it is not the tile's
    (docs/ir.md); printed only then, kept through .ugraph.json, and a bad dtype is a
    located error."""
    text = SMALL.replace("store r -> B omap", "store r -> B: f32 omap")
    g = parse_text(text, "small.mir")
    types = g.tensor_types()
    assert types["B"].dtype.value == "f32" and types["A"].dtype.value == "f16"
    printed = print_graph(g)
    assert "    store r -> B: f32 omap(x=1);" in printed
    assert "    store o -> A omap(x=1);" in printed
    assert parse_text(printed, "printed.mir") == g
    assert serialize.loads(serialize.dumps(g)) == g
    with pytest.raises(MirageError) as e:
        parse_text(SMALL.replace("store r -> B omap", "store r -> B: f64 omap"), "small.mir")
    assert e.value.render().startswith("small.mir:13:19: error: unknown dtype 'f64'")


def test_defines_override_and_reprint() -> None:
    g = parse_text(SMALL, "small.mir", {"m": 8})
    assert g.params == (("m", 8), ("k", 16), ("n", 8))
    assert "program small(m = 8, k = 16, n = 8) {" in print_graph(g)
    with pytest.raises(MirageError, match="no parameter 'q'"):
        parse_text(SMALL, "small.mir", {"q": 1})


def test_unprintable_names_are_errors() -> None:
    from mirage_cli.builder import GraphBuilder

    b = GraphBuilder("my-prog")
    b.output(b.input("load", (4,), "f32"))
    with pytest.raises(MirageError, match="cannot be written"):
        print_graph(b.build())
    b = GraphBuilder("9-lives")
    b.output(b.input("X", (4,), "f32"))
    assert print_graph(b.build()).startswith("program _9_lives() {")


def test_errors_carry_the_source_line() -> None:
    with pytest.raises(MirageError) as e:
        parse_text(SMALL.replace("matmul(Y, W)", "matmul(W, Y)"), "small.mir")
    text = e.value.render()
    assert text.startswith("small.mir:6:7: error: matmul:")
    assert "[8, 8] @ [4, 8]" in text
    assert "  Z = matmul(W, Y);" in text.splitlines()[1]


# ---------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------

EX = "tests/bad_inputs/fixtures/small.mir"


def test_parse_writes_file(tmp_path: Path) -> None:
    out = tmp_path / "x.ugraph.json"
    code, stdout, _ = run_cli(("parse", EX, "-D", "n=2", "-o", str(out)))
    assert code == 0 and stdout == ""
    g = serialize.load(str(out))
    assert g.params == (("n", 2),)
    assert run_cli(("parse", EX, "-D", "n=2"))[1] == out.read_text()


def test_fmt_check(tmp_path: Path) -> None:
    canonical = tmp_path / "c.mir"
    canonical.write_text(run_cli(("fmt", EX))[1])
    assert run_cli(("fmt", "--check", str(canonical)))[0] == 0
    messy = tmp_path / "m.mir"
    messy.write_text(canonical.read_text().replace("[n, 8]", "[n,8]"))
    code, out, err = run_cli(("fmt", "--check", str(messy)))
    assert code == 1 and out == "" and "not in canonical form" in err


def test_fmt_of_json_equals_fmt_of_mir(tmp_path: Path) -> None:
    js = tmp_path / "x.ugraph.json"
    assert run_cli(("parse", EX, "-o", str(js)))[0] == 0
    assert run_cli(("fmt", str(js)))[1] == run_cli(("fmt", EX))[1]


def test_run_random_and_from_npz(tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    code, _, err = run_cli(("run", EX, "--seed", "3", "-o", str(out)))
    assert code == 0, err
    assert "Y: [4, 8]" in err
    from mirage_cli import interp

    g = parse_file(EX)
    ins = interp.random_inputs(g, 3)
    with np.load(out) as z:
        np.testing.assert_array_equal(z["Y"], interp.run(g, ins)["Y"])
    inp = tmp_path / "in.npz"
    np.savez(inp, **ins)  # type: ignore[arg-type]
    out2 = tmp_path / "out2.npz"
    assert run_cli(("run", EX, "--inputs", str(inp), "-o", str(out2)))[0] == 0
    with np.load(out) as a, np.load(out2) as b:
        np.testing.assert_array_equal(a["Y"], b["Y"])


def test_run_native_precision(tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    assert run_cli(("run", EX, "--precision", "native", "-o", str(out)))[0] == 0
    with np.load(out) as z:
        assert z["Y"].dtype == np.float16



COMMENTED = """
# head 1


# head 2
program p(n = 4) {  # trailing on header

  # before X
  input X: f16[n,8];   # X trail
  Z = custom(grid=(2,1,1)) { # on custom

    # first in kernel
    x = load X imap(x=0);  # "quoted # in a comment"
    s = acc_sum(x);

    store s -> Z omap(x=0);
    # last in kernel

  }  # after kernel
  output Z;  # out trail
  # before end

}

# after all
"""

COMMENTED_FMT = """# head 1

# head 2
program p(n = 4) {  # trailing on header
  # before X
  input X: f16[n, 8];  # X trail
  Z = custom(grid=(2, 1, 1), threads=128, forloop=1) {  # on custom
    # first in kernel
    x = load X imap(x=0);  # "quoted # in a comment"
    s = acc_sum(x);

    store s -> Z omap(x=0);
    # last in kernel
  }  # after kernel
  output Z;  # out trail
  # before end
}

# after all
"""


def test_fmt_keeps_comments_and_blank_lines(tmp_path: Path) -> None:
    src = tmp_path / "c.mir"
    src.write_text(COMMENTED)
    code, out, err = run_cli(("fmt", str(src)))
    assert code == 0, err
    assert out == COMMENTED_FMT
    assert run_cli(("fmt", "--check", str(src)))[0] == 1
    src.write_text(out)
    assert run_cli(("fmt", "--check", str(src)))[0] == 0


def test_run_json_summary() -> None:
    import json

    code, out, err = run_cli(("run", EX, "--json", "--seed", "1"))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["program"] == "small" and doc["inputs"] == "random(seed=1)"
    (y,) = doc["outputs"]
    assert y["name"] == "Y" and y["shape"] == [4, 8] and y["nonfinite"] == 0
    assert y["min"] <= y["mean"] <= y["max"]


def test_block_names_are_a_separate_scope() -> None:
    from mirage_cli.builder import GraphBuilder

    b = GraphBuilder("scopes")
    x = b.input("X", (4, 8), "f32")
    k = b.custom((1, 1, 1), 32, 1)
    t = k.load(x, out="X")
    (z,) = k.finish([(k.op("acc_sum", t, out="Z"), "Z", (None, None, None))])
    k2 = b.custom((2, 1, 1), 32, 2)
    t2 = k2.load(z, (0, None, None), 1, out="X")
    (w,) = k2.finish([(k2.op("acc_max", t2, out="Z"), "W", (0, None, None))])
    b.output(w)
    g = b.build()
    text = print_graph(g)
    assert "    X = load X;" in text and "    Z = acc_max(X);" in text
    assert parse_text(text, "scopes.mir") == g


def test_fmt_in_place_and_output(tmp_path: Path) -> None:
    messy = tmp_path / "m.mir"
    messy.write_text(Path(EX).read_text().replace("[n, 8]", "[n,8]"))
    assert run_cli(("fmt", "--check", str(messy)))[0] == 1
    out = tmp_path / "o.mir"
    assert run_cli(("fmt", str(messy), "-o", str(out)))[0] == 0
    assert run_cli(("fmt", "-i", str(messy)))[0] == 0
    assert messy.read_text() == out.read_text() == run_cli(("fmt", EX))[1]
    assert run_cli(("fmt", "--check", str(messy)))[0] == 0
    assert run_cli(("fmt", "-i", "--check", str(messy)))[0] == 2


def test_quiet_still_shows_errors() -> None:
    code, _, err = run_cli(("-q", "parse", "tests/bad_inputs/unknown_operator.mir"))
    assert code == 2 and "unknown kernel operator 'rms_nrom'" in err
    code, _, err = run_cli(("-q", "run", EX))
    assert code == 0 and err == ""


def test_parse_and_fmt_of_a_checkpoint_agree(tmp_path: Path) -> None:
    pytest.importorskip("mirage_cli.importers.mirage")
    ckpt = "tests/bad_inputs/fixtures/single_lora.json"
    code, as_json, err = run_cli(("parse", ckpt))
    assert code == 0, err
    mir = tmp_path / "lora.mir"
    assert run_cli(("fmt", ckpt, "-o", str(mir)))[0] == 0
    assert run_cli(("parse", str(mir)))[1] == as_json


def test_fmt_keeps_parametric_custom_headers(tmp_path: Path) -> None:
    src = tmp_path / "p.mir"
    src.write_text("program p(b = 4, f = 2) {\n  input X: f32[2*b, 8];\n"
                   "  Z = custom(grid=(2*b), forloop=f) {\n    x = load X imap(x=0) fmap(1);\n"
                   "    s = acc_sum_ld(x);\n    store s -> Z omap(x=0);\n  }\n  output Z;\n}\n")
    code, out, err = run_cli(("fmt", str(src)))
    assert code == 0, err
    assert "  Z = custom(grid=(2 * b, 1, 1), threads=128, forloop=f) {\n" in out
    src.write_text(out)
    g = parse_file(src, {"b": 3, "f": 4})
    assert g.ops[0].block is not None
    assert (g.ops[0].block.grid, g.ops[0].block.forloop) == ((6, 1, 1), 4)
    # from a .ugraph.json the header can only be numbers
    js = tmp_path / "p.ugraph.json"
    assert run_cli(("parse", str(src), "-o", str(js)))[0] == 0
    assert "custom(grid=(8, 1, 1), threads=128, forloop=2)" in run_cli(("fmt", str(js)))[1]


FUSED = [p for p in EXAMPLE_FILES if p.parent.name == "mugraphs" and
         (ROOT / EXAMPLES / (p.stem.removesuffix("_fused") + ".mir")).exists()]


@pytest.mark.parametrize("fused", FUSED, ids=str)
def test_fused_example_computes_its_program(fused: Path) -> None:
    """Each hand-written µGraph equals its program in float64 (at batch = 1)."""
    from mirage_cli import interp

    ref_path = EXAMPLES / (fused.stem.removesuffix("_fused") + ".mir")
    defines = {"batch": 1} if "batch" in dict(parse_file(ref_path).params) else {}
    ref, got = parse_file(ref_path, defines), parse_file(fused, defines)
    ins = interp.random_inputs(ref, 1)
    want, have = interp.run(ref, ins), interp.run(got, ins)
    assert len(want) == len(have)
    for x, y in zip(want.values(), have.values()):
        assert np.linalg.norm(x - y) <= 1e-9 * np.linalg.norm(x)
