"""Mirage's published checkpoints import, and every candidate computes its program.

The programs are the ones of Mirage's benchmark scripts (see the checkpoints' README),
built here with the builder. Candidates and programs are compared input-by-position on
random inputs in float64 through the reference interpreter.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_data import MUGRAPHS

from mirage_cli import interp, loading, serialize
from mirage_cli.builder import GraphBuilder
from mirage_cli.cli import main
from mirage_cli.diagnostics import MirageError
from mirage_cli.importers import mirage_dtypes
from mirage_cli.importers.mirage import STRUCTURAL, import_checkpoint, mirage_index
from mirage_cli.ir import DType, Graph

CKPTS = MUGRAPHS
FILES = sorted(p.name for p in CKPTS.glob("*.json")) if CKPTS.is_dir() else []
needs_ckpts = pytest.mark.skipif(not FILES, reason="Mirage checkpoints not available")

# Candidates that do not compute their program: (file, index) -> reason. Every one of
# the 132 published candidates agrees today, so this is empty; see docs/mirage-import.md.
EXPECTED_DIFFERENT: dict[tuple[str, int], str] = {}

REL_TOL = 1e-12  # observed differences are below 1e-15 (summation order only)


# ---------------------------------------------------------------------------
# The programs the checkpoints were found for (Mirage's benchmark/*.py)
# ---------------------------------------------------------------------------


def _rmsnorm(rows: int) -> Graph:
    b = GraphBuilder("rmsnorm")
    x, w = b.input("X", (rows, 4096), "f16"), b.input("W", (4096, 6144), "f16")
    b.output(b.op("matmul", b.op("rms_norm", x), w))
    return b.build()


def _gated_mlp() -> Graph:
    b = GraphBuilder("gated_mlp")
    x = b.input("X", (8, 4096), "f16")
    w1, w2 = b.input("W1", (4096, 4096), "f16"), b.input("W2", (4096, 4096), "f16")
    b.output(b.op("mul", b.op("silu", b.op("matmul", x, w1)), b.op("matmul", x, w2)))
    return b.build()


def _lora() -> Graph:
    b = GraphBuilder("lora")
    x, w = b.input("X", (16, 256), "f16"), b.input("W", (256, 4096), "f16")
    a, bb = b.input("A", (256, 16), "f16"), b.input("B", (16, 4096), "f16")
    b.output(b.op("add", b.op("matmul", x, w), b.op("matmul", b.op("matmul", x, a), bb)))
    return b.build()


def _ntrans(rows: int) -> Graph:
    b = GraphBuilder("ntrans")
    h, x, alpha = (b.input(n, (rows, 4096), "f16") for n in ("H", "X", "alpha"))
    a = b.op("add", b.op("rms_norm", h), x)
    b.output(b.op("rms_norm", b.op("add", x, b.op("mul", alpha, a))))
    return b.build()


def _gqa(heads: int) -> Graph:
    b = GraphBuilder("gqa")
    q = b.input("Q", (heads, 256, 64), "f16")
    k = b.input("K", (heads, 64, 4096), "f16")
    v = b.input("V", (heads, 4096, 64), "f16")
    e = b.op("exp", b.op("matmul", q, k))
    s = b.op("sum", e, dim=2, keepdim=True)
    b.output(b.op("matmul", b.op("div", e, s), v))
    return b.build()


PROGRAMS: dict[str, Callable[[], Graph]] = {
    "rmsnorm_bs1.json": lambda: _rmsnorm(2), "rmsnorm_bs8.json": lambda: _rmsnorm(16),
    "gated_mlp.json": _gated_mlp, "single_gated_mlp.json": _gated_mlp,
    "lora.json": _lora, "single_lora.json": _lora,
    "ntrans_bs1.json": lambda: _ntrans(8), "ntrans_bs8.json": lambda: _ntrans(64),
    "gqa_bs1.json": lambda: _gqa(2), "gqa_bs8.json": lambda: _gqa(16),
}


def _import(name: str) -> list[Graph]:
    path = str(CKPTS / name)
    return import_checkpoint(Path(path).read_text(), path)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _outputs_by_position(g: Graph, inputs: list[np.ndarray]) -> list[np.ndarray]:
    out = interp.run(g, dict(zip(g.input_names, inputs)))
    return [out[n] for n in g.outputs]


# ---------------------------------------------------------------------------
# The published checkpoints
# ---------------------------------------------------------------------------


@needs_ckpts
def test_every_file_has_a_program() -> None:
    assert set(FILES) == set(PROGRAMS)


@needs_ckpts
@pytest.mark.parametrize("name", FILES)
def test_every_candidate_imports(name: str) -> None:
    doc = json.loads((CKPTS / name).read_text())
    graphs = _import(name)
    assert len(graphs) == len(doc)
    program = PROGRAMS[name]()
    for g in graphs:
        assert g.is_fused
        assert [i.value.type for i in g.inputs] == [i.value.type for i in program.inputs]
        assert [g.tensor_types()[o] for o in g.outputs] == \
            [program.tensor_types()[o] for o in program.outputs]


@needs_ckpts
@pytest.mark.parametrize("name", FILES)
def test_candidates_compute_their_program(name: str) -> None:
    program = PROGRAMS[name]()
    ins = interp.random_inputs(program, seed=7)
    inputs = [ins[n].astype(np.float64) for n in program.input_names]
    (ref,) = _outputs_by_position(program, inputs)
    differ: dict[int, float] = {}
    for i, g in enumerate(_import(name)):
        (out,) = _outputs_by_position(g, inputs)
        assert out.shape == ref.shape and not np.isnan(out).any()
        err = _rel_err(out, ref)
        if not err <= REL_TOL:
            differ[i] = err
    expected = {i for (f, i) in EXPECTED_DIFFERENT if f == name}
    assert set(differ) == expected, f"candidates differing from the program: {differ}"


@needs_ckpts
def test_the_comparison_detects_a_wrong_program() -> None:
    """The check above can fail: an rmsnorm candidate differs from the plain matmul by
    far more than REL_TOL (rms of a standard normal row is close to 1, hence ~1e-2)."""
    g = _import("rmsnorm_bs1.json")[0]
    b = GraphBuilder("no_norm")
    x, w = b.input("X", (2, 4096), "f16"), b.input("W", (4096, 6144), "f16")
    b.output(b.op("matmul", x, w))
    wrong = b.build()
    ins = interp.random_inputs(wrong, seed=1)
    inputs = [ins[n].astype(np.float64) for n in wrong.input_names]
    assert _rel_err(_outputs_by_position(g, inputs)[0],
                    _outputs_by_position(wrong, inputs)[0]) > 1e6 * REL_TOL


@needs_ckpts
def test_every_published_op_type_is_known() -> None:
    index = mirage_index()
    for name in FILES:
        text = (CKPTS / name).read_text()
        for op_type in _op_types(json.loads(text)):
            assert op_type in STRUCTURAL or op_type in index, op_type


def _op_types(doc: Any) -> set[str]:
    found: set[str] = set()
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("op_type"), str):
                found.add(x["op_type"])
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return found


@needs_ckpts
def test_import_is_deterministic() -> None:
    a = [serialize.dumps(g) for g in _import("gqa_bs8.json")]
    b = [serialize.dumps(g) for g in _import("gqa_bs8.json")]
    assert a == b


# ---------------------------------------------------------------------------
# The registry mapping
# ---------------------------------------------------------------------------


def test_mapping_comes_from_the_registry() -> None:
    index = mirage_index()
    assert index["tb_accum_nored_op"] == ("acc_sum", ())
    assert index["tb_forloop_accum_red_ld_rms_op"] == ("acc_rms_ld", ())
    assert index["tb_accum_redtox_ld_sum_op"] == ("acc_sum_to", ())
    assert index["kn_reduction_2_op"] == ("sum", (("dim", 2), ("keepdim", True)))
    assert index["tb_rms_norm_op"] == ("rms_norm", ())
    assert not set(index) & set(STRUCTURAL)


# ---------------------------------------------------------------------------
# Data type numbering
# ---------------------------------------------------------------------------


def _tiny(data_type: int = 921, accum: str = "tb_accum_nored_op") -> list[Any]:
    """One candidate: O = sum over iterations of X's tiles (X (8, 64) -> O (8, 64))."""
    def t(guid: int, dims: list[int], dev: bool = True) -> dict[str, Any]:
        return {"data_type": data_type, "dim": dims + [0] * (4 - len(dims)), "guid": guid,
                "layout": "DmemRowMajor" if dev else "SmemRowMajor", "num_dims": len(dims)}
    return [[
        {"op_type": "kn_input_op", "input_tensors": [], "output_tensors": [t(1, [8, 64])],
         "input_strides": [64, 1], "input_map": {"x": -1, "y": -1, "z": -1}},
        {"op_type": "kn_customized_op", "input_tensors": [t(1, [8, 64])],
         "output_tensors": [t(2, [8, 64])],
         "bgraph": {"grid_dim": {"x": 2, "y": 1, "z": 1}, "block_dim": {"x": 128, "y": 1,
                                                                      "z": 1},
                    "forloop_range": 1, "reduction_dimx": 64, "operators": [
                        {"op_type": "tb_input_op", "dtensor": t(1, [8, 64]),
                         "input_map": {"x": 0, "y": -1, "z": -1}, "forloop_dim": -1,
                         "input_tensors": [], "output_tensors": [t(10, [4, 64], False)]},
                        {"op_type": accum, "input_tensors": [t(10, [4, 64], False)],
                         "output_tensors": [t(11, [4, 64], False)]},
                        {"op_type": "tb_output_op", "dtensor": t(2, [8, 64]),
                         "input_tensors": [t(11, [4, 64], False)],
                         "output_map": {"x": 0, "y": -1, "z": -1}, "output_tensors": []}]}},
        {"op_type": "kn_output_op", "input_tensors": [t(2, [8, 64])], "output_tensors": [],
         "output_strides": [64, 1], "output_map": {"x": -1, "y": -1, "z": -1}},
    ]]


