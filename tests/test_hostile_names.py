"""Hostile names end to end: programs whose tensor, kernel and program names are C
library functions, C types and macros, strings with a newline and a `#define`, or the
identifiers the code generator mints (``x`` beside ``x_0``, ``o__rms``, ``arg1``). The
generated code compiles under NVRTC and under nvcc (skipped where nvcc is absent) and,
under the ``gpu`` marker, computes the float64 reference's result."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "hostile_names"


def injected() -> Graph:
    """Names carrying a newline and a macro that would silence sqrtf if pasted."""
    b = GraphBuilder("p\n#include </etc/passwd>??/")
    x = b.input("x\n#define sqrtf(v) 0\\", (4, 8), "f32")
    b.output(b.op("sqrt", b.op("exp", x)))
    return b.build()


def graphs() -> dict[str, Graph]:
    out = {p.stem: load_graph(str(p)) for p in sorted(DATA.glob("*.mir"))}
    out["injected"] = injected()
    return out


CASES = sorted(graphs())


@pytest.mark.parametrize("name", CASES)
def test_nvcc_compiles_the_generated_code(tmp_path: Path, name: str) -> None:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    cu, h = emit(lower(graphs()[name]))
    (tmp_path / "k.cu").write_text(cu)
    (tmp_path / "k.h").write_text(h)
    # A C++ consumer that includes the header after the usual headers.
    (tmp_path / "use.cpp").write_text("#include <cmath>\n#include <cstdio>\n"
                                      "#include <cstdlib>\n#include \"k.h\"\n"
                                      "int main() { return 0; }\n")
    for src in ("k.cu", "use.cpp"):
        r = subprocess.run(["nvcc", "-arch=sm_90", "-c", src, "-o", src + ".o"],
                           check=False, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{name}: nvcc {src}:\n{r.stderr[-3000:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_hostile_names_compute_the_reference(name: str) -> None:
    from mirage_cli.codegen.runner import Device, gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.bench import check_graph

    loaded, chk = check_graph(Device(0), graphs()[name], seed=5)
    loaded.unload()
    assert chk.ok, f"{name}: {chk.reason}"
