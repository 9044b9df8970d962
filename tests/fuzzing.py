"""Grammar-aware mutation of `.mir`, `.ugraph.json` and Mirage checkpoints, and an
in-process harness that runs each mutant through the command line and checks the
promises of DESIGN.md §6 (used by tests/test_fuzz.py and tests/fuzz_campaign.py).

Mutators take a ``random.Random``: hypothesis drives them through ``st.randoms()`` in
the test suite (shrinkable), the campaign script seeds one per mutant (reproducible
and parallel). `.mir` mutants are edited token by token (the language's own lexer):
a token replaced by another of its kind or by a boundary value (0, 2^31, 2^63, a
4,301-digit integer, 1e999, a hostile name), deleted or doubled; whole statements
dropped, doubled or swapped; expression bombs (long sums, stacked minus signs, deep
parentheses); invisible and control characters (ESC/OSC, BOM, NEL, U+2028, NUL).
JSON mutants are edited value by value on the parsed document: a value replaced by
one of another JSON type or range, or by a value of the same kind found elsewhere in
the document (a name, a shape), keys deleted or added (``out``, ``span``), list
entries doubled, dropped or swapped, nesting bombs, and the text itself truncated.

A run passes when: the exit code is 0, 1 or 2 (3 only where the code generator
itself fails, counted apart); no traceback is printed; an exit 2 prints a
diagnostic (``error:``); a failed command leaves no output file and no temporary
file, a successful one leaves complete outputs (they load back); no run takes more
than 10 s.
"""

from __future__ import annotations

import io
import json
import random
import re
import signal
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HANG_SECONDS = 10.0

# ---------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------


def mir_seeds() -> list[str]:
    """Small programs (they run in milliseconds): the fixtures and the code
    generator's corner cases, printed as `.mir`."""
    import sys

    from mirage_cli.printer import print_graph

    sys.path.insert(0, str(ROOT / "tests"))
    from codegen_cases import CASES

    fixtures = sorted((ROOT / "tests/bad_inputs/fixtures").glob("*.mir"))
    return [p.read_text() for p in fixtures] + [print_graph(f()) for _, f in sorted(CASES.items())]


def json_seeds(mirs: list[str]) -> list[str]:
    from mirage_cli import serialize
    from mirage_cli.parser import parse_text

    return [serialize.dumps(parse_text(t, "seed.mir")) for t in mirs]


def checkpoint_seeds() -> list[str]:
    paths = [ROOT / "tests/bad_inputs/fixtures/single_lora.json"]
    shared = ROOT.parent.parent / "shared" / "mirage-mugraphs"
    if not shared.is_dir():
        shared = Path("/work/shared/mirage-mugraphs")
    paths += sorted(p for p in shared.glob("*.json") if p.stat().st_size < 100_000)
    return [p.read_text() for p in paths if p.exists()]


# ---------------------------------------------------------------------------
# .mir mutation
# ---------------------------------------------------------------------------

BOUNDARY_INTS = ["0", "1", "2", "3", "7", "-1", "65535", "65536", "2147483647", "2147483648",
                 "4294967296", "9223372036854775807", "9223372036854775808", "1" + "0" * 30,
                 "9" * 4301]
HOSTILE_NAMES = ["x_0", "x", "sqrtf", "printf", "int", "NULL", "EOF", "arg1", "o__rms",
                 "load", "program", "_", "a" * 64, "a" * 65, "X", "W", "Y", "Z", "t0", "b0"]
OPERATORS = ["matmul", "add", "sub", "mul", "div", "exp", "silu", "gelu", "relu", "sqrt",
             "rsqrt", "square", "neg", "mul_scalar", "sum", "mean", "max", "rms_norm",
             "softmax", "acc_sum", "acc_mean", "acc_rms", "acc_max", "acc_sum_ld",
             "acc_rms_ld", "rms", "custom", "nope"]
STRANGE = ["\x1b]0;pwned\x07", "\x1b[31m", "\ufeff", "\u2028", "\x85", "\x0c", "\x00", "é",
           "\r", "\t", '"', "#", "\\", "\"\\q\"", "{", "}", "(", ")", ";", ",", "=", "->",
           "[", "]", "\n", "1e999", "nan", "-", "*", "/", "+"]


def _tokens(text: str) -> list[Any]:
    from lark.exceptions import LarkError

    from mirage_cli.syntax import lark_parser

    out: list[Any] = []
    try:
        out.extend(lark_parser().lex(text))
    except LarkError:
        pass  # a mutant of a mutant may not lex to the end: use what did
    return out