def _load(doc: Any, numbering: str | None = None) -> list[Graph]:
    return import_checkpoint(json.dumps(doc), "ckpt.json", numbering)


def test_tiny_checkpoint_is_the_identity() -> None:
    (g,) = _load(_tiny())
    x = interp.random_inputs(g, 0)["in0"]
    np.testing.assert_array_equal(interp.run(g, {"in0": x})["out0"], x)


@pytest.mark.parametrize("code, accum, numbering, dtype", [
    (921, "tb_accum_nored_op", None, DType.F16),
    (920, "tb_accum_nored_op", "2024", DType.BF16),
    (941, "tb_accum_nored_op", None, DType.F16),        # only 2025-02 has old names + 941
    (950, "tb_forloop_accum_nored_op", None, DType.F32),
    (940, "tb_forloop_accum_nored_op", "2025-06", DType.F16),
    (940, "tb_forloop_accum_nored_op", "2025-02", DType.BF16),
])
def test_data_type_numberings(code: int, accum: str, numbering: str | None,
                              dtype: DType) -> None:
    (g,) = _load(_tiny(code, accum), numbering)
    assert g.inputs[0].value.type.dtype is dtype


def test_ambiguous_data_type_is_an_error() -> None:
    with pytest.raises(MirageError, match="data_type 940 is ambiguous.*--mirage-dtypes"):
        _load(_tiny(940, "tb_forloop_accum_nored_op"))


