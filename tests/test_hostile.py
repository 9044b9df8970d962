"""Hostile inputs (issue 12, items 1 at load time, 4, 6 and 7): every defect the
fuzzing campaign found is kept here as a regression case.

Each bad input must give exit 2 and a located diagnostic (``file:line:col: error:``,
the source line, a caret), never exit 3 or a traceback; a cached search result must
be proved before it is used; memory is estimated before it is allocated; Ctrl-C
stops any phase with exit 130 and no output.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.parser import parse_text

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests/bad_inputs/fixtures/small.mir"
FUSED = """\
program fused(rows = 4, hidden = 64, n = 32) {
  input X: f16[rows, hidden];
  input W: f16[hidden, n];
  Z = custom(grid=(2, 1, 1), threads=128, forloop=4) {
    x = load X fmap(1);
    w = load W imap(x=1) fmap(0);
    r = acc_rms_ld(x);
    m = matmul(x, w);
    s = acc_sum(m);
    o = div(s, r);
    store o -> Z omap(x=1);
  }
  output Z;
}
"""
ENV = {"NO_COLOR": "1", "COLUMNS": "200"}
HEAD = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): error: ")


def cli(*args: str, stdin: str | bytes | None = None) -> tuple[int, bytes, str]:
    """`mirage ARGS` in-process: (exit code, stdout bytes, stderr text)."""
    r = CliRunner().invoke(main, list(args), input=stdin, env=ENV)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.stdout_bytes, re.sub(r"\x1b\[[0-9;]*m", "", r.stderr)


def assert_located(err: str, file: str) -> re.Match[str]:
    """Exit-2 diagnostic at file:line:col, with the line and a caret under it."""
    assert "Traceback" not in err and "internal error" not in err, err
    m = HEAD.match(err)
    assert m is not None and m.group("file") == file, err
    lines = err.splitlines()
    assert len(lines) >= 3 and lines[2].strip().startswith("^"), err
    return m


def graph_doc(text: str = FUSED) -> dict[str, Any]:
    return json.loads(serialize.dumps(parse_text(text, "t.mir")))


def write(tmp_path: Path, name: str, content: str | bytes | dict[str, Any]) -> str:
    p = tmp_path / name
    if isinstance(content, dict):
        content = json.dumps(content, indent=1)
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return str(p)


def fails_located(tmp_path: Path, name: str, content: Any, *args: str) -> str:
    path = write(tmp_path, name, content)
    code, _, err = cli("parse", path, *args)
    assert code == 2, err
    assert_located(err, path)
    return err


# ---------------------------------------------------------------------------
# Item 1: every identifier is checked at load
# ---------------------------------------------------------------------------

INJECTION = 'x\n#define sqrtf(v) (0.0f)'
NAME_PATHS = [
    ("graph", "name"),
    ("graph", "params", 0, "name"),
    ("graph", "inputs", 0, "name"),
    ("graph", "ops", 0, "outputs", 0, "name"),
    ("graph", "ops", 0, "block", "inputs", 0, "name"),
    ("graph", "ops", 0, "block", "inputs", 0, "source"),
    ("graph", "ops", 0, "block", "ops", 0, "outputs", 0, "name"),
    ("graph", "ops", 0, "block", "ops", 1, "inputs", 0),
    ("graph", "ops", 0, "block", "outputs", 0, "name"),
    ("graph", "ops", 0, "block", "outputs", 0, "source"),
    ("graph", "outputs", 0),
]


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


@pytest.mark.parametrize("path", NAME_PATHS, ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("bad", [INJECTION, "load", "é", "a" * 65, "", "9x", 7])
def test_every_json_name_is_checked(tmp_path: Path, path: tuple[Any, ...], bad: Any) -> None:
    doc = graph_doc()
    _set(doc, path, bad)
    err = fails_located(tmp_path, "g.ugraph.json", doc)
    want = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]
    assert f"error: {want}: " in err, err
    assert "\n#define" not in err  # a raw newline could forge a line of output


@pytest.mark.parametrize("path", [("graph", "ops", 0, "op"),
                                  ("graph", "ops", 0, "block", "ops", 2, "op")])
def test_json_operator_names_are_names(tmp_path: Path, path: tuple[Any, ...]) -> None:
    doc = graph_doc()
    _set(doc, path, INJECTION)
    err = fails_located(tmp_path, "op.ugraph.json", doc)
    want = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]
    assert f"error: {want}: " in err and "\n#define" not in err, err


def test_json_attribute_keys_are_names(tmp_path: Path) -> None:
    doc = graph_doc("program p() {\n  input X: f16[4, 4];\n  Y = sum(X, dim=1);\n"
                    "  output Y;\n}\n")
    doc["graph"]["ops"][0]["attrs"] = {"dim;system(1)": 1}
    err = fails_located(tmp_path, "g.ugraph.json", doc)
    assert "graph.ops[0].attrs.dim;system(1)" in err


def test_a_mir_name_has_bounded_length(tmp_path: Path) -> None:
    err = fails_located(tmp_path, "long.mir", "program p() {\n  input " + "X" * 65 +
                        ": f16[4];\n  output X;\n}\n")
    assert "at most 64 characters" in err


def test_duplicate_names_and_keys_are_rejected(tmp_path: Path) -> None:
    doc = graph_doc()
    doc["graph"]["inputs"][1]["name"] = "X"
    err = fails_located(tmp_path, "dup.ugraph.json", doc)
    assert "defined twice" in err
    text = json.dumps(graph_doc()).replace('"name": "fused"', '"name": "fused", "name": "g"')
    path = write(tmp_path, "dupkey.ugraph.json", text)
    code, _, err = cli("parse", path)
    assert code == 2 and "appears twice" in err, err


# ---------------------------------------------------------------------------
# Item 4: a cache that proves what it returns
# ---------------------------------------------------------------------------

EXP = "program p() {\n  input X: f32[4, 8];\n  Y = exp(X);\n  output Y;\n}\n"
SILU = "program q() {\n  input X: f32[4, 8];\n  Y = silu(X);\n  output Y;\n}\n"
TWO = "program r() {\n  input X: f32[4, 8];\n  Z = exp(X);\n  Y = add(Z, X);\n  output Y;\n}\n"


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entry(program_text: str, cands_text: str) -> tuple[Any, str, str]:
    from mirage_cli.search import cache
    from mirage_cli.search.driver import SearchOptions

    g = parse_text(program_text, "p.mir")
    opts = SearchOptions().as_json()
    k = cache.key(g, opts)
    meta = {"rank": 0, "kernels": 1, "cost": {"time_us": 1.0}, "tuning": []}
    cands = serialize.dumps_candidates([(parse_text(cands_text, "c.mir"), meta)])
    return g, k, cands


def test_cache_returns_a_proved_entry(cache_env: Path) -> None:
    from mirage_cli.search import cache
    from mirage_cli.search.driver import SearchOptions

    g, k, cands = _entry(EXP, EXP)
    cache.put(k, cands, g, SearchOptions().as_json())
    assert cache.get(k, g, SearchOptions().as_json()) == cands


def test_cache_entry_with_a_forged_record_is_refused(cache_env: Path, capsys: Any) -> None:
    """`mirage search` prints each candidate's rank, kernels, cost and tuning: an
    entry whose record lacks them would crash it (exit 3), so it is a miss."""
    from mirage_cli.search import cache
    from mirage_cli.search.driver import SearchOptions

    g, k, cands = _entry(EXP, EXP)
    doc = json.loads(cands)
    del doc["candidates"][0]["meta"]["cost"]
    cache.put(k, json.dumps(doc), g, SearchOptions().as_json())
    assert cache.get(k, g, SearchOptions().as_json()) is None
    assert "no valid record" in capsys.readouterr().err


def test_cache_entry_of_another_program_is_detected(cache_env: Path, capsys: Any) -> None:
    """A well-formed entry for program B, found under program A's key (a swapped or
    planted file), is refused, whether or not its recorded hash was forged."""
    from mirage_cli.search import cache
    from mirage_cli.search.driver import SearchOptions

    opts = SearchOptions().as_json()
    a, ka, _ = _entry(EXP, EXP)
    b, kb, cands_b = _entry(SILU, SILU)
    cache.put(kb, cands_b, b, opts)
    (cache_env / f"{ka}.cache.json").write_text((cache_env / f"{kb}.cache.json").read_text())
    assert cache.get(ka, a, opts) is None
    assert "another program" in capsys.readouterr().err
    cache.put(ka, cands_b, a, opts)  # forged: A's hash around B's candidates
    assert cache.get(ka, a, opts) is None
    assert "computes another function" in capsys.readouterr().err


def test_cache_non_equivalent_graph_is_detected(cache_env: Path, capsys: Any) -> None:
    from mirage_cli.search import cache
    from mirage_cli.search.driver import SearchOptions

    opts = SearchOptions().as_json()
    g, k, wrong = _entry(TWO, EXP)  # same signature, another function
    cache.put(k, wrong, g, opts)
    assert cache.get(k, g, opts) is None
    assert "candidate 0 computes another function" in capsys.readouterr().err
    other = dict(opts, top=opts["top"] + 1)
    _, _, right = _entry(TWO, TWO)
    cache.put(k, right, g, other)
    assert cache.get(k, g, opts) is None
    assert "other options" in capsys.readouterr().err


def test_cached_search_recomputes_a_bad_entry(cache_env: Path, monkeypatch: Any) -> None:
    """Through the driver: a poisoned entry makes the search run again, and the
    recomputed result replaces the entry."""
    from mirage_cli.search import cache, driver

    g, k, wrong = _entry(TWO, EXP)
    opts = driver.SearchOptions()
    cache.put(k, wrong, g, opts.as_json())
    calls = []

    def fake_search(program: Any, options: Any, budget: Any, jobs: Any, notify: Any) -> Any:
        calls.append(program)
        return driver.SearchResult([], driver.Progress(), True, 0.0)

    monkeypatch.setattr(driver, "search", fake_search)
    out = driver.cached_search(g, opts, None, 1)
    assert calls == [g] and not out.cached and out.candidates == []
    out = driver.cached_search(g, opts, None, 1)
    assert calls == [g] and out.cached  # the recomputed entry is used and proved


# ---------------------------------------------------------------------------
# Item 6: memory before allocation, and Ctrl-C
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "verify"])
def test_huge_program_is_refused_before_allocation(tmp_path: Path, command: str) -> None:
    path = write(tmp_path, "big.mir", "program big() {\n  input X: f16[1000000, 1000000];\n"
                 "  Y = exp(X);\n  output Y;\n}\n")
    args = (path, path) if command == "verify" else (path,)
    code, _, err = cli(command, *args)
    assert code == 2, err
    m = assert_located(err, path)
    assert m.group("line") == "2" and "'X'" in err and "--max-memory" in err


def test_max_memory_option(tmp_path: Path) -> None:
    """f32[1024, 1024] -> exp: two 8 MiB float64 tensors and a 4 MiB float32 input,
    20 MiB in all: runs under 64M, is refused under 8M."""
    path = write(tmp_path, "m.mir", "program m() {\n  input X: f32[1024, 1024];\n"
                 "  Y = exp(X);\n  output Y;\n}\n")
    assert cli("run", path, "--max-memory", "64M")[0] == 0
    code, _, err = cli("run", path, "--max-memory", "8M")
    assert code == 2 and "about 20 MiB" in err and "over the limit of 8 MiB" in err, err
    code, _, err = cli("run", path, "--max-memory", "lots")
    assert code == 2 and "expected a size" in err


def _interrupt(args: list[str], tmp_path: Path, after: float) -> tuple[int, str, float]:
    """Start `mirage ARGS`, send SIGINT after ``after`` seconds; (code, stderr, seconds
    from the signal to the exit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1",
               MIRAGE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-m", "mirage_cli", *args], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(after)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    return p.returncode, err.decode(), time.monotonic() - t0


QKNORM = ROOT / "examples/qknorm_gqa.mir"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["search", "opt"])
def test_sigint_stops_the_search_with_no_output(tmp_path: Path, command: str) -> None:
    out = tmp_path / ("o.cu" if command == "opt" else "c.ugraph.json")
    code, err, took = _interrupt([command, str(QKNORM), "-o", str(out), "--budget", "120",
                                  "--jobs", "1"], tmp_path, 4.0)
    assert code == 130, err
    assert "Traceback" not in err and took < 10
    assert not list(tmp_path.glob("o.*")) and not out.exists()