def _bomb(rnd: random.Random) -> str:
    n = rnd.choice([5, 50, 199, 250, 600, 1000])
    match rnd.randrange(4):
        case 0:
            return "+".join(["1"] * n)
        case 1:
            return "-" * n + "1"
        case 2:
            return "(" * n + "1" + ")" * n
        case _:
            return "*".join(["2"] * min(n, 70))


def _replacement(rnd: random.Random, tok: Any, names: list[str]) -> str:
    match tok.type:
        case "INT":
            return rnd.choice(BOUNDARY_INTS + [_bomb(rnd)])
        case "FLOAT":
            return rnd.choice(["1e999", "0.0", "1e-320", "1.5", "-0.0", "3"])
        case "NAME":
            pool = names + HOSTILE_NAMES + OPERATORS + ["f16", "bf16", "f32", "f64", "i8"]
            return rnd.choice(pool)
        case "STRING":
            return rnd.choice(['"\\q"', '"\\u12"', '""', '"\x1b[2J"', '"a\\nb"'])
    return rnd.choice(STRANGE)


def mutate_mir(text: str, rnd: random.Random) -> str:
    """One to three token- or statement-level edits of ``text`` (one, half the time,
    so that many mutants still pass the checks and reach the later stages)."""
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        text = _mutate_mir_once(text, rnd)
    return text


def _mutate_mir_once(text: str, rnd: random.Random) -> str:
    toks = _tokens(text)
    lines = text.split("\n")
    kind = rnd.randrange(8)
    if kind <= 2 and toks:
        t = rnd.choice(toks)
        s, e = t.start_pos, t.end_pos
        names = sorted({str(x) for x in toks if x.type == "NAME"})
        if kind == 0:
            return text[:s] + _replacement(rnd, t, names) + text[e:]
        if kind == 1:
            return text[:s] + text[e:]
        return text[:e] + " " + str(t) + text[e:]
    if kind == 3 and len(lines) > 2:
        i = rnd.randrange(1, len(lines) - 1)
        match rnd.randrange(3):
            case 0:
                del lines[i]
            case 1:
                lines.insert(i, lines[i])
            case _:
                j = rnd.randrange(1, len(lines) - 1)
                lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if kind == 4:
        i = rnd.randint(0, len(text))
        return text[:i] + rnd.choice(STRANGE) + text[i:]
    if kind == 5 and toks:
        ints = [t for t in toks if t.type == "INT"] or toks
        t = rnd.choice(ints)
        return text[:t.start_pos] + _bomb(rnd) + text[t.end_pos:]
    if kind == 6:
        i = rnd.randint(0, len(text))
        j = min(len(text), i + rnd.randint(1, 12))
        return text[:i] + text[j:]
    ops = [t for t in toks if t.type == "NAME" and str(t) in OPERATORS]
    if ops:
        t = rnd.choice(ops)
        return text[:t.start_pos] + rnd.choice(OPERATORS) + text[t.end_pos:]
    return text


# ---------------------------------------------------------------------------
# JSON mutation
# ---------------------------------------------------------------------------

Path_ = tuple[Any, ...]


