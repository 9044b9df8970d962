"""Lowering of a whole µGraph to a :class:`~mirage_cli.codegen.plan.Program`.

Expects a checked graph. Every kernel operator becomes one kernel: custom operators
through :mod:`fused`, pre-defined ones through :mod:`standalone`. Device tensors that
are neither inputs nor outputs live in the workspace (256-byte aligned), followed by
each fused kernel's per-block scratch area. ``unfused`` is the baseline lowering of a
program without custom kernels (the same thing; named for the benchmark).
"""

from __future__ import annotations

from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.kernel import lower_custom
from mirage_cli.codegen.plan import Buffer, Copy, Kernel, Launch, Program, align
from mirage_cli.codegen.standalone import lower_kernel_op
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph

C_KEYWORDS = frozenset(["alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break", "case", "catch", "char", "char16_t", "char32_t", "char8_t", "class", "compl", "concept", "const", "const_cast", "consteval", "constexpr", "constinit", "continue", "co_await", "co_return", "co_yield", "decltype", "default", "delete", "do", "double", "dynamic_cast", "else", "enum", "explicit", "export", "extern", "false", "float", "for", "friend", "goto", "if", "inline", "int", "long", "mutable", "namespace", "new", "noexcept", "not", "not_eq", "nullptr", "operator", "or", "or_eq", "private", "protected", "public", "register", "reinterpret_cast", "requires", "restrict", "return", "short", "signed", "sizeof", "static", "static_assert", "static_cast", "struct", "switch", "template", "this", "thread_local", "throw", "true", "try", "typedef", "typeid", "typename", "union", "unsigned", "using", "virtual", "void", "volatile", "wchar_t", "while", "xor", "xor_eq", "main", "workspace", "stream", "dim3", "size_t"])


def is_safe_identifier(name: str) -> bool:
    """A name that can appear in generated C++ as is."""
    return (name.isidentifier() and name.isascii() and name not in C_KEYWORDS
            and not name.startswith(("mg_", "__", "cuda", "cu")) and not name.startswith("_"))


def c_name(name: str) -> str:
    """The program name as a C identifier, or a diagnostic."""
    if not is_safe_identifier(name):
        raise MirageError(f"program name '{name}' cannot be a C function name (use letters, "
                          f"digits and '_', not a C++ keyword, not starting with 'mg_', "
                          f"'cu' or '_')")
    return name


def lower(g: Graph, arch: str = DEFAULT_ARCH) -> Program:
    name = c_name(g.name)
    types = g.tensor_types()
    inputs = tuple(Buffer(i.value.name, i.value.type, "input", k)
                   for k, i in enumerate(g.inputs))
    outputs = tuple(Buffer(n, types[n], "output", k) for k, n in enumerate(g.outputs))
    external = {b.name for b in inputs + outputs}
    temps: list[Buffer] = []
    ws = 0
    for op in g.ops:
        for v in op.outputs:
            if v.name not in external:
                temps.append(Buffer(v.name, v.type, "workspace", ws))
                ws = align(ws + v.type.nbytes)
    kernels: list[Kernel] = []
    steps: list[Launch | Copy] = []
    for i, op in enumerate(g.ops):
        kname = f"{name}_k{i}"
        if op.block is not None:
            k = lower_custom(op, kname, types, arch)
        else:
            k = lower_kernel_op(op, kname, types)
        kernels.append(k)
        steps.append(Launch(k.name, ws))
        ws = align(ws + k.scratch_bytes * k.grid[0] * k.grid[1] * k.grid[2])
    produced = {v.name for op in g.ops for v in op.outputs}
    for n in g.outputs:
        if n not in produced:  # an output that is an input: copy it
            steps.append(Copy(n, n, types[n].nbytes))
    return Program(name, inputs, outputs, tuple(temps), tuple(kernels), tuple(steps), ws)
