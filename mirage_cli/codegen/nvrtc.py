"""Compilation of generated CUDA to a cubin through NVRTC (cuda-python bindings).

Needs no CUDA toolkit and no GPU: NVRTC comes from the ``nvidia-cuda-nvrtc`` wheels
(CUDA 12 or 13) and the generated device code includes no header. Compiler errors
become a :class:`MirageError` located in the ``.cu`` file; ptxas' resource report
(registers, shared memory, stack, spills) is parsed per kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mirage_cli.diagnostics import MirageError, Span

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100")


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc  # cuda-bindings >= 12.6
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[no-redef]  # older cuda-python
        except ImportError:
            raise MirageError("NVRTC is not available: mirage-cli depends on cuda-bindings "
                              "and nvidia-cuda-nvrtc-cu12; reinstall it (pip install "
                              "mirage-cli, or 'mirage-cli[cuda13]' for CUDA 13)") from None
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nv = _nvrtc()
    err, major, minor = nv.nvrtcVersion()
    _check(nv, err, "nvrtcVersion")
    return int(major), int(minor)


def _check(nv: Any, err: Any, what: str) -> None:
    if int(err) != 0:
        _, msg = nv.nvrtcGetErrorString(err)
        raise MirageError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")


@dataclass(frozen=True)
class Resources:
    kernel: str
    registers: int
    smem_static: int
    stack: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str
    resources: tuple[Resources, ...]


def machine_arch(arch: str) -> str:
    """The NVRTC target for ``arch``: sm_90 code is built for sm_90a, the arch-specific
    target of the same GPUs, so that the kernels' wgmma paths (``#if
    __CUDA_ARCH_FEAT_SM90_ALL``) are compiled; a cubin is only ever loaded on the GPU it
    was built for. Built by another compiler for plain sm_90, the same source takes its
    mma.sync paths."""
    return "sm_90a" if arch == "sm_90" else arch


def compile_cuda(source: str, filename: str, arch: str = "sm_90",
                 extra: tuple[str, ...] = (), exact: bool = False) -> Compiled:
    """Compile ``source`` (named ``filename`` in diagnostics) for ``arch`` (its
    :func:`machine_arch`, unless ``exact``)."""
    if arch not in ARCHS:
        raise MirageError(f"unknown --arch '{arch}' (expected one of {', '.join(ARCHS)})")
    nv = _nvrtc()
    err, prog = nv.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], [])
    _check(nv, err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch if exact else machine_arch(arch)}", "--std=c++17",
                "--ptxas-options=-v", *extra]
        (res,) = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _log(nv, prog)
        if int(res) != 0:
            raise _compile_error(log, filename, source)
        err, size = nv.nvrtcGetCUBINSize(prog)
        _check(nv, err, "nvrtcGetCUBINSize")
        buf = bytearray(size)
        (err,) = nv.nvrtcGetCUBIN(prog, buf)
        _check(nv, err, "nvrtcGetCUBIN")
        return Compiled(bytes(buf), log, parse_resources(log))
    finally:
        nv.nvrtcDestroyProgram(prog)


def _log(nv: Any, prog: Any) -> str:
    err, size = nv.nvrtcGetProgramLogSize(prog)
    _check(nv, err, "nvrtcGetProgramLogSize")
    # NVRTC writes into the buffer: a bytearray, never a bytes object. ``b" " * 1`` is
    # CPython's shared one-byte b" ", and an empty log's NUL written into it turned
    # every later decoded space into "\0" (PyTorch then failed to import in `bench`).
    buf = bytearray(size)
    nv.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00").decode(errors="replace")


_ERR = re.compile(r"^(?P<file>.*?)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<msg>.*)$",
                  re.MULTILINE)


def _compile_error(log: str, filename: str, source: str) -> MirageError:
    m = _ERR.search(log)
    notes = tuple(ln for ln in log.splitlines() if ln.strip())[1:12]
    if m is None:
        return MirageError(f"NVRTC failed:\n{log.strip()}", file=filename)
    span = Span(filename, int(m["line"]), 1)
    return MirageError(f"NVRTC: {m['msg']}", span, source=source, notes=notes)


_FN = re.compile(r"Compiling entry function '(?P<k>[^']+)'")
_PROPS = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<ss>\d+) bytes spill stores, "
                    r"(?P<sl>\d+) bytes spill loads")
_USED = re.compile(r"Used (?P<regs>\d+) registers(?:.*?(?P<smem>\d+) bytes smem)?")


def parse_resources(log: str) -> tuple[Resources, ...]:
    """Per-kernel resources from ptxas' verbose output."""
    out: list[Resources] = []
    kernel, stack, ss, sl = None, 0, 0, 0
    for line in log.splitlines():
        if (m := _FN.search(line)):
            kernel, stack, ss, sl = m["k"], 0, 0, 0
        elif (m := _PROPS.search(line)) and kernel:
            stack, ss, sl = int(m["stack"]), int(m["ss"]), int(m["sl"])
        elif (m := _USED.search(line)) and kernel:
            out.append(Resources(kernel, int(m["regs"]), int(m["smem"] or 0), stack, ss, sl))
            kernel = None
    return tuple(out)
