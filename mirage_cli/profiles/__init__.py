"""Device profiles: the cost model's figures for one GPU, as data shipped in the package.

``h100.json`` holds the model's original constants (H100 SXM figures, never measured
against a kernel); ``h200.json`` starts from the H200 data sheet and the bench's
measured copy bandwidth; ``mirage calibrate --gpu N -o device.json`` writes a profile
measured on a device (and, with ``--fit``, the model's coefficients fitted to measured
kernel times). ``--target`` picks one: ``sm_90/h200`` (the default: the profile
fitted to measured kernels), ``sm_90/h100``,
the short names ``h100``/``h200``, or the path of a profile file.

Fields (``format: mirage-cli/device-profile``, ``version: 1``): ``name``, ``device``,
``arch``, ``calibrated``, ``source``; figures ``num_sms``, ``dram_bw`` and ``l2_bw``
(bytes/s), ``l2_bytes``, ``peak_flops`` (tensor-core FLOP/s reachable by small kernels),
``fma_flops``, ``launch_us``, ``iter_us`` (per forloop iteration and wave),
``barrier_us`` (null when unmeasured), ``smem_per_block``, ``smem_per_sm``,
``regs_per_sm``, ``max_threads_per_sm``, optionally ``stage_penalty`` (0 when
absent), ``mma_flops`` (``peak_flops`` when absent), ``mem_util_exp`` and
``scalar_copy_slowdown`` (1 when absent), ``block_stream_bw`` (no bound when absent),
``bulk_stream_bw`` (``block_stream_bw`` when absent), ``bulk_l2_bw`` (``l2_bw`` when
absent), ``bulk_mem_util_exp`` (``mem_util_exp`` when absent), ``simt_slowdown`` (1 when absent),
``chain_mma_flops`` (``mma_flops`` when absent), ``chain_wgmma_flops``
(``chain_mma_flops`` when absent), ``narrow_box_slowdown`` and ``plain_box_slowdown``
(1 when absent; see :class:`Profile`); and ``fit``: the coefficients
of the model's terms (``stream``, ``sync``, ``launch``, ``const_us``, and ``cluster_us``:
µs per kernel whose forloop is split over a cluster), 1/1/1/0/0 when unfitted (an
absent term: its unfitted value).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mirage_cli.diagnostics import MirageError

FORMAT = "mirage-cli/device-profile"
VERSION = 1
HERE = Path(__file__).resolve().parent
NAMES = ("h100", "h200")
DEFAULT_TARGET = "sm_90/h200"
FIT_TERMS = ("stream", "sync", "launch", "const_us", "cluster_us")


@dataclass(frozen=True)
class Profile:
    name: str
    device: str
    arch: str
    calibrated: bool
    source: str
    num_sms: int
    dram_bw: float
    l2_bw: float
    l2_bytes: int
    peak_flops: float
    fma_flops: float
    launch_us: float
    iter_us: float
    barrier_us: float | None
    smem_per_block: int
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    # A loop whose plan keeps S copies in flight is slower by 1 + stage_penalty / S**2
    # (S = 1: loads and compute in series; fitted on an H200, docs/perf-log.md v7).
    stage_penalty: float = 0.0
    # The rate at which generated kernels do tensor-core work (mma.sync with its operand
    # loads and the element-wise work between two matmuls), fitted to measured kernels;
    # peak_flops when absent.
    mma_flops: float | None = None
    # A grid on a fraction u of the SMs streams memory u ** mem_util_exp as fast as a
    # full one (compute scales with u itself); 1 when absent.
    mem_util_exp: float | None = None
    # A loop whose plan copies its inputs one element at a time (vec 1: a tile width
    # that is not a multiple of 16 bytes) streams them this many times slower than with
    # 16-byte copies; 1 when absent.
    scalar_copy_slowdown: float | None = None
    # Bytes/s one block streams from DRAM alone on its SM (a grid of n < num_sms blocks
    # reads at most n times this); no bound when absent.
    block_stream_bw: float | None = None
    # The same for a block whose plan copies its loop inputs with bulk tensor copies
    # (TMA); block_stream_bw when absent.
    bulk_stream_bw: float | None = None
    # The rate at which the blocks of a kernel whose plan copies its loop inputs with
    # bulk tensor copies receive what they load (l2_bw's meaning, for TMA: it writes
    # shared memory without the SM's load path); l2_bw when absent.
    bulk_l2_bw: float | None = None
    # mem_util_exp for such a kernel (a grid on part of the GPU, its rate bounded per
    # block by bulk_stream_bw); mem_util_exp when absent.
    bulk_mem_util_exp: float | None = None
    # Element-wise math in custom kernels (few warps per SM, one element's instructions
    # after another) runs this many times slower than fma_flops; 1 when absent.
    simt_slowdown: float | None = None
    # The rate of the tensor-core work of a kernel that keeps a matmul chain in
    # registers (plan knob chain=1, the attention family); mma_flops when absent.
    chain_mma_flops: float | None = None
    # The same for a chain whose plan runs both matmuls as warpgroup wgmma (knob
    # wgmma=1) and whose loop is the chain alone (no side work, such as qknorm_gqa's
    # key norms, which wgmma does not speed up); chain_mma_flops when absent.
    chain_wgmma_flops: float | None = None
    # A kernel whose plan brings a loop input by bulk tensor copies in boxes of 32-byte
    # rows (the narrowest swizzle) streams this many times slower than in wider boxes
    # of the same bytes on as many blocks; 1 when absent.
    narrow_box_slowdown: float | None = None
    # The same for boxes copied unswizzled (rows of an odd number of 16-byte chunks,
    # codegen/tmaplan.swizzle_of): against boxes of whole swizzle spans of the same
    # bytes, each of their rows starts in the middle of a 32-byte DRAM sector every
    # other time, so the sectors fetched exceed the bytes used; 1 when absent.
    plain_box_slowdown: float | None = None
    fit: dict[str, float] = field(default_factory=lambda: {"stream": 1.0, "sync": 1.0,
                                                           "launch": 1.0, "const_us": 0.0})
    extra: dict[str, Any] = field(default_factory=dict)  # other recorded figures

    @property
    def flop_rate(self) -> float:
        """FLOP/s of the model's compute term."""
        return self.mma_flops or self.peak_flops

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _OPTIONAL:
            if d[key] is None:
                del d[key]
        extra = d.pop("extra")
        return {"format": FORMAT, "version": VERSION, **d, **extra}

    @property
    def digest(self) -> str:
        """SHA-256 of the profile's canonical JSON (part of the search cache key)."""
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


