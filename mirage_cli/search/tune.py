"""The tuner: grid sizes and forloop ranges for a design (DESIGN.md §1 tuning space).

Every split grid axis gets at least 2 blocks and a looping kernel at least 2
iterations (a size of 1 would be a different, smaller design). A starting tuning aims
at filling the GPU (doubling the axis with the largest tiles until about the
profile's SM count of blocks) with loop tiles of about 64 along the iterated dimension; coordinate descent
then doubles or halves one size at a time, or moves it to the next divisor of the
dimension it splits (so sizes with odd factors are reachable: 14336 = 7 * 2^11 splits
into 7, 14, 28, 56, 112, 224, ... blocks, 18944 = 37 * 2^9 into 37, 74, ...), or moves
a factor of 2 from one grid axis to another (as many blocks, other tiles), while the
cost model improves. Every step instantiates the design through the builder, so only
valid µGraphs are ever costed.
"""

from __future__ import annotations

from mirage_cli.codegen.knobranges import VEC_BYTES
from mirage_cli.ir import Graph
from mirage_cli.search.cost import Cost, estimate, profile
from mirage_cli.search.design import CustomD, Design, Tuning, custom_steps, instantiate

LOOP_TILE = 64
MAX_STEPS = 40


def _key(c: Cost) -> tuple[bool, int, float]:
    """Feasible tunings by predicted time; infeasible ones by shared memory first, so
    that the descent from an infeasible start moves toward tunings that fit (their
    predicted time can rise as tiles shrink, which stopped it short of any)."""
    return (not c.fits, 0 if c.fits else c.smem_bytes, c.time_us)


