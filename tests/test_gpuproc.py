"""The device's child process (mirage_cli.search.gpuproc), with fake servers: no GPU."""

from __future__ import annotations

import functools
import os
import time

import pytest

from mirage_cli.diagnostics import MirageError
from mirage_cli.search.gpuproc import Fault, Worker


class FakeServer:
    """Answers a job by name: its pid, a fault, a death, a hang, or an error."""

    device = "Fake GPU"
    arch = "sm_90"

    def __init__(self, fail_open: bool = False) -> None:
        if fail_open:
            raise MirageError("no usable CUDA GPU here (fake)")

    def run(self, job: str) -> object:
        if job == "pid":
            return os.getpid()
        if job == "fault":
            raise RuntimeError("cuStreamSynchronize failed: CUDA_ERROR_LAUNCH_FAILED")
        if job == "die":
            os._exit(3)
        if job == "hang":
            time.sleep(60)
        if job == "diagnostic":
            raise MirageError("the cubin does not load")
        raise ValueError(f"unknown job {job}")


@pytest.fixture
def worker():
    w = Worker(FakeServer, job_timeout_s=5)
    yield w
    w.close()


def test_the_worker_reports_its_device_and_answers_jobs(worker: Worker) -> None:
    assert (worker.device, worker.arch) == ("Fake GPU", "sm_90")
    first = worker.run("pid")
    assert first != os.getpid() and worker.run("pid") == first


@pytest.mark.parametrize("job", ["fault", "die", "hang"])
def test_a_job_that_ends_its_worker_faults_and_the_next_job_gets_a_fresh_one(
        worker: Worker, job: str) -> None:
    before = worker.run("pid")
    with pytest.raises(Fault):
        worker.run(job)
    after = worker.run("pid")
    assert after != before


def test_other_failures_are_reported_and_keep_the_worker(worker: Worker) -> None:
    before = worker.run("pid")
    with pytest.raises(MirageError, match="does not load"):
        worker.run("diagnostic")
    with pytest.raises(RuntimeError, match="ValueError: unknown job"):
        worker.run("nonsense")
    assert worker.run("pid") == before


def test_a_device_that_does_not_open_is_a_diagnostic() -> None:
    with pytest.raises(MirageError, match="no usable CUDA GPU here"):
        Worker(functools.partial(FakeServer, True))


def test_close_stops_the_child_and_is_idempotent() -> None:
    w = Worker(FakeServer)
    proc = w._proc
    w.close()
    w.close()
    assert not proc.is_alive()
