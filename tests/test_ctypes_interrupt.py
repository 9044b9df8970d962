"""Ctrl-C inside a ctypes call (Z3, the CUDA bindings) is an interrupt: exit 130."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mirage_cli.cli import main

LORA = Path(__file__).resolve().parent.parent / "examples" / "lora.mir"


def test_ctrl_c_inside_a_ctypes_call_is_an_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Z3 and the CUDA bindings are ctypes calls: a Ctrl-C during their argument
    conversion surfaces as ctypes.ArgumentError and must still exit 130, not 3."""
    import ctypes

    def interrupted(*args: object, **kwargs: object) -> None:
        raise ctypes.ArgumentError("argument 2: KeyboardInterrupt: ")

    monkeypatch.setattr("mirage_cli.commands.parse.load_graph", interrupted)
    r = CliRunner().invoke(main, ["parse", str(LORA)])
    assert r.exit_code == 130 and "interrupted" in r.output
    monkeypatch.setattr("mirage_cli.commands.parse.load_graph", lambda *a: (_ for _ in ())
                        .throw(ctypes.ArgumentError("argument 1: TypeError: bad")))
    assert CliRunner().invoke(main, ["parse", str(LORA)]).exit_code == 3
