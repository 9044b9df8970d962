"""The NVRTC wrapper: compiling must leave the Python process intact."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

# An empty compile log is one byte (its NUL). Reading it into ``b" " * 1`` wrote that NUL
# into CPython's shared one-byte object b" ", after which every decoded space was "\0".
# Run in a child: a regression must not poison the test process.
_CHILD = """
from mirage_cli.codegen.nvrtc import _log, _nvrtc, compile_cuda
nv = _nvrtc()
err, prog = nv.nvrtcCreateProgram(b"__global__ void k() {}", b"k.cu", 0, [], [])
(res,) = nv.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90a"])
assert int(res) == 0, res
assert _log(nv, prog) == ""
nv.nvrtcDestroyProgram(prog)
cubin = compile_cuda('extern "C" __global__ void k(int* p) { *p = 1; }', "k.cu").cubin
assert cubin[:4] == b"\\x7fELF", cubin[:4]
print(repr(bytes([32]).decode()), repr(b"a b".split()[0] + bytes([32])))
"""


def test_compiling_leaves_the_one_byte_objects_alone() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "' ' b'a '"