def _paths(doc: Any) -> list[Path_]:
    """Every path to a value in ``doc`` (iteratively)."""
    out: list[Path_] = []
    stack: list[tuple[Path_, Any]] = [((), doc)]
    while stack:
        p, v = stack.pop()
        out.append(p)
        if isinstance(v, dict):
            stack.extend((p + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((p + (i,), x) for i, x in enumerate(v))
    return out


def _get(doc: Any, p: Path_) -> Any:
    for k in p:
        doc = doc[k]
    return doc


def _hostile_value(rnd: random.Random, doc: Any, old: Any) -> Any:
    same_kind = [_get(doc, q) for q in _paths(doc) if type(_get(doc, q)) is type(old)]
    choices: list[Any] = [None, True, False, 0, -1, 1, 2, 3, 1.5, -0.0, 2**31, 2**63,
                          10**30, "", "x", "X\n#define sqrtf(v) (0.0f)", "é", "a" * 65,
                          "load", [], {}, [1, 2, 3, 4], [None, 1, 1], ["2", 1, 1],
                          {"out": 1}, [[["deep"]]], "\x1b]0;x\x07"]
    if same_kind and rnd.random() < 0.5:
        return json.loads(json.dumps(rnd.choice(same_kind)))
    return rnd.choice(choices)


def mutate_json(text: str, rnd: random.Random) -> str:
    """One to three value-level edits of the JSON ``text`` (sometimes of the text)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return mutate_mir(text, rnd)  # already broken: edit characters
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        doc = _mutate_doc(doc, rnd)
    out = json.dumps(doc, indent=rnd.choice([None, 1, 2]), sort_keys=rnd.random() < 0.5)
    match rnd.randrange(12):
        case 0:
            return out[:rnd.randint(0, len(out))]  # truncated file
        case 1:
            i = rnd.randint(0, len(out))
            return out[:i] + "[" * 100000 + out[i:]
        case 2:
            return out.replace('"name"', rnd.choice(['"name", "name": "q"', '"name"']), 1)
    return out


def _mutate_doc(doc: Any, rnd: random.Random) -> Any:
    paths = _paths(doc)
    p = rnd.choice(paths)
    if not p:
        return _hostile_value(rnd, doc, doc) if rnd.random() < 0.05 else doc
    parent, key = _get(doc, p[:-1]), p[-1]
    match rnd.randrange(6):
        case 0 | 1:
            parent[key] = _hostile_value(rnd, doc, parent[key])
        case 2:
            del parent[key]
        case 3 if isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
        case 3:
            parent[rnd.choice(["out", "span", "junk", "fmap", "block", "attrs"])] = \
                _hostile_value(rnd, doc, None)
        case 4 if isinstance(parent, list) and len(parent) > 1:
            j = rnd.randrange(len(parent))
            parent[key], parent[j] = parent[j], parent[key]
        case _:
            v = parent[key]
            if isinstance(v, int) and not isinstance(v, bool):
                parent[key] = rnd.choice([v + 1, v - 1, v * 2, v // 2, -v, 0])
            elif isinstance(v, str):
                parent[key] = rnd.choice([v + "_", v[:-1], v.upper(), v + "\n", v * 2])
    return doc


# ---------------------------------------------------------------------------
# Running one mutant
# ---------------------------------------------------------------------------


class Hang(BaseException):
    """A run went past the alarm (not an Exception: nothing in the CLI catches it)."""


@dataclass
class Outcome:
    """What one command run did, and which promises it broke."""

    command: str
    code: int
    seconds: float
    problems: list[str] = field(default_factory=list)
    codegen_fault: bool = False  # exit 3 from inside mirage_cli/codegen (counted apart)


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def invoke(args: list[str], timeout: float = 30.0) -> tuple[int, str, str, Any, float]:
    """`mirage ARGS` in-process: (code, stdout, stderr, escaped exception, seconds)."""
    from click.testing import CliRunner

    from mirage_cli.cli import main

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    t0 = time.monotonic()
    try:
        r = CliRunner().invoke(main, args, env={"NO_COLOR": "1", "COLUMNS": "200"})
        took = time.monotonic() - t0
    except Hang:
        return -1, "", "", None, time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    exc = r.exception if r.exception is not None and not isinstance(r.exception,
                                                                     SystemExit) else None
    return r.exit_code, r.stdout, r.stderr, None if exc is None else (exc, r.exc_info), took


def _in_codegen(args: list[str]) -> bool:
    """Re-run with --debug: does the internal error come from the code generator?"""
    _, _, _, exc, _ = invoke(["--debug", *args])
    if exc is None:
        return False
    frames = traceback.extract_tb(exc[1][2])
    return any("/mirage_cli/codegen/" in f.filename for f in frames[-3:])


def _outputs_ok(command: str, outputs: list[Path], code: int, workdir: Path) -> list[str]:
    problems = []
    temps = [p.name for p in workdir.rglob(".*.tmp")]
    if temps:
        problems.append(f"temporary files left: {temps}")
    if code != 0:
        left = [str(p) for p in outputs if p.exists()]
        if left:
            problems.append(f"exit {code} but outputs written: {left}")
        return problems
    for p in outputs:
        if not p.exists():
            problems.append(f"exit 0 but {p.name} missing")
            continue
        problems += _loads_back(p)
    return problems


def _loads_back(p: Path) -> list[str]:
    """A complete output reads back."""
    import numpy as np

    from mirage_cli import serialize
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.parser import parse_text

    try:
        if p.name.endswith(".ugraph.json"):
            serialize.loads(p.read_text(), str(p))
        elif p.suffix == ".mir":
            parse_text(p.read_text(), str(p))
        elif p.suffix == ".npz":
            with np.load(io.BytesIO(p.read_bytes())) as z:
                list(z.files)
        elif p.suffix in (".cu", ".h") and not p.read_text().strip():
            return [f"{p.name} is empty"]
    except (MirageError, ValueError, OSError) as e:
        return [f"{p.name} does not load back: {e}"]
    return []


_DIAG = re.compile(r"(^|\n)([^\n]*: )?error: ", re.IGNORECASE)  # click says "Error:"


def check_run(command: str, args: list[str], outputs: list[Path], workdir: Path) -> Outcome:
    code, _, err, exc, took = invoke(args)
    out = Outcome(command, code, took)
    if code == -1:
        out.problems.append("hang: stopped by the alarm")
        return out
    if took > HANG_SECONDS:
        out.problems.append(f"took {took:.1f}s (> {HANG_SECONDS:.0f}s)")
    if exc is not None:
        out.problems.append(f"exception escaped: {exc[0]!r}")
    if "Traceback" in err:
        out.problems.append("traceback on stderr")
    if code == 3:
        if command == "codegen" and _in_codegen(args):
            out.codegen_fault = True
        else:
            out.problems.append(f"exit 3: {err.strip()[:200]}")
    elif code not in (0, 1, 2):
        out.problems.append(f"exit {code}")
    if code == 2 and not _DIAG.search(err):
        out.problems.append(f"exit 2 without a diagnostic: {err[:200]!r}")
    out.problems += _outputs_ok(command, outputs, code, workdir)
    return out


# One mutant: which commands run it, with which arguments (``{in}``, ``{seed}`` and
# ``{out}`` are filled in).
PLANS: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "mir": [("parse", ["parse", "{in}", "-o", "{out}/o.ugraph.json"], ["o.ugraph.json"]),
            ("fmt", ["fmt", "{in}", "-o", "{out}/o.mir"], ["o.mir"])],
    "json": [("parse", ["parse", "{in}", "-o", "{out}/o.ugraph.json"], ["o.ugraph.json"]),
             ("fmt", ["fmt", "{in}", "-o", "{out}/o.mir"], ["o.mir"])],
    "checkpoint": [("import-mirage", ["import-mirage", "{in}", "-o", "{out}/imp"], []),
                   ("parse", ["parse", "{in}", "-o", "{out}/o.ugraph.json"],
                    ["o.ugraph.json"])],
}
ROTATING = [("run", ["run", "{in}", "-o", "{out}/o.npz", "--max-memory", "256M"], ["o.npz"]),
            ("verify", ["verify", "{seed}", "{in}", "--trials", "2", "--max-memory", "256M",
                        "--counterexample", "{out}/cx.npz"], []),
            ("codegen", ["codegen", "{in}", "-o", "{out}/o.cu"], ["o.cu", "o.h"])]


def run_mutant(kind: str, text: str, seed_text: str, workdir: Path, turn: int
               ) -> Iterator[Outcome]:
    """Write the mutant and its seed under ``workdir`` and run its commands."""
    suffix = {"mir": ".mir", "json": ".ugraph.json", "checkpoint": ".json"}[kind]
    src, seed = workdir / f"m{suffix}", workdir / f"seed{suffix}"
    src.write_bytes(text.encode("utf-8", "surrogatepass"))
    seed.write_text(seed_text, encoding="utf-8")
    plan = list(PLANS[kind])
    if kind != "checkpoint":
        plan.append(ROTATING[turn % len(ROTATING)])
    for command, template, outs in plan:
        out_dir = workdir / f"out_{command}"
        out_dir.mkdir(exist_ok=True)
        for old in out_dir.iterdir():
            if old.is_file():
                old.unlink()
        args = [a.format(**{"in": str(src), "seed": str(seed), "out": str(out_dir)})
                for a in template]
        outputs = [out_dir / o for o in outs]
        if command == "import-mirage":
            outputs = []
        result = check_run(command, args, outputs, out_dir)
        if command == "import-mirage" and result.code != 0 and (out_dir / "imp").exists() \
                and any((out_dir / "imp").iterdir()):
            result.problems.append("import-mirage failed but wrote files")
        if command == "import-mirage":
            import shutil

            shutil.rmtree(out_dir / "imp", ignore_errors=True)
        yield result