def test_numberings_are_as_established() -> None:
    assert mirage_dtypes.NUMBERINGS["2024"][921] == "f16"
    assert mirage_dtypes.NUMBERINGS["2025-02"][941] == "f16"
    assert mirage_dtypes.NUMBERINGS["2025-06"][940] == "f16"


# ---------------------------------------------------------------------------
# Malformed checkpoints: exit 2 with a located message, never a traceback
# ---------------------------------------------------------------------------


def _bgraph_ops(doc: Any) -> list[Any]:
    return doc[0][1]["bgraph"]["operators"]


def _set(path: list[Any], value: Any) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        x = doc
        for key in path[:-1]:
            x = x[key]
        x[path[-1]] = value
    return edit


def _delete(path: list[Any]) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        x = doc
        for key in path[:-1]:
            x = x[key]
        del x[path[-1]]
    return edit


BLOCK = [0, 1, "bgraph"]
MALFORMED: list[tuple[str, Callable[[Any], None], str]] = [
    ("unknown-tb-op", _set(BLOCK + ["operators", 1, "op_type"], "tb_foo_op"),
     ("candidate 0, op 1 (kn_customized_op), block op 1 (tb_foo_op): unknown Mirage block "
      "operator 'tb_foo_op'")),
    ("unknown-kn-op", _set([0, 1, "op_type"], "kn_frobnicate_op"),
     "candidate 0, op 1 (kn_frobnicate_op): unknown Mirage kernel operator"),
    ("strides", _set([0, 0, "input_strides"], [1, 8]),
     ("candidate 0, op 0 (kn_input_op): input_strides [1, 8] for shape [8, 64] are not "
      "row-major contiguous")),
    ("output-strides", _set([0, 2, "output_strides"], [128, 1]),
     "output_strides [128, 1] for shape [8, 64] are not row-major"),
    ("missing-forloop", _delete(BLOCK + ["forloop_range"]),
     "candidate 0, op 1 (kn_customized_op), bgraph: missing field 'forloop_range'"),
    ("bad-dims", _set(BLOCK + ["operators", 0, "output_tensors", 0, "dim"], [8, 64, 0, 0]),
     "Mirage records f16[8, 64] but our semantics give f16[4, 64]"),
    ("num-dims", _set([0, 0, "output_tensors", 0, "num_dims"], 5), "num_dims 5 is out of range"),
    ("data-type", _set([0, 0, "output_tensors", 0, "data_type"], 900),
     ("candidate 0, op 0 (kn_input_op), output_tensors[0]: data_type 900 (int8) is not "
      "supported")),
    ("data-type-numbering", _set([0, 0, "output_tensors", 0, "data_type"], 935),
     "data_type codes [921, 935] fit none of Mirage's numberings 2024, 2025-02"),
    ("imap", _set(BLOCK + ["operators", 0, "input_map", "x"], 3),
     "imap of 'in0' maps grid axis x to dimension 3"),
    ("guid", _set(BLOCK + ["operators", 1, "input_tensors", 0, "guid"], 99),
     "block tensor guid 99 is not produced by an earlier block operator"),
    ("threads", _set(BLOCK + ["block_dim", "y"], 2), "only one-dimensional thread blocks"),
    ("forloop-0", lambda doc: (_set(BLOCK + ["forloop_range"], 0)(doc),
                               _set(BLOCK + ["operators", 0, "forloop_dim"], 1)(doc)),
     "forloop_range must be positive, got 0"),
    ("grid-0", _set(BLOCK + ["grid_dim", "x"], 0), "grid_dim must be positive"),
    ("binding", _set(BLOCK + ["operators", 0, "dtensor", "guid"], 2),
     "dtensor guid 2 is not the kernel's input 1 at this position"),
    ("extra-load", lambda doc: _bgraph_ops(doc).insert(1, copy.deepcopy(_bgraph_ops(doc)[0])),
     "more tb_input_ops than the kernel's 1 inputs"),
    ("no-store", lambda doc: _bgraph_ops(doc).pop(),
     ("the block graph loads 1 and stores 0 tensors, but the kernel has 1 inputs and 1 "
      "outputs")),
    ("use-before-def", lambda doc: doc[0].insert(0, doc[0].pop(1)),
     ("candidate 0, op 0 (kn_customized_op), input_tensors[0]: tensor guid 1 is not "
      "produced by an earlier operator")),
    ("distributed", _set([0, 0, "input_map", "x"], 0), "partitions the tensor over several GPUs"),
    ("not-a-list", lambda doc: doc.__setitem__(0, {"op_type": "kn_input_op"}),
     "candidate 0: expected a list of operators"),
    ("omap", _set(BLOCK + ["operators", 2, "output_map", "x"], -1),
     "blocks along it would overwrite each other"),
]


