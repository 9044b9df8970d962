"""Conformance of every registry row (see tests/registry_conformance.py), and what
adding an operator or an accumulator takes: one row, shown on a scratch registry."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import registry_conformance as rc

from mirage_cli import ops
from mirage_cli.codegen.runner import gpu_available
from mirage_cli.diagnostics import MirageError
from mirage_cli.semantics import fieldsem, terms
from mirage_cli.semantics.accum import (
    AccumSpec,
    AccumSpecError,
    Combine,
    Finish,
    Pre,
    Reduce,
    np_accumulate,
)


def _nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC bindings missing")


@pytest.fixture(scope="module")
def device():  # type: ignore[no-untyped-def]
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.runner import Device
    return Device(0)


def tanh_row(spelling: str = "tanhf({0})") -> ops.OpDef:
    """tanh, as a user would add it: one row (CUDA has the intrinsic, so no helper)."""
    return ops.elementwise("tanh", 1, np.tanh, terms.unary("tanh"),
                           fieldsem.random_sem("tanh"), spelling,
                           lambda t, xs, a: t.tanh(xs[0]), "element-wise tanh")


ACC_MIN = AccumSpec(Pre.ID, Reduce.LAST, Combine.MIN, Finish.ID)


@pytest.fixture
def scratch() -> Iterator[dict[str, ops.OpDef]]:
    with ops.scratch_registry() as reg:
        yield reg


def test_operators_cover_the_registry() -> None:
    names = rc.operators()
    assert set(ops.ACCUMULATORS) <= set(names) and "matmul" in names and "exp" in names
    assert all(ops.BLOCK in ops.get(n).levels or ops.get(n).decompose is None for n in names)
    kernel_only = {n for n, d in ops.REGISTRY.items() if ops.BLOCK not in d.levels}
    # softmax: through its decomposition; reshape: the movement pair (rotate_half has a
    # block form, compared on row blocks as every other operator's)
    assert kernel_only == {"custom", "softmax", "reshape"}
    assert {"reshape", "rotate_half"} <= set(names)


@needs_nvrtc
@pytest.mark.parametrize("op", rc.operators())
def test_row_conforms(op: str) -> None:
    rc.conforms_on_cpu(op)


@pytest.mark.gpu
@pytest.mark.parametrize("op", rc.operators())
def test_row_runs_on_gpu(device, op: str) -> None:  # type: ignore[no-untyped-def]
    rc.runs_on_gpu(device, rc.pair(op))


@needs_nvrtc
def test_adding_tanh_and_a_min_accumulator_takes_one_row_each(scratch) -> None:  # type: ignore[no-untyped-def]
    ops.register(tanh_row())
    ops.register(ops.accumulator("acc_min_ld", ACC_MIN))
    assert "tanh" in rc.operators() and "acc_min_ld" in rc.operators()
    rc.conforms_on_cpu("tanh")
    rc.conforms_on_cpu("acc_min_ld")


def test_the_scratch_registry_is_gone_afterwards() -> None:
    with ops.scratch_registry():
        ops.register(tanh_row())
    assert "tanh" not in ops.REGISTRY


@pytest.mark.gpu
def test_tanh_and_min_accumulator_run_on_gpu(device, scratch) -> None:  # type: ignore[no-untyped-def]
    ops.register(tanh_row())
    ops.register(ops.accumulator("acc_min_ld", ACC_MIN))
    rc.runs_on_gpu(device, rc.pair("tanh"))
    rc.runs_on_gpu(device, rc.pair("acc_min_ld"))


@needs_nvrtc
def test_a_broken_cuda_spelling_fails_the_suite(scratch) -> None:  # type: ignore[no-untyped-def]
    ops.register(tanh_row("tanhff({0})"))
    p = rc.pair("tanh")
    rc.numpy_agrees(p)  # every other meaning is right: only the spelling is wrong
    rc.field_agrees(p)
    with pytest.raises(MirageError, match="tanhff"):
        rc.conforms_on_cpu("tanh")


def test_min_is_not_max_to_the_verifier(scratch) -> None:  # type: ignore[no-untyped-def]
    """A min accumulator that some interpretation treated as max (or as a sum) would
    verify against the max one; the field models them as different functions."""
    from mirage_cli.verifier.api import Verifier

    ops.register(ops.accumulator("acc_min_ld", ACC_MIN))
    p_min, p_max = rc.pair("acc_min_ld"), rc.pair("acc_max_ld")
    mx = rc.parse_text(rc._accum_program("cand", ops.get("acc_max_ld"), rc.GRID), "m.mir")
    assert Verifier(p_min.candidate).check(mx).equivalent is False
    assert Verifier(p_max.candidate).check(mx).equivalent is True


# -- accumulator kinds ---------------------------------------------------------------

_ALL_SPECS = list(itertools.product(Pre, Reduce, Combine, Finish))


def _valid(kinds: tuple[Pre, Reduce, Combine, Finish]) -> bool:
    try:
        AccumSpec(*kinds)
    except AccumSpecError:
        return False
    return True


def test_validation_refuses_what_has_no_meaning() -> None:
    with pytest.raises(AccumSpecError, match="finish mean of combine max"):
        AccumSpec(Pre.ID, Reduce.NONE, Combine.MAX, Finish.MEAN)
    with pytest.raises(AccumSpecError, match="to_width"):
        AccumSpec(Pre.ID, Reduce.TO_WIDTH, Combine.MIN, Finish.ID)
    with pytest.raises(AccumSpecError, match="unknown accumulator combine 'median'"):
        AccumSpec("id", "none", "median", "id")  # type: ignore[arg-type]
    assert AccumSpec("id", "last", "min", "id").combine is Combine.MIN  # type: ignore[arg-type]
    assert sum(map(_valid, _ALL_SPECS)) == 18 + 2 * 2 * 2  # sums: all; max/min: id finish


def test_numpy_meaning_of_each_combine() -> None:
    tiles = np.arange(24, dtype=np.float64).reshape(2, 3, 4) - 7.0
    last = {c: np_accumulate(AccumSpec(Pre.ID, Reduce.LAST, c, Finish.ID), tiles, None)
            for c in Combine}
    np.testing.assert_array_equal(last[Combine.SUM][:, 0], tiles.sum(axis=(0, 2)))
    np.testing.assert_array_equal(last[Combine.MAX][:, 0], tiles.max(axis=(0, 2)))
    np.testing.assert_array_equal(last[Combine.MIN][:, 0], tiles.min(axis=(0, 2)))


@needs_nvrtc
@pytest.mark.parametrize("kinds", [k for k in _ALL_SPECS if _valid(k)],
                         ids=lambda k: "-".join(x.value for x in k))
def test_every_valid_accumulator_conforms(scratch, kinds) -> None:  # type: ignore[no-untyped-def]
    ops.register(ops.accumulator("acc_scratch", AccumSpec(*kinds)))
    rc.conforms_on_cpu("acc_scratch")


def test_numpy_and_field_disagreeing_fails_the_suite(scratch) -> None:  # type: ignore[no-untyped-def]
    """A row whose numpy meaning is add but whose field meaning is sub: each form agrees
    with itself, so only the cross-check between interpretations can catch it."""
    sub = ops.get("sub")
    ops.register(ops.elementwise("bad_add", 2, np.add, terms.elementwise(terms.add, "add"),
                                 sub.field, "({0} + {1})", lambda t, xs, a: xs[0] + xs[1],
                                 "add whose field meaning is sub"))
    p = rc.pair("bad_add")
    rc.numpy_agrees(p)
    rc.field_agrees(p)
    with pytest.raises(AssertionError, match="bad_add"):
        rc.numpy_matches_field(p)
