"""Code generation without a GPU: every example and hand-built µGraph lowers to CUDA
that NVRTC compiles for sm_80 and sm_90, deterministically; the header and the host
launcher build and link with nvcc; golden .cu files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from codegen_cases import CASES
from shared_data import MUGRAPHS

from mirage_cli import ops
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda, parse_resources
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").rglob("*.mir"))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
        return True
    except ImportError:
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC bindings missing")


def test_every_operator_has_a_cuda_entry() -> None:
    for name, opdef in ops.REGISTRY.items():
        assert opdef.cuda is not None, name
        if opdef.cuda.kind == "elementwise":
            assert opdef.cuda.expr and opdef.cuda.torch is not None, name
        if opdef.cuda.kind == "gather":
            assert opdef.cuda.gather is not None and opdef.cuda.torch is not None, name


def _sources(g, arch: str = "sm_90"):  # type: ignore[no-untyped-def]
    return emit(lower(g, arch))


@needs_nvrtc
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_compiles_for_sm80_and_sm90(path: Path) -> None:
    g = load_graph(str(path))
    cu, h = _sources(g)
    assert _sources(load_graph(str(path))) == (cu, h), "output is not deterministic"
    # Code is planned for its target: sm_90 kernels may use thread-block clusters.
    for arch in ("sm_80", "sm_90"):
        res = compile_cuda(_sources(g, arch)[0], f"{g.name}.cu", arch)
        assert res.cubin and len(res.resources) == len(lower(g, arch).kernels)
        assert all(r.spill_stores == 0 for r in res.resources), res.resources


@needs_nvrtc
@pytest.mark.parametrize("name", sorted(CASES))
def test_case_compiles(name: str) -> None:
    # Each target's own plan: an sm_90 plan may use bulk copies, which sm_80 lacks.
    for arch in ("sm_80", "sm_90"):
        cu, _ = _sources(CASES[name](), arch)
        assert compile_cuda(cu, f"{name}.cu", arch).cubin


@needs_nvrtc
def test_compile_error_is_located_in_the_source() -> None:
    src = "extern \"C\" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n"
    with pytest.raises(MirageError) as e:
        compile_cuda(src, "bad.cu", "sm_90")
    assert e.value.span is not None and (e.value.span.file, e.value.span.line) == ("bad.cu", 2)
    assert "undefined_name" in e.value.render()


def test_resource_report_is_parsed() -> None:
    log = ("ptxas info    : Compiling entry function 'k0' for 'sm_90'\n"
           "ptxas info    : Function properties for k0\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem\n")
    (r,) = parse_resources(log)
    assert (r.kernel, r.registers, r.smem_static, r.stack, r.spill_stores) == ("k0", 40, 512, 8, 4)


def test_bad_entry_names_are_rejected() -> None:
    g = CASES["passthrough"]()
    for bad in ("int", "exp", "sqrtf", "printf", "NULL", "int4", "EOF", "mg_x", "cudaFoo",
                "_X", "a__b", "x y", "p_checked", "1abc"):
        with pytest.raises(MirageError, match="--name"):
            lower(g, name=bad)
    assert lower(g, name="my_kernel").name == "my_kernel"


def test_default_entry_name_is_prefixed_with_the_abi() -> None:
    import dataclasses
    prog = lower(CASES["rmsnorm_linear_small"]())
    assert prog.name == "mirage_rmsnorm_linear_small_h4x64_h64x32_to_h4x32"
    assert all(k.name.startswith("mg_k") and k.name.endswith(prog.name) for k in prog.kernels)
    # A program named like a library function still gets a safe, prefixed symbol.
    assert lower(dataclasses.replace(CASES["passthrough"](), name="exp")).name.startswith(
        "mirage_exp_")


def test_header_declares_the_abi() -> None:
    prog = lower(CASES["rmsnorm_linear_small"]())
    cu, h = emit(prog)
    n = prog.name
    assert f"size_t {n}_workspace_bytes(void);" in h
    assert (f"cudaError_t {n}(const void* mg_in0_X, const void* mg_in1_W, void* mg_out0_Z, "
            "void* mg_workspace, cudaStream_t mg_stream);") in h
    assert f"cudaError_t {n}_checked(const void* mg_in0_X, const int64_t* mg_in0_X_shape" in h
    for const in (f"{n}_IN0_RANK = 2,", f"{n}_IN0_DIM0 = 4,", f"{n}_IN1_DIM1 = 32,",
                  f"{n}_OUT0_DTYPE = MIRAGE_DTYPE_F16,", f"{n}_NUM_INPUTS = 2,"):
        assert const in h, const
    assert f"#define {n}_WORKSPACE_BYTES ((size_t){prog.workspace_bytes}u)" in h
    host = cu[cu.index("#ifndef __CUDACC_RTC__"):]
    for banned in ("cudaMalloc", "cudaDeviceSynchronize", "cudaStreamSynchronize", "exit(",
                   "cudaGetLastError", "<<<"):
        assert banned not in host
    assert "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800\n#error" in cu


def _kernel_bodies(cu: str) -> list[list[str]]:
    """Each kernel's body in ``cu``, one statement per line, stripped."""
    import re

    return [[line.strip() for line in b.split("\n")]
            for b in re.findall(r'extern "C" __global__[^{]*\{\n(.*?)\n\}\n', cu, re.DOTALL)]