_NUMBERS: dict[str, Callable[[Any], bool]] = {
    "num_sms": lambda v: isinstance(v, int) and v > 0,
    "dram_bw": lambda v: _pos(v), "l2_bw": lambda v: _pos(v),
    "l2_bytes": lambda v: isinstance(v, int) and v > 0,
    "peak_flops": lambda v: _pos(v), "fma_flops": lambda v: _pos(v),
    "launch_us": lambda v: _nonneg(v), "iter_us": lambda v: _nonneg(v),
    "barrier_us": lambda v: v is None or _nonneg(v),
    "smem_per_block": lambda v: isinstance(v, int) and v > 0,
    "smem_per_sm": lambda v: isinstance(v, int) and v > 0,
    "regs_per_sm": lambda v: isinstance(v, int) and v > 0,
    "max_threads_per_sm": lambda v: isinstance(v, int) and v > 0,
}


# The optional figures: when present, each must pass its check (the requirement is
# named in the diagnostic); when absent, the Profile's default applies.
_OPTIONAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stage_penalty": (lambda v: _nonneg(v), ">= 0"),
    "mma_flops": (lambda v: _pos(v), "> 0"),
    "mem_util_exp": (lambda v: _nonneg(v) and v <= 1, "in [0, 1]"),
    "scalar_copy_slowdown": (lambda v: _pos(v) and v >= 1, ">= 1"),
    "block_stream_bw": (lambda v: _pos(v), "> 0"),
    "bulk_stream_bw": (lambda v: _pos(v), "> 0"),
    "bulk_l2_bw": (lambda v: _pos(v), "> 0"),
    "bulk_mem_util_exp": (lambda v: _nonneg(v) and v <= 1, "in [0, 1]"),
    "simt_slowdown": (lambda v: _pos(v) and v >= 1, ">= 1"),
    "chain_mma_flops": (lambda v: _pos(v), "> 0"),
    "chain_wgmma_flops": (lambda v: _pos(v), "> 0"),
    "narrow_box_slowdown": (lambda v: _pos(v) and v >= 1, ">= 1"),
    "plain_box_slowdown": (lambda v: _pos(v) and v >= 1, ">= 1"),
}