@pytest.mark.slow
def test_sigint_stops_verify(tmp_path: Path) -> None:
    big = write(tmp_path, "v.mir", "program v() {\n  input A: f32[2048, 4096];\n"
                "  input B: f32[4096, 2048];\n  C = matmul(A, B);\n  D = exp(C);\n"
                "  output D;\n}\n")
    code, err, took = _interrupt(["verify", big, big, "--trials", "1000",
                                  "--counterexample", "cx.npz"], tmp_path, 4.0)
    assert code == 130, err
    assert "Traceback" not in err and took < 10 and not (tmp_path / "cx.npz").exists()


# ---------------------------------------------------------------------------
# Item 7: every bad input is a located exit 2
# ---------------------------------------------------------------------------

PROG = "program p(n = {n}) {{\n  input X: f16[4, 8];\n  Y = sum(X, dim=1{attr});\n  output Y;\n}}\n"


@pytest.mark.parametrize("name, n, attr, where", [
    ("bad_escape", "4", ', k="\\q"', "invalid string literal"),
    ("digits_4301", "9" * 4301, "", "integer literal is too large"),
    ("sum_600", "+".join(["1"] * 600), "", "nests too deeply"),
    ("minus_1000", "-" * 1000 + "1", "", "nests too deeply"),
    ("overflow", "4611686018427387904 * 4", "", "does not fit in 64 bits"),
    ("float_overflow", "4", ", eps=1e999", "out of the range"),
])
def test_mir_limits_are_located(tmp_path: Path, name: str, n: str, attr: str,
                                where: str) -> None:
    err = fails_located(tmp_path, f"{name}.mir", PROG.format(n=n, attr=attr))
    assert where in err


