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


def host_names(prog: Program) -> dict[str, str]:
    """Entry-point parameter names: the tensor names where they are safe C
    identifiers, ``argN`` otherwise."""
    names: dict[str, str] = {}
    for k, b in enumerate(prog.inputs + prog.outputs):
        names[b.name] = b.name if is_safe_identifier(b.name) and b.name not in names.values() \
            else f"arg{k}"
    return names


def signature(prog: Program) -> str:
    hn = host_names(prog)
    parts = [f"const void* {hn[b.name]}" for b in prog.inputs]
    parts += [f"void* {hn[b.name]}" for b in prog.outputs]
    return ", ".join(parts + ["void* workspace", "cudaStream_t stream"])


def _pointer(prog: Program, name: str, hn: dict[str, str]) -> str:
    b = prog.buffer(name)
    if b.kind == "workspace":
        return f"mg_ws + {b.index}"
    return hn[name]


def _steps(prog: Program) -> list[dict[str, Any]]:
    hn = host_names(prog)
    out: list[dict[str, Any]] = []
    for s in prog.steps:
        if isinstance(s, Copy):
            src = next(b for b in prog.inputs if b.name == s.src)
            out.append({"is_copy": True, "smem_attr": False, "dst": hn[s.dst], "src": hn[src.name],
                        "nbytes": s.nbytes})
            continue
        assert isinstance(s, Launch)
        k = prog.kernel(s.kernel)
        args = []
        for p in k.params:
            ctype = p.ctype.replace(" __restrict__", "")
            ptr = f"mg_ws + {s.scratch_offset}" if p.arg == "$scratch" else _pointer(prog, p.arg, hn)
            args.append(f"({ctype})({ptr})")
        out.append({"is_copy": False, "kernel": k.name, "grid": list(k.grid), "threads": k.threads,
                    "smem": k.smem_bytes, "smem_attr": k.smem_bytes > SMEM_DEFAULT_LIMIT,
                    "args": args})
    return out


def _doc(bufs: tuple[Buffer, ...], hn: dict[str, str]) -> list[str]:
    return [f"{hn[b.name]}: {b.type}" + ("" if hn[b.name] == b.name else f" ('{b.name}')")
            for b in bufs]


def emit(prog: Program) -> tuple[str, str]:
    """The ``.cu`` and ``.h`` text of ``prog``."""
    sig = signature(prog)
    kernels = [{"name": k.name, "threads": k.threads, "comment": k.comment, "body": k.body,
                "params": [f"{p.ctype} {p.name}" for p in k.params]} for k in prog.kernels]
    summary = [f"kernel {k.name}: grid {list(k.grid)}, {k.threads} threads, "
               f"{k.smem_bytes} B dynamic shared memory" for k in prog.kernels]
    cu = templates.render("program.cu.j2", name=prog.name, version=__version__, signature=sig,
                          prelude=templates.render("prelude.cu.j2").rstrip("\n"),
                          kernels=kernels, steps=_steps(prog), summary=summary,
                          workspace_bytes=prog.workspace_bytes)
    hn = host_names(prog)
    h = templates.render("program.h.j2", name=prog.name, version=__version__, signature=sig,
                         guard=f"MIRAGE_{prog.name.upper()}_H",
                         doc_inputs=_doc(prog.inputs, hn), doc_outputs=_doc(prog.outputs, hn))
    return cu, h
