"""Per-architecture limits, in one place: the planner, the cost model and the code
generator all read them from here, so they agree on what fits in a block.

Figures are the CUDA programming guide's limits per compute capability (what a block
may opt in to with ``cudaFuncSetAttribute``), not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli.diagnostics import MirageError


@dataclass(frozen=True)
class Arch:
    name: str                 # "sm_80", "sm_90"
    smem_per_block: int       # bytes of dynamic shared memory a block may opt in to
    smem_per_sm: int          # bytes of shared memory per multiprocessor
    regs_per_thread: int      # the most registers one thread may use
    regs_per_sm: int
    num_sms: int              # of the part the defaults are tuned for
    max_threads_per_sm: int


ARCHS = {
    # A100: 164 KB per SM, 163 KB per block.
    "sm_80": Arch("sm_80", 163 * 1024, 164 * 1024, 255, 65536, 108, 2048),
    # H100 / H200: 228 KB per SM, 227 KB per block.
    "sm_90": Arch("sm_90", 227 * 1024, 228 * 1024, 255, 65536, 132, 2048),
}

DEFAULT_ARCH = "sm_90"


def get(name: str) -> Arch:
    """The limits of ``name``, or a diagnostic listing the supported targets."""
    try:
        return ARCHS[name]
    except KeyError:
        raise MirageError(f"unsupported target '{name}' (supported: "
                          f"{', '.join(sorted(ARCHS))}; sm_80 or newer is required)") from None