def test_longest_accepted_expression_round_trips(tmp_path: Path) -> None:
    """A dimension at the nesting limit parses, and the .ugraph.json written for it
    loads back (the JSON loader's bound on dimension text once was tighter: found by
    the fuzzing campaign, mutant 1206)."""
    dim = " + ".join(["1"] * 190) + " + n"
    src = f"program p(n = 2) {{\n  input X: f16[4, {dim}];\n  output X;\n}}\n"
    code, out, err = cli("parse", write(tmp_path, "wide.mir", src))
    assert code == 0, err
    code, back, err = cli("fmt", write(tmp_path, "wide.ugraph.json", out.decode()))
    assert code == 0 and dim in back.decode(), err


def _block(doc: dict[str, Any]) -> dict[str, Any]:
    block: dict[str, Any] = doc["graph"]["ops"][0]["block"]
    return block


JSON_CASES = {
    "attr_out": (lambda d: d["graph"]["ops"][0].update(attrs={"out": "Q"}),
                 "custom operator has no attributes"),
    "null_grid": (lambda d: _block(d).update(grid=[None, 1, 1]),
                  "graph.ops[0].block.grid[0]: expected an integer, got null"),
    "string_grid": (lambda d: _block(d).update(grid=["2", 1, 1]),
                    "graph.ops[0].block.grid[0]: expected an integer, got \"2\""),
    "fourth_grid": (lambda d: _block(d).update(grid=[2, 1, 1, 1]),
                    "a grid has 1 to 3 entries"),
    "zero_grid": (lambda d: _block(d).update(grid=[0, 1, 1]), "from 1 to"),
    "float_fmap": (lambda d: _block(d)["inputs"][0].update(fmap=1.5),
                   "graph.ops[0].block.inputs[0].fmap: expected an integer"),
    "op_inputs_ints": (lambda d: _block(d)["ops"][1].update(inputs=[1, 2]),
                       "graph.ops[0].block.ops[1].inputs[0]: a name must be a string"),
    "two_outputs": (lambda d: _block(d)["ops"][0]["outputs"].append(
        _block(d)["ops"][0]["outputs"][0]), "a block operator has exactly one output"),
    "shape_zero": (lambda d: d["graph"]["inputs"][0].update(shape=[0, 64]), "from 1 to"),
    "dims_code": (lambda d: d["graph"]["inputs"][0].update(dims=["rows); system(\"x\"", "64"]),
                  "not a dimension expression"),
    "attr_list": (lambda d: _block(d)["ops"][1].update(attrs={"x": [1]}),
                  "an attribute value is a number"),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_json_fields_are_checked(tmp_path: Path, case: str) -> None:
    mutate, want = JSON_CASES[case]
    doc = graph_doc()
    mutate(doc)
    err = fails_located(tmp_path, f"{case}.ugraph.json", doc)
    assert want in err, err


def test_json_attrs_out_and_span_on_a_predefined_operator(tmp_path: Path) -> None:
    for key in ("out", "span"):
        doc = graph_doc("program p() {\n  input X: f16[4, 4];\n  Y = exp(X);\n"
                        "  output Y;\n}\n")
        doc["graph"]["ops"][0]["attrs"] = {key: 3}
        err = fails_located(tmp_path, f"{key}.ugraph.json", doc)
        assert f"'exp' has no attribute '{key}'" in err


@pytest.mark.parametrize("text, want", [
    ('{"format": "mirage-cli/ugraph", "version": 1, "graph": ' + "[" * 100000 +
     "]" * 100000 + "}", "nests more than 64 levels"),
    ('{"format": "mirage-cli/ugraph", "version": 1, "graph": {"n": ' + "7" * 5000 + "}}",
     "a number of 5000 characters"),
    ('{"format": "mirage-cli/ugraph", "version": 1, "graph": NaN}', "not a JSON value"),
    ("[" * 100000, "nests more than 64 levels"),  # a checkpoint, for the importer
])
def test_hostile_json_documents(tmp_path: Path, text: str, want: str) -> None:
    for name in ("d.ugraph.json", "d.json"):
        err = fails_located(tmp_path, name, text)
        assert want in err


def test_escape_sequences_are_not_echoed(tmp_path: Path) -> None:
    """ESC/OSC/BEL bytes of a source file reach the terminal escaped, and the caret
    still sits under the offending character."""
    src = "program p() {\n  input X: f16[4];\x1b]0;pwned\x07\x1b[31m @\n  output X;\n}\n"
    err = fails_located(tmp_path, "esc.mir", src)
    assert "\x1b" not in err and "\x07" not in err
    lines = err.splitlines()
    assert "\\x1b]0;pwned\\x07\\x1b[31m" in lines[1]
    assert lines[1][lines[2].index("^")] == "\\"  # under the escaped ESC
    doc = graph_doc()
    doc["graph"]["ops"][0]["op"] = "\x1b[2J\x1b]8;;http://x\x07"
    err = fails_located(tmp_path, "esc.ugraph.json", doc)
    assert "\x1b" not in err and "\x07" not in err


def test_bom_is_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, "bom.mir", "\ufeff" + SMALL.read_text())
    code, _, err = cli("parse", path)
    assert code == 0, err
    assert cli("fmt", path)[1].decode() == SMALL.read_text()
    doc = "\ufeff" + json.dumps(graph_doc())
    assert cli("parse", write(tmp_path, "bom.ugraph.json", doc))[0] == 0


