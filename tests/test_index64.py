"""Index range of generated kernels (issue 12, item 3): a tensor of 2^31 elements or
more is refused with a located diagnostic (exit 2); up to 2^31 - 1 elements the code
is generated, with a 64-bit index wherever a loop's last step would pass INT_MAX; and
no emitted ``int`` loop ever counts to 2^31 or steps beyond INT_MAX."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from mirage_cli.cli import main
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.indexing import INT_MAX, loop_index_type
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.plan import Kernel
from mirage_cli.diagnostics import MirageError
from mirage_cli.parser import parse_text

ROOT = Path(__file__).resolve().parent.parent
LIMIT = INT_MAX + 1  # 2^31

# for (TYPE V = INIT; V < BOUND; STEP): the step as ++V or V += EXPR
_LOOP = re.compile(r"for \((int|long long) (\w+) = [^;]*; \2 < (\d+); "
                   r"(?:\+\+\2|\2 \+= ([^)]*))\)")
_ROW = re.compile(r"const (int|long long) row = (?:blockIdx\.x|mg_bx) \* (\d+) \+ threadIdx\.x / 32;")


def _step(expr: str | None, grid: tuple[int, int, int]) -> int:
    if expr is None:
        return 1
    # a grouped launch's member has its grid size as a literal (codegen/grouping.py)
    value = re.sub(r"(\d+)u\b", r"\1", expr.replace("gridDim.x", str(grid[0]))).replace(" ", "")
    assert re.fullmatch(r"[\d*]+", value), f"cannot bound the step {expr!r}"
    out = 1
    for factor in value.split("*"):
        out *= int(factor)
    return out


def unsafe_int_indices(text: str, grid: tuple[int, int, int] = (65535, 1, 1)) -> list[str]:
    """The ``int`` loop indices in ``text`` that reach 2^31 or overflow on their last
    step, and ``int`` row indices that overflow for the largest block index."""
    bad = []
    for m in _LOOP.finditer(text):
        ctype, _, bound, step = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        if ctype == "int" and bound - 1 + _step(step, grid) > INT_MAX:
            bad.append(m.group(0))
    for m in _ROW.finditer(text):
        if m.group(1) == "int" and grid[0] * int(m.group(2)) > INT_MAX:
            bad.append(m.group(0))
    return bad


def _kernels(src: str) -> list[Kernel]:
    return list(lower(parse_text(src, "big.mir")).kernels)


def _program(decl: str, body: str) -> str:
    return f"program big() {{\n  input X: {decl};\n  {body}\n  output Y;\n}}\n"


# Programs whose tensors hold 2^31 - 1 elements (a prime: one dimension), or the
# largest 2^31 - 2^16 for a custom kernel that needs divisible dimensions.
AT_THE_LIMIT = {
    "elementwise": _program(f"f32[{INT_MAX}]", "Y = exp(X);"),
    "reduce": _program(f"f32[{INT_MAX}]", "Y = sum(X, dim=0, keepdim=true);"),
    "softmax": _program(f"f32[{INT_MAX}]", "Y = softmax(X, dim=0);"),
    "rows": _program(f"f32[{INT_MAX}, 1]", "Y = rms_norm(X);"),
    "custom": _program("f16[32767, 65536]",
                       "Y = custom(grid=(32767, 1, 1), threads=128, forloop=16) {\n"
                       "    x = load X imap(x=0) fmap(1);\n    s = acc_sum_ld(x);\n"
                       "    store s -> Y omap(x=0);\n  }"),
}


@pytest.mark.parametrize("case", sorted(AT_THE_LIMIT))
def test_at_the_limit_code_is_generated_with_safe_indices(case: str) -> None:
    kernels = _kernels(AT_THE_LIMIT[case])
    for k in kernels:
        assert unsafe_int_indices("\n".join(k.body), k.grid) == [], (case, k.name)


def test_the_grid_stride_loop_over_2_31_minus_1_elements_is_64_bit() -> None:
    (k,) = _kernels(AT_THE_LIMIT["elementwise"])
    assert any(line.startswith("for (long long e = ") for line in k.body)
    # ... while an ordinary size keeps int (the goldens are unchanged)
    (small,) = _kernels(_program("f32[4096, 4096]", "Y = exp(X);"))
    assert any(line.startswith("for (int e = ") for line in small.body)


def test_the_checker_catches_what_the_old_code_emitted() -> None:
    """The scanner is not vacuous: the loops issue 12 reported are flagged."""
    assert unsafe_int_indices("for (int e = blockIdx.x * 256 + threadIdx.x; e < 4294967296; "
                              "e += gridDim.x * 256) {")
    assert unsafe_int_indices("for (int e = blockIdx.x * 256 + threadIdx.x; e < 2147483647; "
                              "e += gridDim.x * 256) {")
    assert not unsafe_int_indices("for (int e = threadIdx.x; e < 4096; e += 128) {")


def test_loop_index_type_at_the_boundary() -> None:
    assert loop_index_type(INT_MAX, 1) == "int"
    assert loop_index_type(INT_MAX, 2) == "long long"
    assert loop_index_type(INT_MAX - 31, 32) == "int"
    assert loop_index_type(INT_MAX - 30, 32) == "long long"


OVER_THE_LIMIT = {
    "elementwise": _program(f"f32[{LIMIT}]", "Y = exp(X);"),
    "issue_12": _program("f16[65536, 65536]", "Y = exp(X);"),
    "reduce": _program(f"f32[2, {LIMIT // 2}]", "Y = sum(X, dim=1);"),
    "custom": _program("f16[32768, 65536]",
                       "Y = custom(grid=(32768, 1, 1), threads=128, forloop=16) {\n"
                       "    x = load X imap(x=0) fmap(1);\n    s = acc_sum_ld(x);\n"
                       "    store s -> Y omap(x=0);\n  }"),
}


@pytest.mark.parametrize("case", sorted(OVER_THE_LIMIT))
def test_2_31_elements_are_refused_at_the_operator(case: str) -> None:
    with pytest.raises(MirageError, match=r"tensor 'X' .* 32-bit") as info:
        _kernels(OVER_THE_LIMIT[case])
    assert info.value.span is not None and (info.value.span.line, info.value.span.col) == (3, 7)


def test_the_cli_reports_it_located_with_exit_2(tmp_path: Path) -> None:
    src = tmp_path / "big.mir"
    src.write_text(OVER_THE_LIMIT["issue_12"])
    out = tmp_path / "big.cu"
    r = CliRunner().invoke(main, ["codegen", str(src), "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert f"{src}:3:7: error: tensor 'X'" in r.output
    assert "  Y = exp(X);" in r.output and "^" in r.output
    assert not out.exists() and not out.with_suffix(".h").exists()


@pytest.mark.parametrize("command", ["opt", "search", "explain"])
def test_the_commands_that_search_refuse_it_before_searching(tmp_path: Path,
                                                           command: str) -> None:
    """Refused before the search (explain searches a .mir it is given): a search and a
    verification at 10^22 elements (n = 99999999999) would not end."""
    import time

    src = tmp_path / "huge.mir"
    src.write_text(_program("f16[99999999999, 99999999999]", "Y = exp(X);"))
    out = tmp_path / ("huge.cu" if command == "opt" else "huge.cands.ugraph.json")
    t0 = time.monotonic()
    args = [str(src)] if command == "explain" else [str(src), "-o", str(out)]
    r = CliRunner().invoke(main, [command, *args])
    assert r.exit_code == 2, r.output
    assert time.monotonic() - t0 < 20
    assert f"{src}:3:7: error: tensor 'X'" in r.output and "32-bit" in r.output
    assert sorted(x.name for x in tmp_path.iterdir()) == ["huge.mir"]


def test_the_bench_s_search_refuses_it_too() -> None:
    """`mirage bench` searches through opt's search stage: refused there, not hung."""
    from mirage_cli.commands import opt
    from mirage_cli.commands.bench import opt_settings

    g = parse_text(_program("f16[99999999999, 99999999999]", "Y = exp(X);"), "huge.mir")
    with pytest.raises(MirageError, match=r"tensor 'X' .* 32-bit"):
        opt.stage_search(g, opt_settings(jobs=1), 10.0)


def test_no_emitted_int_loop_reaches_2_31_in_the_goldens() -> None:
    files = sorted((ROOT / "golden").rglob("*.cu"))
    assert len(files) >= 10
    loops = 0
    for f in files:
        text = f.read_text()
        loops += len(_LOOP.findall(text))
        assert unsafe_int_indices(text) == [], f
        assert "long long e =" not in text  # small tensors keep 32-bit indices
    assert loops > 100


def test_the_code_at_the_limit_compiles() -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    from mirage_cli.codegen.nvrtc import compile_cuda

    for case in ("elementwise", "softmax"):
        cu, _ = emit(lower(parse_text(AT_THE_LIMIT[case], "big.mir")))
        assert compile_cuda(cu, f"{case}.cu", "sm_90").cubin
