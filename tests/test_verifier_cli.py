"""`mirage verify`: exit codes, certificate JSON, counterexample file, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from verifier_corpus import EQUIVALENT, NOT_EQUIVALENT

from mirage_cli import serialize
from mirage_cli.cli import main


def _pair(corpus, name: str, tmp: Path) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    _, a, b = next(e for e in corpus if e[0] == name)
    pa, pb = tmp / "a.ugraph.json", tmp / "b.ugraph.json"
    pa.write_text(serialize.dumps(a()))
    pb.write_text(serialize.dumps(b()))
    return str(pa), str(pb)


def test_equivalent_json_certificate(tmp_path: Path) -> None:
    a, b = _pair(EQUIVALENT, "online softmax with max rescaling", tmp_path)
    r = CliRunner().invoke(main, ["verify", a, b, "--json", "--seed", "5"])
    assert r.exit_code == 0, r.output
    cert = json.loads(r.stdout)
    assert cert["verdict"] == "equivalent" and cert["seed"] == 5
    assert cert["bound"] <= 2.0 ** -40
    assert cert["fields"]["P"] == 2 * cert["fields"]["Q"] + 1
    assert "random function" in cert["operators"]["max"]
    assert cert["float64"]["verdict"] == "close"
    again = CliRunner().invoke(main, ["verify", a, b, "--json", "--seed", "5"])
    assert again.stdout == r.stdout


def test_bound_and_trials_options(tmp_path: Path) -> None:
    a, b = _pair(EQUIVALENT, "gqa flash decoding", tmp_path)
    r = CliRunner().invoke(main, ["verify", a, b, "--json", "--bound", "1e-30"])
    cert = json.loads(r.stdout)
    assert r.exit_code == 0 and cert["bound"] <= 1e-30
    r = CliRunner().invoke(main, ["verify", a, b, "--json", "--trials", "1"])
    cert = json.loads(r.stdout)
    assert cert["finite_field"]["trials"] == 1
    assert cert["bound"] == cert["per_trial"]["bound"]


def test_not_equivalent_writes_counterexample(tmp_path: Path) -> None:
    a, b = _pair(NOT_EQUIVALENT, "eps dropped", tmp_path)
    out = tmp_path / "ce.npz"
    r = CliRunner().invoke(main, ["verify", a, b, "--counterexample", str(out)])
    assert r.exit_code == 1
    assert "not equivalent" in r.stdout and "differs at" in r.stdout
    z = np.load(out)
    assert not np.allclose(z["output_a/t0"], z["output_b/t0"], rtol=1e-9, atol=0)
    assert "field_input_p/X" in z.files


def test_bad_inputs_exit_2(tmp_path: Path) -> None:
    a, _ = _pair(EQUIVALENT, "gqa flash decoding", tmp_path)
    (tmp_path / "other").mkdir()
    b, _ = _pair(EQUIVALENT, "distributivity", tmp_path / "other")
    r = CliRunner().invoke(main, ["verify", a, b])
    assert r.exit_code == 2 and "input" in r.output
    r = CliRunner().invoke(main, ["verify", a, str(tmp_path / "missing.ugraph.json")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(main, ["verify", a, a, "--bound", "2"])
    assert r.exit_code == 2
