"""Mirage's ``data_type`` codes, which Mirage renumbered twice.

Established from the history of ``include/mirage/type.h`` in mirage-project/mirage:

- ``2024`` (up to commit 546551d8, February 2025): bf16 = 920, f16 = 921, f32 = 930;
  the published checkpoints of ``benchmark/saved_mugraphs`` (December 2024) use it;
- ``2025-02`` (commit cae8b852, 24 February 2025, to June 2025): bf16 = 940, f16 = 941,
  f32 = 950;
- ``2025-06`` (commit 00df4c51, 4 June 2025, to now): f16 = 940, bf16 = 941, f32 = 950.

The accumulators were renamed from ``tb_accum_*`` to ``tb_forloop_accum_*`` in commit
c8ffcc91 (11 March 2025), within the ``2025-02`` numbering, so the spelling of a
checkpoint's accumulators narrows down which numbering it uses. A code that still means
different things in the numberings left is ambiguous: the user names the numbering.
"""

from __future__ import annotations

from collections.abc import Iterable

from mirage_cli.ir import DType

# Every code of each numbering, so that a code of an unsupported type is recognised as
# such rather than mistaken for a float type of another numbering.
NUMBERINGS: dict[str, dict[int, str]] = {
    "2024": {900: "int8", 910: "uint16", 920: "bf16", 921: "f16", 930: "f32",
             940: "double"},
    "2025-02": {920: "int4", 930: "float8", 935: "int8", 940: "bf16", 941: "f16",
                945: "uint16", 950: "f32", 960: "double"},
    "2025-06": {920: "float4", 925: "int4", 926: "uint4", 930: "float8", 935: "int8",
                936: "uint8", 940: "f16", 941: "bf16", 945: "int16", 946: "uint16",
                950: "f32", 955: "int32", 956: "uint32", 960: "double", 965: "int64",
                966: "uint64"},
}

# Which numberings a checkpoint can use, by how it spells its accumulators.
OLD_ACCUM_PREFIX = "tb_accum_"  # before March 2025
NEW_ACCUM_PREFIX = "tb_forloop_accum_"


def possible_numberings(op_types: Iterable[str]) -> tuple[str, ...]:
    """The numberings consistent with the operator names a checkpoint uses."""
    names = set(op_types)
    old = any(n.startswith(OLD_ACCUM_PREFIX) for n in names)
    new = any(n.startswith(NEW_ACCUM_PREFIX) for n in names)
    if old and not new:
        return ("2024", "2025-02")
    if new and not old:
        return ("2025-02", "2025-06")
    return tuple(NUMBERINGS)


def resolve(codes: set[int], candidates: tuple[str, ...]) -> dict[int, str] | str:
    """The meaning of each code, or a sentence saying why it cannot be decided."""
    fits = [n for n in candidates if all(c in NUMBERINGS[n] for c in codes)]
    if not fits:
        return (f"data_type codes {sorted(codes)} fit none of Mirage's numberings "
                f"{', '.join(candidates)}")
    meaning: dict[int, str] = {}
    for code in sorted(codes):
        readings = {NUMBERINGS[n][code] for n in fits}
        if len(readings) > 1:
            which = "; ".join(f"{NUMBERINGS[n][code]} in the {n} numbering" for n in fits)
            return (f"data_type {code} is ambiguous ({which}): Mirage renumbered its data "
                    f"types; name the numbering with --mirage-dtypes "
                    f"{' or '.join(fits)}")
        meaning[code] = readings.pop()
    return meaning


def to_dtype(name: str) -> DType | None:
    """Our dtype for a Mirage type name, or None where we have no such type."""
    return {"f16": DType.F16, "bf16": DType.BF16, "f32": DType.F32}.get(name)