def _cli(args: list[str]) -> Any:
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("case, edit, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_checkpoint_exits_2(tmp_path: Path, case: str,
                                      edit: Callable[[Any], None], message: str) -> None:
    doc = _tiny()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    result = _cli(["import-mirage", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # undo the console's line wrapping
    assert f"{path}: error: " in text and message in text
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("[1,", "malformed JSON"),
    ('{"a": 1}', "not a Mirage checkpoint"),
    ("[]", "holds no candidates"),
])
def test_not_a_checkpoint_exits_2(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    result = _cli(["import-mirage", str(path)])
    assert result.exit_code == 2 and message in result.output


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_tiny()))
    assert _cli(["import-mirage", str(path), "--index", "3"]).exit_code == 2
    assert _cli(["import-mirage", str(path), "--json"]).exit_code == 2
    assert _cli(["import-mirage", str(tmp_path / "missing.json")]).exit_code == 2


def _leaves(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _leaves(v, prefix + (k,))] + [prefix]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _leaves(v, prefix + (i,))] + [prefix]
    return [prefix]


_TINY_PATHS = [p for p in _leaves(_tiny()) if p]
_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000),
                         st.floats(allow_nan=False), st.text(max_size=5),
                         st.lists(st.integers(-1, 70), max_size=5),
                         st.dictionaries(st.sampled_from(["x", "y", "z", "guid"]),
                                         st.integers(-2, 3), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_TINY_PATHS), _JSON_VALUES), min_size=1,
                max_size=3))
