"""Every pair of the soundness corpus is judged correctly by both methods."""

from __future__ import annotations

import pytest
from verifier_corpus import EQUIVALENT, NOT_EQUIVALENT

from mirage_cli.verifier.api import Verifier


def test_corpus_size() -> None:
    assert len(EQUIVALENT) >= 30 and len(NOT_EQUIVALENT) >= 30


@pytest.mark.parametrize("name,a,b", EQUIVALENT, ids=[e[0] for e in EQUIVALENT])
def test_equivalent(name: str, a, b) -> None:  # type: ignore[no-untyped-def]
    cert = Verifier(a(), seed=7).certify(b())
    assert cert.field_verdict.equivalent is True, cert.field_verdict
    assert cert.crosscheck is not None and cert.crosscheck.close, cert.crosscheck.summary()
    assert cert.verdict == "equivalent" and cert.final_bound <= 2.0 ** -40


@pytest.mark.parametrize("name,a,b", NOT_EQUIVALENT, ids=[e[0] for e in NOT_EQUIVALENT])
def test_not_equivalent(name: str, a, b) -> None:  # type: ignore[no-untyped-def]
    cert = Verifier(a(), seed=7).certify(b())
    assert cert.field_verdict.equivalent is False, cert.field_verdict
    assert cert.field_verdict.mismatch is not None
    assert cert.crosscheck is not None and not cert.crosscheck.close
    assert cert.verdict == "not equivalent"