def _pos(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def from_json(doc: Any, where: str) -> Profile:
    """A profile from its JSON document; a diagnostic naming the bad field otherwise."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MirageError(f"{where}: not a device profile (format {FORMAT!r} expected)")
    if doc.get("version") != VERSION:
        raise MirageError(f"{where}: profile version {doc.get('version')!r} is not "
                          f"supported (this version reads {VERSION})")
    for key in ("name", "device", "arch", "source"):
        if not isinstance(doc.get(key), str):
            raise MirageError(f"{where}: '{key}' must be a string")
    for key, ok in _NUMBERS.items():
        if not ok(doc.get(key)):
            raise MirageError(f"{where}: '{key}' is missing or out of range "
                              f"(got {doc.get(key)!r})")
    fit = doc.get("fit", {})
    if not isinstance(fit, dict) or set(fit) - set(FIT_TERMS) or \
            not all(_nonneg(fit.get(k, 0.0)) for k in FIT_TERMS):
        raise MirageError(f"{where}: 'fit' must map {', '.join(FIT_TERMS)} to numbers >= 0")
    for key, (ok, need) in _OPTIONAL.items():
        v = doc.get(key)
        if v is not None and not ok(v):
            raise MirageError(f"{where}: '{key}' must be a number {need} (got {v!r})")
    known = {"format", "version", "calibrated", "fit", "name", "device", "arch", "source",
             *_OPTIONAL, *_NUMBERS}
    optional: dict[str, Any] = {k: float(doc[k]) for k in _OPTIONAL if doc.get(k) is not None}
    return Profile(doc["name"], doc["device"], doc["arch"], bool(doc.get("calibrated")),
                   doc["source"], **{k: doc[k] for k in _NUMBERS}, **optional,
                   fit={"stream": 1.0, "sync": 1.0, "launch": 1.0, "const_us": 0.0,
                        **{k: float(v) for k, v in fit.items()}},
                   extra={k: v for k, v in doc.items() if k not in known})


def load(target: str) -> Profile:
    """The profile ``target`` names: ``sm_90/h200``, ``h200``, ... or a file path."""
    name = target.split("/", 1)[1] if target.startswith("sm_") and "/" in target else target
    if name in NAMES:
        path = HERE / f"{name}.json"
    elif target.endswith(".json"):
        path = Path(target)
    else:
        raise MirageError(f"--target {target}: unknown target (expected "
                          f"{', '.join('sm_90/' + n for n in NAMES)}, "
                          f"{', '.join(NAMES)}, or a device profile .json file)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise MirageError(f"--target {target}: cannot read {path}: {e.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise MirageError(f"{path}:{e.lineno}:{e.colno}: error: invalid JSON: {e.msg}") from None
    prof = from_json(doc, str(path))
    if target.startswith("sm_") and "/" in target and target.split("/")[0] != prof.arch:
        raise MirageError(f"--target {target}: the {prof.name} profile is for {prof.arch}")
    return prof


def mismatch(prof: Profile, device_name: str) -> str | None:
    """A notice when the cost model ranks with ``prof`` on a GPU another shipped profile
    names (e.g. the default H200 profile on an H100: its candidates' order is the
    H200's, and on an H100 the one it ships may not be the fastest); None otherwise."""
    dev = device_name.lower()
    if prof.name.lower() in dev:
        return None
    match = next((n for n in NAMES if n.lower() in dev), None)
    if match is None:
        return None
    return (f"the cost model ranks with the {prof.name} profile ({prof.device}) on this "
            f"{device_name}; --target {prof.arch}/{match} ranks for it")


def target_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--target``: the device profile the cost model uses."""
    import click

    return click.option("--target", default=DEFAULT_TARGET, show_default=True,
                        metavar="sm_90/h100|sm_90/h200|FILE.json",
                        help="Device profile of the cost model.")(f)