def test_any_corruption_is_a_diagnostic_not_a_crash(edits: list[tuple[Any, Any]]) -> None:
    doc = _tiny()
    for path, value in edits:
        try:
            _set(list(path), value)(doc)
        except (TypeError, KeyError, IndexError):
            pass  # an earlier edit replaced a container on this path
    try:
        _load(doc)
    except MirageError as e:
        assert e.file == "ckpt.json" and e.message


# ---------------------------------------------------------------------------
# Written files load back equal
# ---------------------------------------------------------------------------


@needs_ckpts
def test_written_files_load_back_equal(tmp_path: Path) -> None:
    src = str(CKPTS / "lora.json")
    graphs = _import("lora.json")
    result = _cli(["import-mirage", src, "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "4 candidate(s)" in result.output
    for i, g in enumerate(graphs):
        path = tmp_path / f"lora.{i}.ugraph.json"
        assert serialize.load(str(path)) == g
        assert path.read_text() == serialize.dumps(g)
        assert loading.load_graph(src, index=i) == g
    one = tmp_path / "one.ugraph.json"
    result = _cli(["import-mirage", src, "-o", str(one), "--index", "2", "--json"])
    assert result.exit_code == 0
    summary = json.loads(result.stdout)
    assert summary["candidates"] == 4
    assert summary["imported"] == [{"index": 2, "path": str(one), "kernels": 1,
                                    "custom_kernels": 1}]
    assert serialize.load(str(one)) == graphs[2]


@needs_ckpts
def test_stdout_holds_a_candidate_list(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["import-mirage", str(CKPTS / "single_lora.json")])
    assert result.exit_code == 0
    cands = serialize.loads_candidates(result.stdout)
    assert [g for g, _ in cands] == _import("single_lora.json")
    assert cands[0][1] == {"source": "single_lora.json", "index": 0}



def test_doc_table_matches_the_registry() -> None:
    """docs/mirage-import.md's operator table lists exactly the registry's mapping."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "mirage-import.md").read_text()
    section = doc.split("## Operator mapping", 1)[1].split("\n\n(", 1)[0]
    table: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        mirage_col, ours_col = line.strip("|").split("|")[:2]
        ours = ours_col.split("`")[1].split("(")[0]
        for name in mirage_col.split("`")[1::2]:
            for d in range(3) if "{d}" in name else [None]:
                table[name.format(d=d) if d is not None else name] = ours
    assert table == {m: ours for m, (ours, _) in mirage_index().items()}


@needs_ckpts
def test_a_checkpoint_in_the_current_spelling_imports_the_same() -> None:
    """Today's Mirage writes tb_forloop_accum_* and f16 = 940 (numbering 2025-06)."""
    text = (CKPTS / "single_lora.json").read_text()
    assert '"tb_accum_nored_op"' in text and '"data_type": 921' in text
    new = text.replace('"tb_accum_', '"tb_forloop_accum_').replace('"data_type": 921',
                                                                   '"data_type": 940')
    graphs = import_checkpoint(new, "single_lora.json", "2025-06")
    assert graphs == _import("single_lora.json")
    with pytest.raises(MirageError, match="ambiguous"):
        import_checkpoint(new, "single_lora.json")


@needs_ckpts
def test_the_numbering_option(tmp_path: Path) -> None:
    text = (CKPTS / "single_lora.json").read_text()
    path = tmp_path / "new.json"
    path.write_text(text.replace('"tb_accum_', '"tb_forloop_accum_')
                    .replace('"data_type": 921', '"data_type": 941'))
    bad = _cli(["import-mirage", str(path)])
    assert bad.exit_code == 2 and "--mirage-dtypes 2025-02 or 2025-06" in " ".join(
        bad.output.split())
    ok = _cli(["import-mirage", str(path), "--mirage-dtypes", "2025-06", "--index", "0"])
    assert ok.exit_code == 0
    assert '"dtype": "bf16"' in ok.stdout


@needs_ckpts
@pytest.mark.parametrize("name", FILES)
def test_imported_graphs_print_and_parse_back(name: str) -> None:
    """Every imported µGraph can be written as .mir (DESIGN §2) and read back equal."""
    from mirage_cli.parser import parse_text
    from mirage_cli.printer import print_graph

    for g in _import(name):
        assert parse_text(print_graph(g), f"{g.name}.mir") == g