def start(target: Graph, design: Design) -> Tuning:
    """A reasonable first tuning (possibly invalid; see :func:`tune`)."""
    types = target.tensor_types()
    out: list[tuple[tuple[int, int, int], int]] = []
    for step in custom_steps(design):
        grid = [2 if a < step.axes else 1 for a in range(3)]
        extents = _axis_extents(step, types)
        vector = _vector_elements(step, types)
        while grid[0] * grid[1] * grid[2] < profile().num_sms:
            # A split keeps 16 elements a block, and along an axis that cuts a load's
            # rows, rows of whole 16-byte vectors: a start of 20-column tiles (40-byte
            # rows, copied element by element) priced a fused RMSNorm + linear at
            # hidden 2048, n 2560 at 48 us, which put it outside the designs tuned,
            # where its 64-block tiling is predicted 7.1 (docs/perf-log.md v35).
            options = [a for a in range(step.axes)
                       if _vector_tiles(extents[a], grid[a] * 2, vector[a])]
            if not options:
                break
            best = max(options, key=lambda a: (extents[a] // grid[a], -a))
            grid[best] *= 2
        forloop = 2 if step.looped else 1
        if step.looped:
            ext = _loop_extent(step, types, grid)
            while ext // (forloop * 2) >= LOOP_TILE:
                forloop *= 2
        out.append(((grid[0], grid[1], grid[2]), forloop))
    return tuple(out)


def _vector_tiles(extent: int, blocks: int, vector: int) -> bool:
    """Whether ``blocks`` blocks along an axis of ``extent`` keep 16 elements a block, in
    whole 16-byte vectors of ``vector`` elements."""
    return extent // blocks >= 16 and (extent // blocks) % vector == 0


def _axis_extents(step: CustomD, types: dict) -> list[int]:
    ext = [1 << 30] * 3
    for ld in step.loads:
        t = types.get(ld.source)
        if t is None:
            continue  # produced by an earlier kernel; its size depends on that tuning
        for a, d in enumerate(ld.imap):
            if d is not None:
                ext[a] = min(ext[a], t.shape[d])
    return [e if e < (1 << 30) else 64 for e in ext]


def _vector_elements(step: CustomD, types: dict) -> list[int]:
    """Per grid axis, the elements of one 16-byte vector of each load whose last (its
    contiguous) dimension that axis splits: the block's share of that dimension should
    be a multiple of it. 1 for an axis that splits no load's last dimension."""
    out = [1, 1, 1]
    for ld in step.loads:
        t = types.get(ld.source)
        if t is None:
            continue
        for a, d in enumerate(ld.imap):
            if d is not None and d == len(t.shape) - 1:
                out[a] = max(out[a], VEC_BYTES // t.dtype.nbytes)
    return out


def _loop_extent(step: CustomD, types: dict, grid: list[int]) -> int:
    for ld in step.loads:
        t = types.get(ld.source)
        if t is not None and ld.fmap is not None:
            n = t.shape[ld.fmap]
            for a, d in enumerate(ld.imap):
                if d == ld.fmap:
                    n //= grid[a]
            return n
    return 2 * LOOP_TILE


def neighbours(tuning: Tuning, design: Design, types: dict | None = None) -> list[Tuning]:
    """The tunings one move from ``tuning``: one size of one custom kernel doubled,
    halved or moved to the next divisor, or a factor of 2 moved between grid axes."""
    steps = custom_steps(design)
    out: list[Tuning] = []
    for k, ((grid, forloop), step) in enumerate(zip(tuning, steps)):
        extents = _axis_extents(step, types) if types is not None else [0, 0, 0]
        variants: list[tuple[tuple[int, int, int], int]] = []
        for a in range(step.axes):
            for n in _moves(grid[a], extents[a]):
                g = list(grid)
                g[a] = n
                variants.append(((g[0], g[1], g[2]), forloop))
        variants += [(g, forloop) for g in _transfers(grid, step.axes)]
        if step.looped:
            ext = _loop_extent(step, types, list(grid)) if types is not None else 0
            variants += [(grid, f) for f in _moves(forloop, ext)]
        out += [tuning[:k] + (v,) + tuning[k + 1:] for v in variants]
    return out


def _transfers(grid: tuple[int, int, int], axes: int) -> list[tuple[int, int, int]]:
    """``grid`` with a factor of 2 moved from one split axis to another: as many blocks,
    tiles of another shape. One size at a time, the descent had to pass through a grid
    of half or twice the blocks, which the model rates worse, so it stopped: gqa at
    batch 8 stayed at (8, 2, 8) x 16 iterations, predicted 39.7 µs, next to (16, 2, 4)
    x 16, predicted 37.1 (measured on an H100 28.9 and 24.0 µs, docs/perf-log.md v22)."""
    out = []
    for a in range(axes):
        for b in range(axes):
            if a != b and grid[b] % 2 == 0 and grid[b] >= 4:
                g = list(grid)
                g[a], g[b] = g[a] * 2, g[b] // 2
                out.append((g[0], g[1], g[2]))
    return out


def _moves(n: int, extent: int) -> list[int]:
    """Sizes next to ``n`` (>= 2): double, half, and the divisors of ``extent`` just
    above and below ``n`` (every divisor is reachable; the builder rejects the rest)."""
    near = [n * 2, n // 2]
    if extent > 0:
        divs = _divisors(extent, 4096)
        near += [min((d for d in divs if d > n), default=0),
                 max((d for d in divs if d < n), default=0)]
    return sorted({m for m in near if m >= 2 and m != n})


def tune(target: Graph, design: Design, max_steps: int = MAX_STEPS
         ) -> list[tuple[Cost, Tuning, Graph]]:
    """Every valid tuning visited by coordinate descent from each start, best first."""
    return _descend(target, design, max_steps, until_fits=False)


def first_fitting(target: Graph, design: Design) -> list[tuple[Cost, Tuning, Graph]]:
    """What the driver ranks designs by before tuning them fully: the first tuning, or,
    when that one does not fit (shared memory), the tunings the descent visits from it
    until one fits. Ranked by the first tuning alone, every design whose first tuning
    did not fit came after every design whose did, so with more fitting designs than
    the driver tunes, none of them was ever tuned: qknorm_gqa at batch 1 never tuned
    its split (flash-decoding) form, predicted 14.5 µs once tuned, and shipped a
    one-kernel design predicted 41.1 (docs/perf-log.md v21)."""
    return _descend(target, design, MAX_STEPS, until_fits=True)


def _descend(target: Graph, design: Design, max_steps: int, until_fits: bool
             ) -> list[tuple[Cost, Tuning, Graph]]:
    """The valid tunings visited by at most ``max_steps`` steps of coordinate descent
    from each start (the first alone with ``until_fits``, stopping at a fitting one),
    best first."""
    seen: dict[Tuning, tuple[Cost, Graph] | None] = {}

    def cost(t: Tuning) -> tuple[Cost, Graph] | None:
        if t not in seen:
            g = instantiate(target, design, t)
            seen[t] = None if g is None else (estimate(g), g)
        return seen[t]

    types = target.tensor_types()
    # Without a descent (max_steps 0), or descending only to a tuning that fits (the
    # driver's ranking of designs), from the first start alone.
    for first in starts(target, design)[:1 if until_fits or not max_steps else None]:
        current = _valid_start(first, design, cost, types)
        steps = 0
        while current is not None and steps < max_steps:
            steps += 1
            here = cost(current)
            assert here is not None
            if until_fits and here[0].fits:
                break
            better = [(c, n) for n in neighbours(current, design, types)
                      if (c := cost(n)) is not None and _key(c[0]) < _key(here[0])]
            if not better:
                break
            current = min(better, key=lambda cn: (_key(cn[0][0]), cn[1]))[1]
    found = [(v[0], t, v[1]) for t, v in seen.items() if v is not None]
    found.sort(key=lambda x: (_key(x[0]), x[1]))
    return found


# Starts of the descent besides :func:`start`: its grid with a factor of 2 moved from
# the axis of most blocks to the axis of fewest, once and twice.
REBALANCED_STARTS = 2


def starts(target: Graph, design: Design) -> list[Tuning]:
    """The tunings the descent starts from: :func:`start`, then the same with its
    blocks spread more evenly over the grid axes, then (:func:`_halved`) with its
    looping grids on at most half the SMs. The model's time is not convex in the sizes
    (a plan's threads, homes and stages change with the tiles), so one descent can stop
    far from the best: qknorm_gqa at batch 8 stopped at grid (4, 4, 32) x 8 iterations,
    predicted 85.1 µs, while starting from (8, 4, 8) reached (16, 2, 4) x 16, predicted
    67.8 (docs/perf-log.md v20)."""
    first = start(target, design)
    halved = _halved(first, design)
    out = [first]
    steps = custom_steps(design)
    current = first
    for _ in range(REBALANCED_STARTS):
        moved = tuple((_rebalanced(grid, step.axes), forloop)
                      for (grid, forloop), step in zip(current, steps))
        if moved == current:
            break
        out.append(moved)
        current = moved
    filled = _filled(first, design, target.tensor_types())
    out += [filled] if filled not in out else []
    return out + ([halved] if halved not in out else [])


def _filled(first: Tuning, design: Design, types: dict) -> Tuning:
    """``first`` with each looping kernel of one split axis on the grid that fills the
    most SMs, counting the planner's default cluster of two on at most half of them
    (``knobranges.default_ksplit``): a divisor of the axis's extent whose tiles are
    whole 16-byte vectors of at least 16 elements, the widest tiles among equals. The
    descent moves to neighbouring divisors only, and the model's time is not convex in
    them: for gated_mlp at hidden 2560 and 6912 columns it stopped at 36 tiles of 192
    columns (72 blocks, predicted 33.5 µs) where 54 tiles of 128 (108 blocks) are
    predicted 30.7 (docs/perf-log.md v52). The forloop is the first start's: where that
    does not fit the filled grid, the descent toward a fitting tuning may leave it."""
    sms = profile().num_sms
    out: list[tuple[tuple[int, int, int], int]] = []
    for (grid, forloop), step in zip(first, custom_steps(design)):
        if not step.looped or step.axes != 1:
            out.append((grid, forloop))
            continue
        ext, vec = _axis_extents(step, types)[0], _vector_elements(step, types)[0]
        fits = [g for g in _divisors(ext, sms) if _vector_tiles(ext, g, vec)]
        if not fits:
            out.append((grid, forloop))
            continue
        best = max(fits, key=lambda g: (g * (2 if 2 * g <= sms else 1), -g))
        out.append(((best, 1, 1), forloop))
    return tuple(out)


def _halved(first: Tuning, design: Design) -> Tuning:
    """``first`` with the grid of each looping kernel halved along its largest split
    axis (keeping 2 blocks on each) until it has at most half the SMs' blocks, where
    the planner splits the loop over a cluster of two (``knobranges.default_ksplit``).
    The Llama layer's gate/up projection measured 60.5 µs so (64 blocks x 2, 64-byte
    boxes); the descent from a grid that fills the SMs (256 blocks) stopped at 112 or
    224 once boxes of 32-byte rows were priced slower (docs/perf-log.md v39)."""
    half = max(profile().num_sms // 2, 1)
    out: list[tuple[tuple[int, int, int], int]] = []
    for (grid, forloop), step in zip(first, custom_steps(design)):
        g = list(grid)
        while step.looped and step.axes and g[0] * g[1] * g[2] > half:
            a = max(range(step.axes), key=lambda i: (g[i], -i))
            if g[a] < 4:
                break
            g[a] //= 2
        out.append(((g[0], g[1], g[2]), forloop))
    return tuple(out)


def _rebalanced(grid: tuple[int, int, int], axes: int) -> tuple[int, int, int]:
    """``grid`` with a factor of 2 moved from its largest split axis to its smallest."""
    if axes < 2:
        return grid
    g = list(grid)
    hi = max(range(axes), key=lambda a: (g[a], -a))
    lo = min(range(axes), key=lambda a: (g[a], a))
    if g[hi] < 4 or g[hi] <= 2 * g[lo]:
        return grid
    g[hi] //= 2
    g[lo] *= 2
    return (g[0], g[1], g[2])


def _valid_start(t: Tuning, design: Design, cost, types: dict  # type: ignore[no-untyped-def]
                 ) -> Tuning | None:
    """The starting tuning ``t``, or the first valid one nearby: halving its sizes,
    from ``t`` and then from ``t`` with each split size that does not divide the
    stored dimension it tiles moved to a divisor of it (:func:`_dividing`)."""
    for first in (t, _dividing(t, design, types)):
        t = first
        for _ in range(12):
            if cost(t) is not None:
                return t
            t = tuple(((max(g[0] // 2, 2 if a0 else 1), max(g[1] // 2, 2 if a1 else 1),
                        max(g[2] // 2, 2 if a2 else 1)), max(f // 2, 2) if s.looped else 1)
                      for (g, f), s in zip(t, custom_steps(design))
                      for a0, a1, a2 in [(s.axes > 0, s.axes > 1, s.axes > 2)])
    return None


def _dividing(t: Tuning, design: Design, types: dict) -> Tuning:
    """``t`` with each split size that does not divide the dimension of a stored
    program tensor it tiles moved to the largest divisor of that dimension below it,
    or else the smallest. Sizes start at powers of two, and a kernel reading only an
    earlier kernel's results knows its extents by what it stores alone: the combine
    of a split attention whose rows are the seven query heads of a key/value head
    (Qwen2-7B) had no valid start, so that design was never tuned."""
    out = []
    for (grid, forloop), step in zip(t, custom_steps(design)):
        g = list(grid)
        for a in range(step.axes):
            stored = [types[st.name].shape[st.omap[a]] for st in step.stores
                      if st.name in types and st.omap[a] is not None]
            if stored and stored[0] % g[a]:
                divs = _divisors(stored[0], stored[0])
                g[a] = max((n for n in divs if n < g[a]), default=min(divs, default=g[a]))
        out.append(((g[0], g[1], g[2]), forloop))
    return tuple(out)


def _divisors(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` from 2 to ``limit``, ascending."""
    return [d for d in range(2, min(n, limit) + 1) if n % d == 0]