@pytest.mark.parametrize("sep", ["\x0c", "\x85", "\u2028", "\u2029", "\x0b", "\x1c"])
def test_lines_are_counted_as_editors_do(tmp_path: Path, sep: str) -> None:
    """Only '\\n' ends a line: a form feed, NEL or U+2028 inside a comment does not
    shift the line of a later error, and fmt keeps comments with their statements."""
    src = f"program p() {{\n  # a{sep}b\n  input X: f16[4];\n  Y = nope(X);\n  output Y;\n}}\n"
    path = write(tmp_path, "sep.mir", src)
    code, _, err = cli("parse", path)
    assert code == 2
    m = assert_located(err, path)
    assert (m.group("line"), m.group("col")) == ("4", "7"), err
    assert err.splitlines()[1] == "    Y = nope(X);"
    ok = src.replace("nope", "exp")
    code, out, err = cli("fmt", write(tmp_path, "ok.mir", ok))
    assert code == 0, err
    assert out.decode().split("\n")[1:3] == [f"  # a{sep}b", "  input X: f16[4];"]
    if sep == "\x0c":  # whitespace in the language: accepted between tokens
        code, _, err = cli("parse", write(tmp_path, "ff.mir", ok.replace("  Y", "\x0c  Y")))
        assert code == 0, err
    else:  # not whitespace: rejected where it stands, named and escaped
        path = write(tmp_path, "bad.mir", ok.replace("  Y =", f"  Y{sep} ="))
        code, _, err = cli("parse", path)
        m = assert_located(err, path)
        assert code == 2 and (m.group("line"), m.group("col")) == ("4", "4"), err
        assert f"U+{ord(sep):04X}" in err


