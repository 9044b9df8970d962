"""Every bad input fails cleanly: exit 2, no traceback, stderr equal to its golden.

Cases and goldens live in tests/bad_inputs (see cases.txt there); refresh the goldens
with `python -m mirage_cli.golden` and review the diff.
"""

from pathlib import Path

import pytest

from mirage_cli.golden import BAD_INPUTS, bad_input_cases, run_cli

ROOT = Path(__file__).resolve().parent.parent
CASES = bad_input_cases(ROOT / BAD_INPUTS)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert any(c.args[0] == "run" for c in CASES)
    assert any("-D" in c.args for c in CASES)
    assert any(a.endswith(".json") for c in CASES for a in c.args)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case) -> None:
    code, _, err = run_cli(case.args)
    assert "Traceback" not in err
    assert code == 2, err
    golden = ROOT / BAD_INPUTS / f"{case.name}.stderr"
    assert golden.exists(), f"no golden for {case.name}; run python -m mirage_cli.golden"
    assert err == golden.read_text(encoding="utf-8")


def test_every_golden_has_a_case() -> None:
    names = {c.name for c in CASES}
    stale = [p.name for p in (ROOT / BAD_INPUTS).glob("*.stderr") if p.stem not in names]
    assert not stale, f"goldens without a case: {stale}"


# .mir cases whose error is about the file or the command line, not a place in the file.
UNLOCATED = {"not_utf8", "output_is_a_directory", "d_not_an_integer", "d_no_equals"}


def test_diagnostics_are_located() -> None:
    """Every other .mir case points at file:line:col and shows the line with a caret."""
    for case in CASES:
        if case.args[0] == "parse" and case.args[1].endswith(".mir") and \
                Path(ROOT / case.args[1]).exists() and case.name not in UNLOCATED:
            head, src, caret = (ROOT / BAD_INPUTS / f"{case.name}.stderr").read_text(
                encoding="utf-8").splitlines()[:3]
            file, line, col = head.split(": error: ")[0].rsplit(":", 2)
            assert file == case.args[1]
            assert caret.strip().startswith("^")
            assert caret.index("^") == int(col) + 1, case.name
            assert src[2:] == (ROOT / file).read_text().splitlines()[int(line) - 1]
