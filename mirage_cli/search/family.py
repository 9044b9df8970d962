"""What a search leaves for a shape reuse at other sizes (:mod:`.reuse`): its design
pool as plain JSON (designs are size-free: grids and forloop ranges are tuning), and
the *size pattern* of its sizes, which says whether the enumeration at other sizes
would find the same pool. The driver writes them (through :mod:`.cache`) and
:mod:`.reuse` reads them; kept apart from both, as :mod:`.reuse` imports the driver."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from mirage_cli import ops
from mirage_cli.ir import DType, Graph
from mirage_cli.search.design import CustomD, Design, LoadD, OpD, PredefD, Step, StoreD


def size_pattern(program: Graph) -> str:
    """A digest of every fact about ``program``'s sizes that the design enumeration
    (:mod:`.enumerate`) can read; equal digests give equal design pools.

    The generator sees a dimension n whole or split in :data:`.enumerate.REP_SPLIT`
    = 2 parts (n/2), and a stored partial result concatenated over 2 blocks (2 per
    reduced dimension); it compares such sizes for equality (operand shapes,
    broadcasting, which unifies equal-size dimensions into one index), tests them
    against 1 and for divisibility (splits, group widths), and writes actual sizes
    into expressions (a reduction's extent) and attributes (an output's width).
    So the pattern records: each dimension's class among the values {1, 2, n, n/2}
    of every dimension (numbered by first occurrence, so 8 and 16 are alike but
    16 = 64/4 is not 32 = 64/2), which classes divide which, the index labels and
    expressions of every tensor (exact sizes of what is reduced), and the outputs'
    last dimensions."""
    from mirage_cli.search.analysis import analyze

    an = analyze(program)
    ids: dict[int, int] = {1: 0, 2: 1}
    dims: list[tuple[int, int]] = []
    for v in an.values.values():
        for n in v.type.shape:
            whole = ids.setdefault(n, len(ids))
            half = ids.setdefault(n // 2, len(ids)) if n % 2 == 0 else -1
            dims.append((whole, half))
    atoms = sorted(ids, key=ids.__getitem__)
    divides = [[a % b == 0 for b in atoms] for a in atoms]
    doc = {"dims": dims, "divides": divides,
           "labels": [list(v.labels) for v in an.values.values()],
           "terms": [repr(v.term) for v in an.values.values()],
           "widths": [v.type.shape[-1] for v in an.outputs]}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def split_facts(program: Graph) -> tuple[int, ...]:
    """Of :func:`size_pattern`'s facts, those that decide which dimensions the
    generator can split at all: every dimension's size where it is 1 or 2 (never split
    into tiles of more than one element), otherwise whether it halves (-2 even, -1
    odd). Two sizes with the same split facts but different patterns differ only in
    coincidences between sizes (equalities and divisibility among the classes: lora at
    batch 16, where half of X's 2 x batch rows is the LoRA rank) -- which a shape reuse does
    not enumerate again for (:mod:`.reuse`). Two whose split facts differ do not
    have the same splittable dimensions (batch 1 -> 8), and the pool lacks designs
    that split them."""
    from mirage_cli.search.analysis import analyze

    return tuple(n if n <= 2 else -1 - (n % 2 == 0)
                 for v in analyze(program).values.values() for n in v.type.shape)


# -- designs as JSON (the family entry's pool) -------------------------------------------


def design_to_json(d: Design) -> dict[str, Any]:
    """A design as plain JSON (no sizes: grids and forloop ranges are tuning)."""
    return {"steps": [_step_json(s) for s in d.steps], "outputs": list(d.outputs)}


def _step_json(s: Step) -> dict[str, Any]:
    if isinstance(s, PredefD):
        return {"predef": s.op, "args": list(s.args), "attrs": [list(a) for a in s.attrs],
                "name": s.name}
    return {"loads": [[ld.source, list(ld.imap), ld.fmap] for ld in s.loads],
            "ops": [[o.op, list(o.args), [list(a) for a in o.attrs]] for o in s.ops],
            "stores": [[st.tile, st.name, list(st.omap)]
                       + ([st.dtype.value] if st.dtype is not None else []) for st in s.stores],
            "axes": s.axes, "looped": s.looped}


class BadDesign(ValueError):
    """A design document that is not one :func:`design_to_json` writes."""


def design_from_json(doc: Any) -> Design:
    """The inverse of :func:`design_to_json`, checked (the cache is anyone's to
    write): every index in range, every operator known, every value of its type.
    What it returns is still only a candidate: it is instantiated through the builder
    and verified before it ships."""
    doc = _obj(doc, ("steps", "outputs"))
    steps = tuple(_step(s) for s in _list(doc["steps"]))
    return Design(steps, tuple(_str(o) for o in _list(doc["outputs"])))


def times_from_json(doc: Any, n: int) -> list[float | None]:
    """The family entry's predicted µs of its ``n`` pool designs, checked: each a
    finite number above 0, or null (a design the search did not tune fully)."""
    out: list[float | None] = []
    for x in _tuple(doc, n):
        if x is not None and (type(x) is not float or not 0 < x < float("inf")):
            raise BadDesign("a design's predicted time is a positive number or null")
        out.append(x)
    return out


def indices_from_json(doc: Any, n: int) -> list[int]:
    """The family entry's list of pool indices (each below ``n``), checked."""
    return [_int(x, n) for x in _list(doc)]


def _step(doc: Any) -> Step:
    if isinstance(doc, dict) and "predef" in doc:
        d = _obj(doc, ("predef", "args", "attrs", "name"))
        return PredefD(_op(d["predef"]), tuple(_str(a) for a in _list(d["args"])),
                       _attrs(d["attrs"]), _str(d["name"]))
    d = _obj(doc, ("loads", "ops", "stores", "axes", "looped"))
    loads = tuple(LoadD(_str(src), _axes(imap), _opt_int(fmap))
                  for src, imap, fmap in (_tuple(x, 3) for x in _list(d["loads"])))
    block_ops: list[OpD] = []
    for x in _list(d["ops"]):
        op, args, attrs = _tuple(x, 3)
        idx = tuple(_int(a, len(loads) + len(block_ops)) for a in _list(args))
        block_ops.append(OpD(_op(op), idx, _attrs(attrs)))
    tiles = len(loads) + len(block_ops)
    stores = tuple(_store(x, tiles) for x in _list(d["stores"]))
    if not isinstance(d["looped"], bool):
        raise BadDesign("looped is not a boolean")
    return CustomD(loads, tuple(block_ops), stores, _int(d["axes"], 4), d["looped"])


def _store(doc: Any, tiles: int) -> StoreD:
    """``[tile, name, omap]``, or with the device tensor's dtype after them."""
    x = _tuple(doc, 4) if isinstance(doc, list) and len(doc) == 4 else _tuple(doc, 3)
    dtype = x[3] if len(x) == 4 else None
    if dtype is not None and dtype not in {d.value for d in DType}:
        raise BadDesign(f"unknown dtype {dtype!r}")
    return StoreD(_int(x[0], tiles), _str(x[1]), _axes(x[2]),
                  DType(dtype) if dtype is not None else None)


def _obj(doc: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != set(keys):
        raise BadDesign(f"expected an object with keys {', '.join(keys)}")
    return doc


def _list(doc: Any) -> list[Any]:
    if not isinstance(doc, list):
        raise BadDesign("expected a list")
    return doc


def _tuple(doc: Any, n: int) -> list[Any]:
    if not isinstance(doc, list) or len(doc) != n:
        raise BadDesign(f"expected a list of {n}")
    return doc


def _str(doc: Any) -> str:
    if not isinstance(doc, str):
        raise BadDesign("expected a string")
    return doc


def _int(doc: Any, below: int) -> int:
    if type(doc) is not int or not 0 <= doc < below:
        raise BadDesign(f"expected an integer in [0, {below})")
    return doc


def _opt_int(doc: Any) -> int | None:
    return None if doc is None else _int(doc, 4)  # a tensor dimension (rank <= 4)


def _axes(doc: Any) -> tuple[int | None, int | None, int | None]:
    a, b, c = (_opt_int(x) for x in _tuple(doc, 3))
    return a, b, c


def _op(doc: Any) -> str:
    name = _str(doc)
    try:
        ops.get(name)
    except KeyError:
        raise BadDesign(f"unknown operator '{name}'") from None
    return name


def _attrs(doc: Any) -> tuple[tuple[str, int | float | bool | str], ...]:
    out = []
    for pair in _list(doc):
        k, v = _tuple(pair, 2)
        if not isinstance(v, (int, float, bool, str)):
            raise BadDesign("an attribute value is a number, a boolean or a string")
        out.append((_str(k), v))
    return tuple(out)