def test_kernels_are_launched_for_programmatic_dependent_launch() -> None:
    """Every kernel waits for the kernel before it in the stream before it reads any
    input, then lets the next one launch; the entry point asks for the overlapped launch
    only on compute capability 9.0+. Without inputs declared ``weight`` the first kernel
    reads nothing before its wait."""
    import re

    prog = lower(CASES["rmsnorm_linear_small"]())
    cu, _ = emit(prog)
    bodies = _kernel_bodies(cu)
    assert len(bodies) == len(prog.kernels)
    for body in bodies:
        assert body.count("mg_grid_wait();") == 1
        assert body[body.index("mg_grid_wait();") + 1] == "mg_grid_release();"
    first = bodies[0][:bodies[0].index("mg_grid_wait();")]
    assert not any(re.search(r"\bp\d+\b", line) for line in first)  # no parameter read
    assert 'asm volatile("griddepcontrol.wait;" ::: "memory");' in cu
    assert 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");' in cu
    host = cu[cu.index("#ifndef __CUDACC_RTC__"):]
    assert "cudaLaunchKernel(" not in host
    assert host.count("cudaLaunchKernelExC(") == len(prog.kernels)
    assert "mg_cfg.numAttrs = (mg_state & 2) ? 1 : 0;" in host
    assert "*mg_state = 1 | (mg_major >= 9 ? 2 : 0);" in host


def test_user_names_reach_generated_files_only_escaped() -> None:
    """Hostile tensor and program names: a newline, a macro, a trigraph and a line
    splice appear only escaped inside comments; parameters are minted."""
    import dataclasses

    from mirage_cli.builder import GraphBuilder
    evil = "x\n#define sqrtf(v) 0\\"
    b = GraphBuilder("p\n#include </etc/passwd>??/")
    x = b.input(evil, (4, 8), "f32")
    b.output(b.op("exp", x))
    g = b.build()
    cu, h = emit(lower(g))
    for text in (cu, h):
        lines = [ln.strip() for ln in text.splitlines()]
        assert not any(ln.startswith(("#define sqrtf", "#include </etc")) for ln in lines)
        assert "x\\x0a#define sqrtf(v) 0\\x5c" in text  # the name, escaped, in a comment
        assert "??/" not in text
        assert all(not line.rstrip().endswith("\\") for line in text.splitlines())
    assert "mg_in0_x_define_sqrtf_v_0" in h
    if _nvrtc_available():
        assert compile_cuda(cu, "hostile.cu", "sm_80").cubin
    g2 = dataclasses.replace(g, name="ok")
    assert "'ok'" in emit(lower(g2))[1]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden_cu(path: Path) -> None:
    base = ROOT / "golden" / path.relative_to(ROOT / "examples")
    cu_path, h_path = base.with_suffix(".cu"), base.with_suffix(".h")
    cu, h = _sources(load_graph(str(path)))
    assert cu_path.read_text() == cu, f"{cu_path} differs: run `make golden` and review"
    assert h_path.read_text() == h, f"{h_path} differs: run `make golden` and review"