def _chain(n: int, notes: int = 1) -> str:
    """A program of ``n`` statements, each after ``notes`` comment lines, and ``n``
    outputs."""
    body = "".join("".join(f"  # step {i}.{j}\n" for j in range(notes)) +
                   f"  t{i} = exp({'X' if i == 0 else f't{i - 1}'});  # c\n" for i in range(n))
    outs = ", ".join(f"t{i}" for i in range(n))
    return f"program chain() {{\n  input X: f16[4];\n{body}  output {outs};\n}}\n"


@pytest.mark.slow
def test_fmt_and_parse_are_linear() -> None:
    """Four times the statements take well under sixteen times as long. The
    workload (40 comment lines per statement) makes a quadratic placement of comments
    show at small sizes: the old fmt took 12.6 times as long for 1,200 statements as
    for 300 (8.7 s), this one about 4 times (0.35 s of CPU time)."""
    from mirage_cli.comments import format_source

    texts = {n: _chain(n, notes=40) for n in (300, 1200)}
    times: dict[int, list[float]] = {n: [] for n in texts}
    # This thread's CPU time, not the wall clock: under a parallel test run on two cores
    # the wall clock also counts the time other processes held the core (the ratio
    # reached 8.3 on CI while the CPU time of the same work stays near 4). The best of
    # five of each, the two sizes in turn, against what contention remains (caches).
    for _ in range(5):
        for n, text in texts.items():
            t0 = time.thread_time()
            format_source(text, "c.mir")  # parses the program, then places comments
            times[n].append(time.thread_time() - t0)
    small, large = min(times[300]), min(times[1200])
    assert large / small < 8, (small, large)


