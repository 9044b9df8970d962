"""The results of `mirage bench` as data and as text: the JSON document, Markdown, CSV
and a plot. Every rendering reads the same document (:func:`document`), so the table,
the rows and the plot cannot disagree.

A document is plain JSON data: the device, the command, the measured bandwidths
(:class:`~mirage_cli.codegen.copybw.Bandwidth`) and one row per (benchmark, batch,
variant) with µs, every baseline's µs (``sdpa`` only for plain softmax attention), the
floor, the rel. error and each timed kernel's launch configuration and plan; with
``mirage bench --per-kernel``, each kernel's own µs, the cost model's FLOPs and DRAM
bytes and the achieved TFLOP/s and GB/s, which the table prints under the row. NaN
never reaches the file (it is not JSON): an unknown number is ``null``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict
from typing import Any

from mirage_cli.codegen.bench import Row
from mirage_cli.codegen.copybw import Bandwidth
from mirage_cli.diagnostics import MirageError

FORMAT = "mirage-bench/2"
# Baselines in the order the columns show them; any other name follows, sorted.
BASELINES = ("unfused", "eager", "compile", "sdpa")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _clean(v: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def document(device: str, arch: str, command: str, bw: Bandwidth, rows: list[Row],
             unfinished: str = "") -> dict[str, Any]:
    """The results as one JSON-ready document. ``unfinished`` (e.g. "3 of 8 program
    and batch pairs measured") marks the report a run writes while it goes on: the key
    is absent from a finished run's report."""
    doc = {"format": FORMAT, "device": device, "arch": arch, "command": command,
           "bandwidth": bw.as_json(), "rows": [asdict(r) for r in rows]}
    if unfinished:
        doc["unfinished"] = unfinished
    return _clean(doc)


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


def baselines(doc: dict[str, Any]) -> list[str]:
    """Baseline names present in the rows, in column order."""
    names = {k for r in doc["rows"] for k in r["baselines"]}
    return [b for b in BASELINES if b in names] + sorted(names - set(BASELINES))


def bandwidth_line(doc: dict[str, Any]) -> str:
    bw = doc["bandwidth"]
    return (f"memory floor = bytes of inputs + outputs / {bw['copy_kernel_bytes_per_s'] / 1e9:.0f}"
            f" GB/s, the bandwidth of a 16-byte streaming copy kernel ({bw['launch']}) "
            f"measured in the same process, bytes read + written "
            f"(cuMemcpyDtoDAsync: {bw['memcpy_bytes_per_s'] / 1e9:.0f} GB/s)")


def fmt_us(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def speedup(base: Any, us: Any) -> str:
    return "-" if base is None or us is None else f"{base / us:.2f}×"


def floor_pct(r: dict[str, Any]) -> str:
    return "-" if r["us"] is None else f"{100 * r['floor_us'] / r['us']:.0f}%"


def rel_err(r: dict[str, Any]) -> str:
    return "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"


def variant_cell(r: dict[str, Any]) -> str:
    """The variant's label, with why it has no time when it has none."""
    if r["ok"] and not r["reason"]:
        return str(r["variant"])
    return f"{r['variant']} ({r['reason']})" if r["ok"] else f"{r['variant']} FAIL: {r['reason']}"


def kernel_cell(index: int, k: dict[str, Any]) -> str:
    """A kernel timed alone, as the variant cell of its line under the row: its index in
    launch order, operator, launch configuration and achieved rates."""
    grid = "×".join(str(d) for d in k["grid"])
    tf, gb = k.get("tflop_s"), k.get("gb_s")
    rates = "" if tf is None or gb is None else f": {tf:.2f} TFLOP/s, {gb:.0f} GB/s"
    return f"└ k{index} {k.get('op') or 'kernel'} grid {grid}, {k['threads']} threads{rates}"


def kernel_lines(r: dict[str, Any], width: int) -> list[list[str]]:
    """The lines under a row, one per kernel timed alone (``--per-kernel``), its µs in
    the µs column; none for a row whose kernels were not timed one by one."""
    return [["", "", kernel_cell(i, k), fmt_us(k["us"])] + [""] * (width - 4)
            for i, k in enumerate(r["kernels"]) if "us" in k]


def table_cells(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the results table (Markdown and the terminal share them);
    a baseline a row's program has none of (``sdpa`` beside a program that is not
    plain attention) is "-"."""
    names = baselines(doc)
    head = (["benchmark", "batch", "variant", "µs"] + [f"{b} µs" for b in names]
            + ["floor µs"] + [f"vs {b}" for b in names]
            + ["% of floor", "predicted µs", "rel err"])
    body = []
    for r in doc["rows"]:
        b = r["baselines"]
        body.append([str(r["benchmark"]), str(r["batch"]), variant_cell(r), fmt_us(r["us"])]
                    + [fmt_us(b.get(n)) for n in names] + [f"{r['floor_us']:.1f}"]
                    + [speedup(b.get(n), r["us"]) for n in names]
                    + [floor_pct(r), fmt_us(r["predicted_us"]), rel_err(r)])
        body += kernel_lines(r, len(head))
    return head, body


def markdown(doc: dict[str, Any]) -> str:
    """The table in Markdown, under a line giving the bandwidth of the floor."""
    head, body = table_cells(doc)
    align = ["---", "---:", "---"] + ["---:"] * (len(head) - 3)
    lines = [f"{bandwidth_line(doc)}.", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(align) + "|"]
    if doc.get("unfinished"):
        lines[:0] = [f"**Unfinished run: {doc['unfinished']}.**", ""]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("benchmark", "batch", "variant", "shipped", "ok", "us")


def csv_text(doc: dict[str, Any]) -> str:
    """One CSV row per (benchmark, batch, variant); the kernels (launch configuration
    and plan; with ``--per-kernel`` also µs and rates) as a JSON array in the last
    column."""
    names = baselines(doc)
    bw = doc["bandwidth"]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow([*CSV_FIELDS, *(f"{n}_us" for n in names), "floor_us", "floor_fraction",
                "bandwidth_gb_s", "memcpy_gb_s", "rel_err", "predicted_us", "reason",
                "kernels"])
    for r in doc["rows"]:
        frac = None if r["us"] is None else r["floor_us"] / r["us"]
        w.writerow([r["benchmark"], r["batch"], r["variant"], int(r["shipped"]), int(r["ok"]),
                    _num(r["us"]), *(_num(r["baselines"].get(n)) for n in names),
                    _num(r["floor_us"]), _num(frac), _num(r["bandwidth"] / 1e9),
                    _num(bw["memcpy_bytes_per_s"] / 1e9), _num(r["rel_err"]),
                    _num(r["predicted_us"]), r["reason"],
                    json.dumps(r["kernels"], sort_keys=True, separators=(",", ":"))])
    return out.getvalue()


def _num(v: Any) -> str:
    return "" if v is None else repr(float(v))


# -- the plot ------------------------------------------------------------------------------


def require_matplotlib(path: str) -> None:
    """Checked before any measurement, so a long run never ends on a missing plotter."""
    if not path.lower().endswith(PLOT_SUFFIXES):
        raise MirageError(f"--plot {path}: the file must end in "
                          f"{', '.join(PLOT_SUFFIXES)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MirageError("--plot needs matplotlib, which is not installed "
                          "(pip install matplotlib, or the project's 'dev' extra)") from None


def plot_series(doc: dict[str, Any], benchmark: str
                ) -> tuple[list[int], list[str], dict[str, list[float | None]], list[float]]:
    """For one benchmark: batches, series labels (variants, then baselines), µs of each
    series per batch (``None``: no time), and the floor per batch."""
    rows = [r for r in doc["rows"] if r["benchmark"] == benchmark
            and not str(r["variant"]).startswith("baseline ")]
    batches = sorted({r["batch"] for r in rows})
    labels: list[str] = []
    for r in rows:
        if r["variant"] not in labels and r["variant"] != "(no fused µGraph)":
            labels.append(r["variant"])
    names = baselines(doc)
    series: dict[str, list[float | None]] = {k: [None] * len(batches) for k in labels + names}
    floors = [0.0] * len(batches)
    for r in rows:
        i = batches.index(r["batch"])
        floors[i] = r["floor_us"]
        if r["variant"] in series:
            series[r["variant"]][i] = r["us"]
        for n in names:
            if r["baselines"].get(n) is not None:
                series[n][i] = r["baselines"][n]
    return batches, labels + names, series, floors


def plot(doc: dict[str, Any], path: str) -> bytes:
    """Grouped bars of µs per call: one panel per benchmark, one group per batch, one bar
    per variant and baseline; the memory floor is the black line across each group.
    A panel whose times span more than 20× has a log axis. Returns the image bytes."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    benches = sorted({r["benchmark"] for r in doc["rows"]})
    if not benches:
        raise MirageError("--plot: no rows to plot")
    fig, axes = plt.subplots(len(benches), 1, figsize=(11, 3.2 * len(benches)), squeeze=False)
    for ax, bench in zip(axes[:, 0], benches):
        _panel(ax, doc, bench)
    bw = doc["bandwidth"]
    fig.suptitle(f"mirage bench on {doc['device']} ({doc['arch']}): median µs per call, lower "
                 f"is better\nmemory floor: inputs + outputs at "
                 f"{bw['copy_kernel_bytes_per_s'] / 1e9:.0f} GB/s (16-byte copy kernel; "
                 f"cuMemcpyDtoDAsync {bw['memcpy_bytes_per_s'] / 1e9:.0f} GB/s)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fmt = path.rsplit(".", 1)[-1].lower()
    fig.savefig(buf, format=fmt, dpi=120, metadata={"Software": None} if fmt == "png" else None)
    plt.close(fig)
    return buf.getvalue()


def _panel(ax: Any, doc: dict[str, Any], bench: str) -> None:
    batches, labels, series, floors = plot_series(doc, bench)
    width = 0.8 / max(1, len(labels))
    times = [t for v in series.values() for t in v if t is not None and t > 0]
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    missing: list[float] = []
    handles: list[Any] = []
    for j, label in enumerate(labels):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(batches))]
        timed = [(x, t) for x, t in zip(xs, series[label]) if t is not None]
        # No time (failed, not applicable, not run) is marked, not hidden.
        missing += [x for x, t in zip(xs, series[label]) if t is None]
        face, hatch = color(label), "//" if label in BASELINES else None
        style: dict[str, Any] = {"color": face, "hatch": hatch, "edgecolor": "white",
                                 "linewidth": 0.3}
        bars = ax.bar([x for x, _ in timed], [t for _, t in timed], width, **style)
        ax.bar_label(bars, [f"{t:.1f}" for _, t in timed], fontsize=6, padding=1)
        # Explicit legend entries: a series with no bar at all still gets its colour.
        handles.append(Patch(facecolor=face, hatch=hatch,
                             edgecolor="white", label=label if timed else f"{label} (no time)"))
    for i, f in enumerate(floors):
        ax.hlines(f, i - 0.45, i + 0.45, colors="black", linewidth=1.5)
    handles.append(Line2D([], [], color="black", linewidth=1.5, label="memory floor"))
    spread = times + [f for f in floors if f > 0]
    if spread and max(spread) / min(spread) > 20:
        ax.set_yscale("log")
    for x in missing:  # y in axes coordinates: at the bottom whatever the scale
        ax.text(x, 0.02, "×", ha="center", va="bottom", fontsize=7, color="red",
                transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("µs per call")
    ax.set_title(bench, fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


# One colour per role, the same in every panel: what opt ships stands out, its other
# candidates are lighter shades, hand-written µGraphs green, Mirage's own candidates
# (--mirage-ckpt) purple, baselines warm and hatched.
_ROLE_COLORS = {"unfused": "#9e9e9e", "eager": "#ff7f0e", "compile": "#d62728",
                "sdpa": "#8c564b"}
_OPT_SHADES = ("#6baed6", "#9ecae1", "#c6dbef")
_HAND_SHADES = ("#2ca02c", "#74c476", "#a1d99b")
_MIRAGE_SHADES = ("#6a51a3", "#9e9ac8", "#cbc9e2")


def color(label: str) -> str:
    """The bar colour of a series label (a baseline, ``opt#k``, ``mirage#k``, or a
    µGraph's name)."""
    if label in _ROLE_COLORS:
        return _ROLE_COLORS[label]
    if label.endswith("(shipped)"):
        return "#08519c"
    for prefix, shades in (("opt#", _OPT_SHADES), ("mirage#", _MIRAGE_SHADES)):
        if label.startswith(prefix):
            digits = "".join(c for c in label[len(prefix):] if c.isdigit())
            return shades[(int(digits or 1) - 1) % len(shades)]
    if label == "mirage":
        return _MIRAGE_SHADES[0]
    return _HAND_SHADES[sum(map(ord, label)) % len(_HAND_SHADES)]
