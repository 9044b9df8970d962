"""The lowered program: kernels with their launch sequence, as plain data.

:mod:`mirage_cli.codegen.lower` produces a :class:`Program`; :mod:`emit` renders it
as CUDA C++ (device code and host launcher) and :mod:`runner` executes the same
launch sequence through the driver API, so both agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mirage_cli.ir import DType, TensorType


@dataclass(frozen=True)
class TensorMapSpec:
    """What the launcher encodes into a ``CUtensorMap`` for bulk tensor copies of a
    device tensor (codegen/tmaplan.py); innermost dimension first, as the driver takes
    them."""

    dtype: DType
    dims: tuple[int, ...]        # elements per dimension
    strides: tuple[int, ...]     # bytes between consecutive indices of dims 1..rank-1
    box: tuple[int, ...]         # elements per box dimension
    swizzle: int                 # bytes per box row: 32, 64, 128 swizzled, else plain

    @property
    def dtype_enum(self) -> str:
        """The ``CUtensorMapDataType`` enumerator's name."""
        return f"CU_TENSOR_MAP_DATA_TYPE_{TMAP_DTYPES[self.dtype]}"

    @property
    def swizzle_enum(self) -> str:
        """The ``CUtensorMapSwizzle`` enumerator's name."""
        if not swizzled(self.swizzle):
            return "CU_TENSOR_MAP_SWIZZLE_NONE"
        return f"CU_TENSOR_MAP_SWIZZLE_{self.swizzle}B"


# The swizzle spans of bulk tensor copies' boxes (bytes per box row), widest first. A
# box of another row width (tmaplan.swizzle_of) is copied unswizzled.
SWIZZLE_SPANS = (128, 64, 32)


def swizzled(span: int) -> bool:
    """Whether boxes of ``span`` bytes per row are XOR-swizzled (else plain rows)."""
    return span in SWIZZLE_SPANS


# The dtypes bulk tensor copies move, by their CUtensorMapDataType suffix.
TMAP_DTYPES = {DType.F16: "FLOAT16", DType.BF16: "BFLOAT16"}


@dataclass(frozen=True)
class Param:
    """A kernel parameter: C type and name, bound to ``arg`` at launch.

    ``arg`` names a device tensor of the program, or ``"$scratch"`` for the kernel's
    per-block scratch area in the workspace. With ``tmap``, the parameter is the tensor
    map of ``arg`` (passed by value), not its address."""

    ctype: str
    name: str
    arg: str
    tmap: TensorMapSpec | None = None


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Param, ...]
    body: tuple[str, ...]
    threads: int
    grid: tuple[int, int, int]
    smem_bytes: int
    scratch_bytes: int
    comment: str
    plan: dict[str, Any] | None = None  # a fused kernel's plan (KernelPlan.as_json())
    # __launch_bounds__ minimum blocks per SM (0: none). Fused kernels say 1: they hold
    # their state in registers and run one or two blocks per SM anyway, and without it
    # ptxas may cap registers low enough to spill the mma fragments.
    min_blocks: int = 0
    cluster: int = 1  # blocks of a thread-block cluster along grid z (__cluster_dims__)
    # Lines of ``body`` before the grid-dependency wait (emit.py places it): on sm_90
    # a kernel may issue copies of inputs that no earlier kernel can be writing before
    # it waits for the kernel ahead of it in the stream (codegen/kernel.py, early).
    wait_at: int = 0
    # A grouped launch (codegen/grouping.py): each member's body waits where it would
    # alone, so the kernel has no wait of its own.
    waits_inside: bool = False


@dataclass(frozen=True)
class Buffer:
    """Where a device tensor lives: an argument of the entry point or the workspace."""

    name: str
    type: TensorType
    kind: Literal["input", "output", "workspace"]
    index: int  # position among inputs/outputs, or byte offset in the workspace
    weight: bool = False  # an input declared `weight` (read before the wait)


@dataclass(frozen=True)
class Launch:
    kernel: str
    scratch_offset: int  # byte offset of the kernel's scratch in the workspace


@dataclass(frozen=True)
class Copy:
    """A device-to-device copy (an output that is also an input or another output)."""

    dst: str
    src: str
    nbytes: int


@dataclass(frozen=True)
class Program:
    """A lowered µGraph. ``name`` is the entry point's C name (minted by
    :mod:`names`, never user text); kernels are named from it."""

    name: str
    inputs: tuple[Buffer, ...]
    outputs: tuple[Buffer, ...]
    temps: tuple[Buffer, ...]
    kernels: tuple[Kernel, ...]
    steps: tuple[Launch | Copy, ...]
    workspace_bytes: int
    arch: str = "sm_90"    # the target GPU the plan is made for (sm_80, sm_90)
    source_name: str = ""  # the µGraph's own name: user text, for comments only
    # Tensors stored in another's buffer (a reshape that launches nothing:
    # codegen/aliasing.py), each with the tensor whose buffer it is.
    aliases: tuple[tuple[str, str], ...] = ()
    # The µGraph's kernel operators (by index) that each launch step runs: one, or
    # several sharing one launch (codegen/grouping.py); in the order of ``steps``.
    launch_ops: tuple[tuple[int, ...], ...] = ()

    def storage(self, name: str) -> str:
        """The tensor whose buffer holds ``name`` (``name`` itself but for aliases)."""
        return dict(self.aliases).get(name, name)

    def buffer(self, name: str) -> Buffer:
        for b in self.inputs + self.outputs + self.temps:
            if b.name == name:
                return b
        raise KeyError(name)

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)


ALIGN = 256


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a