def test_stdin_and_stdout(tmp_path: Path) -> None:
    text = SMALL.read_text()
    code, out, err = cli("parse", "-", stdin=text)
    assert code == 0, err
    doc = out.decode()
    assert cli("parse", "-", "-o", "-", stdin=text)[1].decode() == doc
    code, out, _ = cli("fmt", "-", stdin=doc)  # JSON on stdin, told by its first '{'
    assert code == 0 and out.decode() == text
    assert cli("fmt", "-", "-o", "-", stdin=text)[1].decode() == text
    assert cli("fmt", "--check", "-", stdin=text)[0] == 0
    code, out, err = cli("run", "-", "-o", "-", stdin=text)
    assert code == 0, err
    assert list(np.load(io.BytesIO(out))) == ["Y"]
    code, _, err = cli("parse", "-", stdin="program p() {\n  oops;\n}\n")
    assert code == 2 and err.startswith("<stdin>:2:"), err
    assert cli("fmt", "-i", "-", stdin=text)[0] == 2


def test_verify_defines_apply_per_file(tmp_path: Path) -> None:
    js = tmp_path / "small.ugraph.json"
    assert cli("parse", str(SMALL), "-o", str(js))[0] == 0
    code, _, err = cli("verify", str(SMALL), str(js), "-D", "n=4", "--trials", "1")
    assert code == 0, err
    assert f"-D is not applied to {js}" in err
    code, _, err = cli("verify", str(SMALL), str(js), "-D", "n=8", "--trials", "1")
    assert code == 2 and "differs" in err  # applied to the .mir, so the shapes differ
    code, _, err = cli("verify", str(SMALL), str(SMALL), "-D", "m=4")
    assert code == 2 and "no .mir operand declares a parameter 'm'" in err
    other = write(tmp_path, "k.mir", text := SMALL.read_text().replace("small(n = 4)",
                                                                       "k(n = 4, k = 1)"))
    assert "k = 1" in text
    code, _, err = cli("verify", str(SMALL), other, "-D", "k=2", "--trials", "1")
    assert code == 0, err  # k is declared by one operand only: applied to that one


