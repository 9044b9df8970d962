"""The search result cache: a rerun with the same program and options is instant, and
what it returns is proved, not trusted.

Entries live under ``$MIRAGE_CACHE_DIR`` (default ``~/.cache/mirage-cli``), one file per
key: the SHA-256 of the program's canonical JSON, the result-changing options and the
tool version. A file holds an envelope::

    {"format": "mirage-cli/search-cache", "version": 1, "program_sha256": ...,
     "options": {...}, "tool": "mirage-cli X.Y", "candidates": "<.ugraph.json text>"}

Anyone who can write the directory can put anything there, so :func:`get` checks
every entry before returning it: the envelope's program hash, options and tool must be
those of the request; the candidates must load (and be checked) as µGraphs; and each
candidate is re-verified against the program with one finite-field trial
(:class:`mirage_cli.verifier.api.Verifier`, the same check the search runs). Any
mismatch is a miss, reported as a warning, and the caller recomputes (and overwrites
the entry). Only complete searches are stored (a search cut short by its budget is not
reproducible). Writes are atomic; an unreadable or unwritable cache is a miss, never
an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mirage_cli import __version__, serialize
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.util import write_atomic

FORMAT = "mirage-cli/search-cache"
VERSION = 1
TOOL = f"mirage-cli {__version__}"
RECHECK_TRIALS = 1  # finite-field trials per cached candidate before it is shipped


def cache_dir() -> Path:
    env = os.environ.get("MIRAGE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mirage-cli"


# Bumped when the search's answers change meaning within one tool version (2: softmax
# is searched in its max-subtracted form and candidates pass the numerical check, so
# older entries may hold the overflowing form; 3: ties in predicted time are broken by
# the stated rule of cost.rank, so older rankings may differ; 4: ties within 1%; 5: the
# model reads the kernel plan (occupancy, plan feasibility) and a device profile; 7: the
# plan may split the forloop over a cluster by default, and the model counts launched
# blocks and per-block iterations at 0.5 µs each; 9: small forloops are staggered by
# default, and memory terms scale with the profile's mem_util_exp; 10: a search ends
# by its work limit, max_states per unit, and Z3 queries by a resource count, not by
# the clock, so an entry no longer depends on the load it was searched under; 11: the
# planner's default stages and cluster split, which the model reads, changed; 12: the
# two-blocks-per-SM default depth of 11 withdrawn; 13: and its larger default clusters;
# 14: a whole answer predicted slower than the unfused program is searched cut too;
# 15: block matmuls cost whole tensor-core K steps, element-by-element loop copies
# stream the profile's scalar_copy_slowdown times slower, and a grid of few blocks
# reads DRAM at the profile's block_stream_bw per block; 16: a pre-defined matmul is
# costed as the custom kernel it lowers to, whose tiling the cost model chooses; 17:
# blocks stream in rounds of the resident ones, so a small last round is a tail; 18:
# a block matmul whose K tile is not a multiple of 16 gathers its fragments element by
# element, its tensor-core term scalar_copy_slowdown times slower; 19: a first custom
# kernel may store an intermediate for pre-defined operators to finish, and the model
# costs element-wise math where the blocks run it, at the profile's simt_slowdown; 20:
# a grid that cannot store an output builds intermediates of at most 4 operators; 21:
# the plan's default depth is 6 stages for grids of one block per SM, streaming loops
# copy their mma operands by bulk tensor copies, and the model reads them at the
# profile's bulk_stream_bw; 22: plans of chains take one warp per 16-row tile and
# kernels whose loop matmul result goes through shared memory 512 threads, and the
# tuner's descent starts from rebalanced grids too; 23: designs whose first tuning
# does not fit are ranked by the first tuning that does, tune.first_fitting, and a
# chain whose loop has side work gets 512 threads; 24: matmul chains have their own
# tensor-core rate in the profiles, chain_mma_flops, and the descent moves a factor of
# 2 between grid axes, tune._transfers; 25: a block tile's dim split down to one
# element keeps its index, so designs splitting gqa's 2 heads at batch 1 are found, and
# a chain's pipeline fill is the lesser of its memory and compute terms; 26: a block
# matmul with an operand the plan reads element by element, path "direct", has its
# tensor-core term scalar_copy_slowdown times slower; 27: a max-subtracted softmax is
# also searched without its maxima and given a running maximum back, search.runmax,
# and a rescaled split of a kernel whose grid splits nothing combines its rows over a
# grid axis; 28: the rescaled split of a kernel that keeps its rows whole is also
# enumerated with a combine that splits them, online_split(rows=True); 29: a chain
# whose layout admits it runs as wgmma by default, its B tiles bulk-copied, and a chain
# with side work keeps one warp per 16-row tile where that runs as wgmma, which the
# model reads; 30: a chain run as wgmma whose loop has no side work is priced at the
# profile's chain_wgmma_flops; 31: a short row's reduction takes one lane per 16-byte
# chunk, which changes the plans the model reads; 32: the rescaled split stores its
# partial results in f32, and the numerics check holds each input constant; 33: a
# loop's invariant tiles waited for before it are priced, per round of blocks at one
# block per SM; 34: the numerics check does not judge finiteness on an input held
# constant that takes one of the program's own intermediates out of its dtype's range;
# 35: a matmul chain of fewer than 16 rows of a loaded A fills one padded 16-row tile,
# and takes tiles with several batch dimensions of which at most one is not 1, so a
# decode GQA's loop over the keys with a running maximum has a plan); 36: the numerics
# check does not judge finiteness where the exact output is within rounding noise of
# its dtype's largest value, so designs rejected for that now pass); 37: the tuner's
# start splits a load's rows into whole 16-byte vectors, so designs over sizes that are
# not powers of two are ranked by a tiling that copies 16 bytes at a time); 38: a
# matmul chain read by ldmatrix whose loop inputs all fit bulk copies takes them by
# default, which the model prices at the bulk-copy rates; (39: branch fill1); 40:
# acc_sum is in every block vocabulary, so element-wise programs get fused kernels;
# 41: a reshape whose tensors share one buffer launches nothing and costs nothing.
# 42: a concatenation read only by custom kernels, in whole 16-byte chunks of its
# parts, launches nothing and costs nothing (codegen/joins.py); 43: a matmul chain
# reading a joined concatenation takes its other loop inputs by bulk copies, which the
# model prices at the bulk-copy rates; 44: a concatenation along the last dimension
# whose first part's rows are not whole chunks (a transposed key cache) is joined
# shifted when a chain reads it as its key operand, and costs nothing; 45: boxes of
# 32-byte rows are priced slower (the profile's narrow_box_slowdown) and the tuner
# also descends from each looping grid halved to half the SMs' blocks; 46: a reader
# that refuses a shifted join keeps its other joins; 47: a chain that gathers B1 from
# a shifted join gets four times the default's warps; 48: rows of an odd number of
# 16-byte chunks (48, 80, 112, ... bytes) come by unswizzled bulk-copy boxes, which the
# model prices at the bulk-copy rates; 49: unswizzled boxes are priced slower (the
# profile's plain_box_slowdown); 50: the tuner's start moves a split size that does
# not divide the stored dimension it tiles to a divisor of it, so a rescaled split's
# combine over seven rows (Qwen2-7B's query heads per key/value head) is tuned; 51:
# rotate_half is a block operator too, so a rotary embedding fuses with its rotation;
# 52: when every whole design is predicted slower than the unfused program, the cut
# program is searched first, and whole designs slower than its answer are not verified;
# 53: a shape reuse whose sizes differ from the family's only in coincidences ranks the
# pool without enumerating, and certifies a design its family did not at a smaller
# batch, carried from there; 54: a shape reuse at larger sizes that enumerates nothing
# tunes the family's designs in the order of their predicted time there and stops
# where none left can rank above the best (family entry format 3); 55: the tuner also
# descends from the one-axis grid that fills the most SMs (``tune._filled``).
SEARCH_REVISION = 55


def program_hash(program: Graph) -> str:
    """SHA-256 of the program's canonical JSON (names, shapes, operators, order)."""
    text = json.dumps(serialize.graph_to_json(program), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def key(program: Graph, options: dict[str, Any], kind: str = "search") -> str:
    """The entry name: program, options, tool version and the cost model's device
    profile (``--target``: another profile ranks the candidates differently)."""
    from mirage_cli.search.cost import profile

    doc = {"kind": kind, "program": program_hash(program), "options": options,
           "version": __version__, "revision": SEARCH_REVISION,
           "profile": profile().digest}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _path(k: str) -> Path:
    return cache_dir() / f"{k}.cache.json"


def get(k: str, program: Graph, options: dict[str, Any], seed: int = 0) -> str | None:
    """The candidates text cached under ``k``, once proved to be a result for
    ``program`` under ``options``; None (with a warning when an entry was there but
    failed a check) otherwise."""
    try:
        raw = _path(k).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    problem = check_entry(raw, program, options, seed)
    if problem is not None:
        info(f"warning: ignoring the cached search result {_path(k)}: {problem}; "
             f"searching again")
        return None
    return str(json.loads(raw)["candidates"])


def check_entry(raw: str, program: Graph, options: dict[str, Any], seed: int = 0
                ) -> str | None:
    """Why the entry text ``raw`` is not a proved result for ``program`` (or None)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "it is not valid JSON"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            doc.get("version") != VERSION or not isinstance(doc.get("candidates"), str):
        return "it is not a cache entry of this format"
    if doc.get("program_sha256") != program_hash(program):
        return "it was computed for another program"
    if doc.get("options") != options or doc.get("tool") != TOOL:
        return "it was computed with other options or another version"
    try:
        cands = serialize.loads_candidates(doc["candidates"], "<cache>")
    except MirageError as e:
        return f"its candidates do not load ({e.message})"
    for i, (_, meta) in enumerate(cands):
        if not _meta_ok(meta, i):
            return f"candidate {i} has no valid record (rank, kernels, cost, tuning)"
    return _recheck(program, [g for g, _ in cands], seed)


def _meta_ok(meta: dict[str, Any], rank: int) -> bool:
    """The record `mirage search` prints for a candidate has the shape it writes."""
    cost = meta.get("cost")
    return (meta.get("rank") == rank and type(meta.get("kernels")) is int
            and isinstance(cost, dict) and type(cost.get("time_us")) in (int, float)
            and isinstance(meta.get("tuning"), list))


def _recheck(program: Graph, graphs: list[Graph], seed: int) -> str | None:
    """One finite-field trial of every cached candidate against ``program``."""
    from mirage_cli.verifier.api import Verifier

    v = Verifier(program, seed=seed)
    for i, g in enumerate(graphs):
        try:
            verdict = v.check(g, trials=RECHECK_TRIALS)
        except MirageError as e:  # a different signature (inputs, outputs, shapes)
            return f"candidate {i} does not match the program ({e.message})"
        if verdict.equivalent is not True:
            why = "computes another function" if verdict.equivalent is False else \
                f"could not be re-verified ({verdict.reason})"
            return f"candidate {i} {why}"
    return None


def put(k: str, text: str, program: Graph, options: dict[str, Any],
        family: dict[str, Any] | None = None) -> None:
    """Store a complete search's candidates text for ``program`` under ``options``, and
    with ``family`` (the fields of :data:`FAMILY_FIELDS`) as the latest search of its
    family (the same program at any sizes), which a shape reuse starts from
    (:mod:`.reuse`). A reuse stores its own result but not a family entry: the family
    keeps the pool of the last search that enumerated."""
    doc = {"format": FORMAT, "version": VERSION, "program_sha256": program_hash(program),
           "options": options, "tool": TOOL, "candidates": text}
    try:
        write_atomic(_path(k), json.dumps(doc, sort_keys=True) + "\n")
        if family is not None:
            fam = {"format": FAMILY_FORMAT, "version": FAMILY_VERSION,
                   "structure": structure_hash(program), "options": options, "tool": TOOL,
                   "sizes": dict(program.params),
                   **{f: family[f] for f in FAMILY_FIELDS}}
            write_atomic(_family_path(program, options),
                         json.dumps(fam, sort_keys=True) + "\n")
    except OSError:
        pass


def peek(k: str) -> str | None:
    """The candidates text of the entry under ``k``, *unchecked* (None when absent or
    unreadable): for decisions that ship nothing, such as whether a reuse certified
    enough candidates (:mod:`.reuse`); :func:`get` is the only way to a result."""
    try:
        doc = json.loads(_path(k).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    text = doc.get("candidates") if isinstance(doc, dict) else None
    return text if isinstance(text, str) else None


# -- shape reuse: the same program at other sizes -----------------------------------------

FAMILY_FORMAT = "mirage-cli/search-family"
# 2: the entry holds the whole design pool (size-free design JSON) and the size
# pattern, no longer one tuned µGraph per ranked design; 3: and each design's best
# predicted µs where the search tuned it fully (null elsewhere), and the designs its
# verification rejected, which order and bound a reuse's tuning at larger sizes.
FAMILY_VERSION = 3
# What a search writes of its family entry (the lists parallel to, or indexing,
# ``designs``): the design pool as size-free JSON (:func:`.family.design_to_json`), the
# size pattern (:func:`.family.size_pattern`), each design's best predicted µs where
# the search tuned it fully (null elsewhere), and the pool indices of the designs whose
# candidates its verification rejected.
FAMILY_FIELDS = {"designs": list, "pattern": str, "tuned_us": list, "rejected": list}


def _sizeless(doc: Any) -> Any:
    """A µGraph's JSON without its sizes: no ``shape`` and no parameter values (dims
    stay as the program wrote them, e.g. ``2 * batch``)."""
    if isinstance(doc, dict):
        return {k: _sizeless(v) for k, v in doc.items()
                if k != "shape" and not (k == "value" and "name" in doc and len(doc) == 2)}
    if isinstance(doc, list):
        return [_sizeless(v) for v in doc]
    return doc


def structure_hash(program: Graph) -> str:
    """SHA-256 of the program with its sizes left out: equal for the same program at
    other ``-D`` values, different after any other change (an operator, a name, a
    dtype, an attribute, a dimension expression)."""
    text = json.dumps(_sizeless(serialize.graph_to_json(program)), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _family_path(program: Graph, options: dict[str, Any]) -> Path:
    """One file per (structure, options, tool version, revision, model profile): the
    latest complete search at any sizes."""
    from mirage_cli.search.cost import profile

    doc = {"kind": "family", "structure": structure_hash(program), "options": options,
           "version": __version__, "revision": SEARCH_REVISION, "profile": profile().digest}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()}.family.json"


def get_family(program: Graph, options: dict[str, Any]
               ) -> dict[str, Any] | None:
    """The entry of the latest complete search of ``program``'s structure under
    ``options`` at *other* sizes: its ``sizes`` and the :data:`FAMILY_FIELDS`, or None.
    Nothing here is trusted beyond the fields' types: the caller decodes the designs
    and the rest with checks, instantiates the designs at the new sizes and verifies
    them."""
    try:
        doc = json.loads(_family_path(program, options).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FAMILY_FORMAT or \
            doc.get("version") != FAMILY_VERSION or doc.get("tool") != TOOL or \
            doc.get("options") != options or doc.get("structure") != structure_hash(program) \
            or not isinstance(doc.get("sizes"), dict) or \
            not all(isinstance(doc.get(f), t) for f, t in FAMILY_FIELDS.items()):
        return None
    if doc["sizes"] == dict(program.params):
        return None  # the same sizes: that is the exact entry's business
    return {f: doc[f] for f in ("sizes", *FAMILY_FIELDS)}


def has(k: str) -> bool:
    """Whether an entry exists under ``k`` (checked only when read, by :func:`get`)."""
    return _path(k).is_file()

