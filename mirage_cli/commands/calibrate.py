"""`mirage calibrate [--gpu N] [--fit MEASURED.json] [--target BASE] -o device.json`.

``--gpu N`` measures the device's figures (streaming and L2 bandwidth, launch latency,
tensor-core and FMA throughput, barrier cost, limits:
:func:`mirage_cli.profiles.calibrate.measure_device`) into a profile based on
``--target``. ``--fit`` fits the model's coefficients to the measured kernel times of
``tools/selection_table.py`` (needs no GPU; with ``--gpu`` the fit uses the freshly
measured figures). The output is a device profile: pass it to ``--target`` of
``opt``/``search``/``explain``/``tune``, or install it as ``mirage_cli/profiles/*.json``.
"""

from __future__ import annotations

import json

import click

from mirage_cli import profiles, serialize
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import read_text
from mirage_cli.util import write_atomic


@click.command("calibrate")
@click.option("--gpu", type=int, default=None, metavar="N", help="Measure GPU N.")
@click.option("--fit", "fit_paths", type=click.Path(dir_okay=False), metavar="MEASURED.json",
              multiple=True,
              help="Fit the model's coefficients to these measured kernel times "
                   "(repeatable: e.g. one table per batch).")
@profiles.target_option
@click.option("-o", "output", required=True, type=click.Path(dir_okay=False),
              help="The device profile to write.")
def command(gpu: int | None, fit_paths: tuple[str, ...], target: str, output: str) -> None:
    """Measure a GPU and/or fit the cost model to measured kernels; write a profile."""
    from mirage_cli.profiles import calibrate

    if gpu is None and not fit_paths:
        raise MirageError("calibrate: give --gpu N (measure a device), --fit MEASURED.json "
                          "(fit the model), or both")
    prof = profiles.load(target)
    samples = []
    for fit_path in fit_paths:  # read and check before any measurement
        try:
            doc = json.loads(read_text(fit_path))
        except json.JSONDecodeError as e:
            raise MirageError(f"{fit_path}:{e.lineno}:{e.colno}: error: invalid JSON: "
                              f"{e.msg}") from None
        samples += calibrate.load_samples(doc, fit_path)
    if gpu is not None:
        from mirage_cli.codegen.runner import Device

        m = calibrate.measure_device(Device(gpu))
        prof = calibrate.profile_from_measurements(prof, m)
        click.echo(f"{m['device']}: DRAM {m['dram_bw'] / 1e12:.2f} TB/s, L2 "
                   f"{m['l2_bw'] / 1e12:.2f} TB/s, launch {m['launch_us']:.2f} us, mma "
                   f"{m['peak_flops'] / 1e12:.0f} TFLOP/s, FMA {m['fma_flops'] / 1e12:.1f} "
                   f"TFLOP/s, barrier {m['barrier_us'] * 1e3:.1f} ns")
    if samples:
        prof = calibrate.fit(samples, prof)
        costs = calibrate.estimates(samples, prof)
        good, rho = calibrate.ranking_score(samples, costs,
                                            [serialize.dumps(s.graph) for s in samples],
                                            [c.time_us for c in costs])
        groups = len({s.group for s in samples})
        click.echo(f"fit over {len(samples)} timed variants: "
                   + ", ".join(f"{k}={v:.4g}" for k, v in prof.fit.items())
                   + f"; Spearman {rho:.3f}; the model's pick within "
                   f"{calibrate.PICK_WITHIN - 1:.0%} of the measured best in {good} of "
                   f"{groups} program(s) at a batch")
    write_atomic(output, json.dumps(prof.as_json(), indent=1, sort_keys=True) + "\n")
