"""How well the cost model ranks measured kernels (issue 10, Must-show 2). No GPU needed.

    PYTHONPATH=$PWD python tools/model_fit.py MEASURED.json... [--target sm_90/h200]
        [--calibrated device.json] [--png scatter.png] [--json report.json]
        [--vary FIGURE=V1,V2,... ...]

MEASURED.json (one or more, e.g. one per batch) is what ``tools/selection_table.py``
writes (every timed variant of the six examples with its µGraph and measured µs). For
the uncalibrated model (``--target``, default the shipped H200 profile) and the
calibrated one, reports the Spearman rank correlation between predicted and measured
time over all correct timed variants, and per example (program at a batch) whether the
model's pick is within 15% of the measured best. The pick is the first of the model's
ranking, as `mirage opt` chooses: the lowest prediction, predictions within 1% of it
ordered by the stated tie rule. The calibrated model is ``--calibrated`` when given;
otherwise its coefficients are fitted here (``mirage calibrate --fit``), and the
figures are reported both in sample and leave-one-program-out (fitted without the
program it then predicts), since an in-sample fit flatters itself. ``--png`` draws the
scatter plot (predicted vs measured, log-log) when matplotlib is installed.

``--vary FIGURE=V1,V2,...`` (repeatable) evaluates the ``--target`` profile with each
combination of those values of its figures (e.g. ``bulk_l2_bw=3e12,4.2e12
bulk_mem_util_exp=0,0.25``: the figures the measured data should decide) and prints
one line per combination, the most picks within 15% first, then the higher Spearman.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

from mirage_cli import profiles, serialize
from mirage_cli.profiles import Profile
from mirage_cli.profiles import calibrate as cal

PICK_WITHIN = cal.PICK_WITHIN
RHO_GOAL = 0.8


def report(samples: list[cal.Sample], costs: list[Any]) -> dict[str, Any]:
    """Spearman over everything; per example the pick ratio (of the variant the model's
    ranking puts first, tie rule included: what `mirage opt` would choose) and its own
    Spearman."""
    measured = [s.measured_us for s in samples]
    predicted = [c.time_us for c in costs]
    canonical = [serialize.dumps(s.graph) for s in samples]
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    per = {}
    for g, idx in sorted(groups.items()):
        p, m = [predicted[i] for i in idx], [measured[i] for i in idx]
        pick = cal.model_pick([costs[i] for i in idx], [canonical[i] for i in idx])
        ratio = cal.pick_ratio(p, m, pick)
        per[g] = {"variants": len(idx), "pick_ratio": round(ratio, 4),
                  "within_15pct": ratio <= PICK_WITHIN, "spearman": _r(cal.spearman(p, m))}
    rho = cal.spearman(predicted, measured)
    return {"samples": len(samples), "spearman": _r(rho),
            "spearman_ok": not math.isnan(rho) and rho >= RHO_GOAL,
            "picks_within_15pct": sum(v["within_15pct"] for v in per.values()),
            "examples": len(per), "per_example": per}


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def leave_one_program_out(samples: list[cal.Sample], base: Profile) -> list[Any]:
    """Costs under a model fitted without the predicted sample's program."""
    prog = [s.group.split("@")[0] for s in samples]
    out: list[Any] = [None] * len(samples)
    for name in sorted(set(prog)):
        train = [s for s, p in zip(samples, prog) if p != name]
        test = [i for i, p in enumerate(prog) if p == name]
        fitted = cal.fit(train, base) if train else base
        for i, t in zip(test, cal.estimates([samples[i] for i in test], fitted)):
            out[i] = t
    return out


def scatter(path: str, samples: list[cal.Sample], series: dict[str, list[float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no scatter plot ({path})", file=sys.stderr)
        return
    measured = [s.measured_us for s in samples]
    fig, ax = plt.subplots(figsize=(6, 6))
    for label, pred in series.items():
        ax.scatter(pred, measured, s=10, alpha=0.6, label=label)
    lo = min(min(measured), *(min(p) for p in series.values()))
    hi = max(max(measured), *(max(p) for p in series.values()))
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted µs")
    ax.set_ylabel("measured µs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_vary(specs: list[str], base: Profile) -> list[tuple[str, list[float]]]:
    """``FIGURE=V1,V2`` specs as (figure, values), checked against the profile's fields."""
    names = {f.name for f in dataclasses.fields(base)} - {"fit", "extra", "name", "device",
                                                           "arch", "source", "calibrated"}
    out = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in names or not values:
            raise SystemExit(f"--vary {spec}: expected FIGURE=V1,V2,... with FIGURE one of "
                             f"{', '.join(sorted(names))}")
        try:
            out.append((name, [float(v) for v in values.split(",")]))
        except ValueError:
            raise SystemExit(f"--vary {spec}: the values must be numbers") from None
    return out


def vary(samples: list[cal.Sample], base: Profile, figures: list[tuple[str, list[float]]]
         ) -> list[tuple[dict[str, float], dict[str, Any]]]:
    """The report of every combination of the figures' values, best first."""
    runs = []
    for combo in itertools.product(*(vals for _, vals in figures)):
        setting = {name: v for (name, _), v in zip(figures, combo)}
        r = report(samples, cal.estimates(samples, dataclasses.replace(base, **setting)))
        runs.append((setting, r))
    runs.sort(key=lambda x: (-x[1]["picks_within_15pct"], -(x[1]["spearman"] or -1.0)))
    return runs


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("measured", nargs="+")
    ap.add_argument("--target", default="sm_90/h200")
    ap.add_argument("--calibrated", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--vary", action="append", default=[], metavar="FIGURE=V1,V2,...")
    a = ap.parse_args(argv)
    samples = [s for f in a.measured
               for s in cal.load_samples(json.loads(Path(f).read_text()), f)]
    base = profiles.load(a.target)
    if a.vary:
        for setting, r in vary(samples, base, parse_vary(a.vary, base)):
            shown = ", ".join(f"{k}={v:g}" for k, v in setting.items())
            print(f"{shown}: picks within 15% {r['picks_within_15pct']}/{r['examples']}, "
                  f"Spearman {r['spearman']}")
        return 0
    series = {f"uncalibrated ({base.name})": cal.estimates(samples, base)}
    if a.calibrated:
        calibrated = profiles.load(a.calibrated)
        series[f"calibrated ({calibrated.name})"] = cal.estimates(samples, calibrated)
    else:
        fitted = cal.fit(samples, base)
        series["fitted, in sample"] = cal.estimates(samples, fitted)
        series["fitted, leave one program out"] = leave_one_program_out(samples, base)
    doc = {name: report(samples, costs) for name, costs in series.items()}
    for name, r in doc.items():
        print(f"{name}: Spearman {r['spearman']} over {r['samples']} variants "
              f"({'>=' if r['spearman_ok'] else '<'} {RHO_GOAL}); pick within 15% on "
              f"{r['picks_within_15pct']}/{r['examples']} examples")
        for g, v in r["per_example"].items():
            print(f"  {g}: pick {v['pick_ratio']:.3f}x the best "
                  f"({'ok' if v['within_15pct'] else 'NO'}), Spearman {v['spearman']}, "
                  f"{v['variants']} variants")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if a.png:
        scatter(a.png, samples, {name: [c.time_us for c in costs]
                                 for name, costs in series.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
