"""Rendering of a lowered :class:`~mirage_cli.codegen.plan.Program` as CUDA C++.

``emit(prog)`` returns the text of ``<stem>.cu`` and ``<stem>.h`` (DESIGN.md §5);
``emit_hpp(prog, header)`` the optional typed C++ interface ``<stem>.hpp``:
- ``.cu``: device code that compiles under NVRTC and nvcc (an ``#error`` below sm_80)
  and a host launcher guarded by ``#ifndef __CUDACC_RTC__``: the entry point, a
  checked variant that compares shapes, and the workspace size;
- ``.h``: those declarations with ``extern "C"``, and every argument's rank, shape,
  dtype and size as constants usable from C and C++.
Every identifier in these files is minted by :mod:`names` from the entry name;
user text appears only in escaped comments. Output depends only on the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mirage_cli import __version__
from mirage_cli.codegen import templates
from mirage_cli.codegen.indexing import INT_MAX
from mirage_cli.codegen.names import comment_text, param_names
from mirage_cli.codegen.plan import Buffer, Copy, Launch, Program, TensorMapSpec
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import DType

SMEM_DEFAULT_LIMIT = 48 * 1024
_DTYPE_CODE = {DType.F16: "MIRAGE_DTYPE_F16", DType.BF16: "MIRAGE_DTYPE_BF16",
               DType.F32: "MIRAGE_DTYPE_F32"}
_CPP_TYPE = {DType.F16: "__half", DType.BF16: "__nv_bfloat16", DType.F32: "float"}


@dataclass(frozen=True)
class Arg:
    """One entry-point argument as the templates print it (plain values only)."""

    param: str        # minted C parameter name
    const: str        # "const " for inputs, "" for outputs
    short: str        # in0 / out0
    macro: str        # constant prefix: <entry>_IN0 / <entry>_OUT0
    shape: list[int]
    dtype_code: str
    cpp_type: str
    nbytes: int
    doc: str          # escaped: "input 0 'X': f16[16, 4096]"


def host_names(prog: Program) -> tuple[list[str], list[str]]:
    """Entry-point parameter names of the inputs and of the outputs (an output that is
    also an input still gets its own parameter)."""
    return param_names([b.name for b in prog.inputs], [b.name for b in prog.outputs])


def args(prog: Program) -> list[Arg]:
    """Every argument of the entry point, inputs first."""
    ins, outs = host_names(prog)
    out: list[Arg] = []
    for kind, bufs, names in (("in", prog.inputs, ins), ("out", prog.outputs, outs)):
        for k, (b, n) in enumerate(zip(bufs, names)):
            _check_dims(b)
            word = "input" if kind == "in" else "output"
            out.append(Arg(n, "const " if kind == "in" else "", f"{kind}{k}",
                           f"{prog.name}_{kind.upper()}{k}",
                           list(b.type.shape), _DTYPE_CODE[b.type.dtype],
                           _CPP_TYPE[b.type.dtype], b.type.nbytes,
                           f"{word} {k} '{comment_text(b.name)}': {b.type}"
                           + (_WEIGHT_NOTE if b.weight else "")))
    return out


# What a `weight` input asks of the caller (docs/language.md), said where it is passed.
_WEIGHT_NOTE = (" (weight: read before the kernel launched just before this call in the "
                "same stream has finished, which must not write it)")


def _check_dims(b: Buffer) -> None:
    if any(d > INT_MAX for d in b.type.shape):
        raise MirageError(f"tensor '{comment_text(b.name)}' has a dimension of 2^31 or more, "
                          f"which the header's int constants cannot hold")


def signature(prog: Program) -> str:
    ins, outs = host_names(prog)
    parts = [f"const void* {n}" for n in ins] + [f"void* {n}" for n in outs]
    return ", ".join(parts + ["void* mg_workspace", "cudaStream_t mg_stream"])


def checked_signature(prog: Program) -> str:
    parts = [f"{a.const}void* {a.param}, const int64_t* {a.param}_shape, int {a.param}_rank"
             for a in args(prog)]
    return ", ".join(parts + ["void* mg_workspace", "size_t mg_workspace_size",
                              "cudaStream_t mg_stream"])


def _pointer(prog: Program, name: str) -> str:
    """The host expression of device tensor ``name``: kernels read inputs and write
    outputs or workspace temporaries, an alias where its buffer is."""
    name = prog.storage(name)
    ins, outs = host_names(prog)
    for b, n in zip(prog.inputs, ins):
        if b.name == name:
            return n
    for b, n in zip(prog.outputs, outs):
        if b.name == name:
            return n
    return f"mg_ws + {prog.buffer(name).index}"


def _steps(prog: Program) -> list[dict[str, Any]]:
    ins, outs = host_names(prog)
    out: list[dict[str, Any]] = []
    for s in prog.steps:
        if isinstance(s, Copy):
            dst = outs[[b.name for b in prog.outputs].index(s.dst)]
            src = ins[[b.name for b in prog.inputs].index(s.src)]
            out.append({"is_copy": True, "dst": dst, "src": src, "nbytes": s.nbytes})
            continue
        assert isinstance(s, Launch)
        k = prog.kernel(s.kernel)
        kargs = []
        for p in k.params:
            ctype = p.ctype.replace(" __restrict__", "")
            ptr = f"mg_ws + {s.scratch_offset}" if p.arg == "$scratch" else _pointer(prog, p.arg)
            kargs.append({"ctype": ctype, "expr": ptr, "tmap": _tmap_args(p.tmap)})
        out.append({"is_copy": False, "kernel": k.name, "grid": list(k.grid),
                    "threads": k.threads, "smem": k.smem_bytes, "args": kargs})
    return out


def _tmap_args(spec: TensorMapSpec | None) -> dict[str, Any] | None:
    """What the launcher passes to ``cuTensorMapEncodeTiled`` for a tensor-map parameter."""
    if spec is None:
        return None
    return {"dtype": spec.dtype_enum, "rank": len(spec.dims),
            "dims": ", ".join(map(str, spec.dims)), "strides": ", ".join(map(str, spec.strides)),
            "box": ", ".join(map(str, spec.box)), "swizzle": spec.swizzle_enum}


def _big_smem(prog: Program) -> list[dict[str, Any]]:
    """Kernels whose dynamic shared memory needs the per-device attribute raised."""
    return [{"kernel": k.name, "smem": k.smem_bytes} for k in prog.kernels
            if k.smem_bytes > SMEM_DEFAULT_LIMIT]


def _common(prog: Program) -> dict[str, Any]:
    return {"name": prog.name, "version": __version__,
            "source": comment_text(prog.source_name or prog.name),
            "signature": signature(prog), "checked_signature": checked_signature(prog),
            "args": args(prog), "workspace_bytes": prog.workspace_bytes,
            "guard": f"MIRAGE_GENERATED_{prog.name}"}


def emit(prog: Program) -> tuple[str, str]:
    """The ``.cu`` and ``.h`` text of ``prog``."""
    common = _common(prog)
    kernels = [{"name": k.name, "comment": comment_text(k.comment),
                "bounds": f"{k.threads}, {k.min_blocks}" if k.min_blocks else str(k.threads),
                "attrs": f"__cluster_dims__(1, 1, {k.cluster}) " if k.cluster > 1 else "",
                "pre": k.body[:k.wait_at], "body": k.body[k.wait_at:],
                "wait": not k.waits_inside,
                "params": [f"{p.ctype} {p.name}" for p in k.params]}
               for k in prog.kernels]
    summary = [f"kernel {k.name}: grid {list(k.grid)}, {k.threads} threads, "
               f"{k.smem_bytes} B dynamic shared memory" for k in prog.kernels]
    cu = templates.render("program.cu.j2", **common,
                          prelude=templates.raw("prelude.cuh").rstrip("\n"),
                          kernels=kernels, steps=_steps(prog), summary=summary,
                          big_smem=_big_smem(prog),
                          clusters=any(k.cluster > 1 for k in prog.kernels),
                          tmaps=any(p.tmap for k in prog.kernels for p in k.params))
    h = templates.render("program.h.j2", **common)
    return cu, h


def emit_hpp(prog: Program, header: str) -> str:
    """The optional typed C++ interface (``<stem>.hpp``), which includes ``header``."""
    if not all(c.isalnum() or c in "._-" for c in header):
        raise MirageError(f"header file name {comment_text(header)!r}: use letters, digits, "
                          f"'.', '_' and '-' to get a typed .hpp that includes it")
    return templates.render("program.hpp.j2", **_common(prog), header=header)