CHECKPOINTS = sorted(MUGRAPHS.glob("*.json"))


def _compile_both(srcs: tuple[str, str]) -> str:
    """'' if the sources planned for sm_80 and sm_90 compile for their targets (ptxas at
    -O0: validity, not speed), else the error."""
    try:
        for arch, src in zip(("sm_80", "sm_90"), srcs):
            compile_cuda(src, "candidate.cu", arch, extra=("--ptxas-options=-O0",))
    except MirageError as e:
        return e.render()
    return ""


@needs_nvrtc
@pytest.mark.slow
@pytest.mark.skipif(not CHECKPOINTS, reason="Mirage checkpoints not found")
def test_every_imported_mirage_candidate_compiles() -> None:
    import multiprocessing

    from mirage_cli.loading import load_graphs

    graphs = [g for p in CHECKPOINTS for g in load_graphs(str(p))]
    sources = [(_sources(g, "sm_80")[0], _sources(g, "sm_90")[0]) for g in graphs]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        errors = pool.map(_compile_both, sources)
    bad = [(g.name, e) for g, e in zip(graphs, errors) if e]
    assert len(graphs) >= 100 and not bad, bad[:3]


def test_a_tile_stored_as_its_reciprocal_inverts_its_whole_value() -> None:
    """A reduction stored as its reciprocal (its only readers divide by it) inverts its
    whole value: a mean's ``sum / n`` as ``mg_rcp(sum / n)``, not ``1.0f / sum / n``
    (65536 times too small for a 256-long row), and a square root as one rsqrtf."""
    import re

    from mirage_cli.codegen.expr import reciprocal

    assert reciprocal("r5 / 128.0f") == "mg_rcp(r5 / 128.0f)"
    assert reciprocal("a[1] + b") == "mg_rcp(a[1] + b)"
    assert reciprocal("(v1 * v2)") == "mg_rcp((v1 * v2))"
    assert reciprocal("buf_b7[row]") == "mg_rcp(buf_b7[row])"
    assert reciprocal("sqrtf(r / 64.0f + 0.0f)") == "rsqrtf(r / 64.0f + 0.0f)"
    assert reciprocal("sqrtf(a) * sqrtf(b)") == "mg_rcp(sqrtf(a) * sqrtf(b))"
    cu, _ = _sources(CASES["divide_by_mean"]())
    assert re.search(r"buf_b\d+\[row\] = mg_rcp\(r\d+ / 128\.0f\);", cu)


def test_the_tiles_the_grid_reads_once_are_copied_to_leave_the_l2_first() -> None:
    """gated_mlp's weights (split over the grid's blocks and the forloop: each element
    read by one block) come by bulk copies hinted evict-first; X, which every block
    reads, by plain ones."""
    import re

    from mirage_cli.codegen import staging

    g = load_graph(str(Path(__file__).parent.parent / "examples/mugraphs/gated_mlp_fused.mir"),
                   {"batch": 8})
    op = next(o for o in g.ops if o.block is not None)
    assert op.block is not None
    once = {bi.source: staging.read_once(op.block.grid, bi) for bi in op.block.inputs}
    assert once == {"X": False, "W1": True, "W2": True}
    cu, _ = _sources(g)
    params = re.findall(r"const __grid_constant__ mg_tmap (p\d+)", cu)
    hinted = {p for p in params if re.search(rf"mg_tma[23]<true>\([^;]*&{p},", cu)}
    plain = {p for p in params if re.search(rf"mg_tma[23]\([^;]*&{p},", cu)}
    assert len(hinted) == 2 and not hinted & plain, (hinted, plain)
