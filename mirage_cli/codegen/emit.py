"""Rendering of a lowered :class:`~mirage_cli.codegen.plan.Program` as CUDA C++.

``emit(prog)`` returns the text of ``<name>.cu`` and ``<name>.h`` (DESIGN.md §5):
device code that compiles under NVRTC and nvcc, a host launcher guarded by
``#ifndef __CUDACC_RTC__`` with an ``extern "C"`` entry point, and the header that
declares it. Output depends only on the program: byte-identical for equal input.
"""

from __future__ import annotations

from typing import Any

from mirage_cli import __version__
from mirage_cli.codegen import templates
from mirage_cli.codegen.lower import is_safe_identifier
from mirage_cli.codegen.plan import Buffer, Copy, Launch, Program

SMEM_DEFAULT_LIMIT = 48 * 1024


def host_names(prog: Program) -> tuple[list[str], list[str]]:
    """Entry-point parameter names of the inputs and of the outputs: the tensor names
    where they are safe C identifiers and unique, ``argN`` otherwise (an output may
    also be an input: it still gets its own parameter)."""
    names: list[str] = []
    for k, b in enumerate(prog.inputs + prog.outputs):
        names.append(b.name if is_safe_identifier(b.name) and b.name not in names else f"arg{k}")
    return names[:len(prog.inputs)], names[len(prog.inputs):]


def signature(prog: Program) -> str:
    ins, outs = host_names(prog)
    parts = [f"const void* {n}" for n in ins] + [f"void* {n}" for n in outs]
    return ", ".join(parts + ["void* workspace", "cudaStream_t stream"])


def _pointer(prog: Program, name: str) -> str:
    """The host expression of device tensor ``name``: kernels read inputs and write
    outputs or workspace temporaries."""
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
            out.append({"is_copy": True, "smem_attr": False, "dst": dst, "src": src,
                        "nbytes": s.nbytes})
            continue
        assert isinstance(s, Launch)
        k = prog.kernel(s.kernel)
        args = []
        for p in k.params:
            ctype = p.ctype.replace(" __restrict__", "")
            ptr = f"mg_ws + {s.scratch_offset}" if p.arg == "$scratch" else _pointer(prog, p.arg)
            args.append(f"({ctype})({ptr})")
        out.append({"is_copy": False, "kernel": k.name, "grid": list(k.grid), "threads": k.threads,
                    "smem": k.smem_bytes, "smem_attr": k.smem_bytes > SMEM_DEFAULT_LIMIT,
                    "args": args})
    return out


def _doc(bufs: tuple[Buffer, ...], names: list[str]) -> list[str]:
    return [f"{n}: {b.type}" + ("" if n == b.name else f" ('{b.name}')")
            for b, n in zip(bufs, names)]


def emit(prog: Program) -> tuple[str, str]:
    """The ``.cu`` and ``.h`` text of ``prog``."""
    sig = signature(prog)
    kernels = [{"name": k.name, "comment": k.comment, "body": k.body,
                "bounds": f"{k.threads}, {k.min_blocks}" if k.min_blocks else str(k.threads),
                "params": [f"{p.ctype} {p.name}" for p in k.params]} for k in prog.kernels]
    summary = [f"kernel {k.name}: grid {list(k.grid)}, {k.threads} threads, "
               f"{k.smem_bytes} B dynamic shared memory" for k in prog.kernels]
    cu = templates.render("program.cu.j2", name=prog.name, version=__version__, signature=sig,
                          prelude=templates.raw("prelude.cuh").rstrip("\n"),
                          kernels=kernels, steps=_steps(prog), summary=summary,
                          workspace_bytes=prog.workspace_bytes)
    ins, outs = host_names(prog)
    h = templates.render("program.h.j2", name=prog.name, version=__version__, signature=sig,
                         guard=f"MIRAGE_{prog.name.upper()}_H",
                         doc_inputs=_doc(prog.inputs, ins), doc_outputs=_doc(prog.outputs, outs))
    return cu, h