def test_version_to_a_full_device() -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args in (["--version"], ["parse", str(SMALL)]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-m", "mirage_cli", *args], stdout=full,
                               stderr=subprocess.PIPE, env=env, timeout=60, check=False)
        err = p.stderr.decode()
        assert p.returncode == 2 and "Traceback" not in err, err
        assert "cannot write the output" in err



def test_an_interrupt_raised_in_a_finalizer_is_delivered_again() -> None:
    """Python ignores an exception raised in ``__del__``; a Ctrl-C that lands there
    (Z3's finalizers run all through the search) must still stop the command."""
    from mirage_cli.cli import interrupts_survive_finalizers

    class Finalized:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    stopped, before = False, sys.unraisablehook
    with interrupts_survive_finalizers():
        try:
            Finalized()  # collected at once: its KeyboardInterrupt is "ignored"
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the interrupt comes back meanwhile
                pass
        except KeyboardInterrupt:
            stopped = True
    assert stopped
    assert sys.unraisablehook is before  # the hook is the command's alone


def test_finalizer_errors_after_an_interrupt_are_not_printed() -> None:
    """A Ctrl-C inside a constructor leaves a half-built object (a Z3 sort without its
    ``ctx``) whose ``__del__`` fails at exit; after "interrupted" no traceback may
    follow. Before the interrupt, such an error is still reported as usual."""
    from mirage_cli import cli

    class HalfBuilt:
        def __del__(self) -> None:
            raise AttributeError("'BoolSortRef' object has no attribute 'ctx'")

    before, reported = sys.unraisablehook, []
    sys.unraisablehook = reported.append
    try:
        with cli.interrupts_survive_finalizers():
            HalfBuilt()
            assert len(reported) == 1  # not interrupted: the default hook hears of it
            with pytest.raises(SystemExit) as stop:
                cli._interrupted()
        assert stop.value.code == 130
        HalfBuilt()
        assert len(reported) == 1 and sys.unraisablehook is cli._after_interrupt
    finally:
        sys.unraisablehook = before
