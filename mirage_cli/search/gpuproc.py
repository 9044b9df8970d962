"""The GPU driven from a child process, so that a kernel that faults costs only that process.

A kernel that faults (an illegal or misaligned address, a trap) leaves the CUDA state of
its process unusable: every later driver call returns the fault, and neither resetting
the primary context nor retaining a new one clears it (measured on an H100 with CUDA 13,
docs/perf-log.md v34). Measured selection runs dozens of generated variants in a row; one
that faults must be reported as faulting, not turn every variant after it into an error.
So the device lives in a spawned child (:class:`Worker`): the parent sends each job
through a pipe and reads back its result, and when the child reports a fault, dies, or
does not answer in time, it is replaced by a fresh one before the next job.

The child runs :func:`serve` with an *opener*: a picklable callable that opens the device
in the child and returns a :class:`Server`.
"""

from __future__ import annotations

import multiprocessing
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from mirage_cli.diagnostics import MirageError

OPEN_TIMEOUT_S = 180.0   # importing the bindings and creating a context
JOB_TIMEOUT_S = 300.0    # one job: the float64 reference, a check and the replays


class Server(Protocol):
    """What runs in the child: the device's name, its target, and the jobs."""

    device: str
    arch: str

    def run(self, job: Any) -> Any:
        ...


class Fault(Exception):
    """A job ended its worker: the kernel faulted, the process died or hung."""


def serve(conn: Connection, opener: Callable[[], Server]) -> None:
    """The child's loop: open the device, then answer jobs until told to stop (``None``)
    or until a job faults (the process is unusable after that)."""
    from mirage_cli.codegen.runner import is_sticky

    try:
        server = opener()
    except MirageError as e:
        conn.send(("error", e.message))
        return
    conn.send(("ready", (server.device, server.arch)))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return  # the parent is gone
        if job is None:
            return
        try:
            conn.send(("ok", server.run(job)))
        except MirageError as e:
            conn.send(("mirage", e.message))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the parent
            text = f"{type(e).__name__}: {e}"
            if is_sticky(e):
                conn.send(("fault", text))
                return
            conn.send(("raise", text))


class Worker:
    """A child process running :func:`serve`; :meth:`run` sends it one job."""

    def __init__(self, opener: Callable[[], Server], job_timeout_s: float = JOB_TIMEOUT_S
                 ) -> None:
        self._opener = opener
        self._job_timeout_s = job_timeout_s
        self.device, self.arch = self._start()

    def _start(self) -> tuple[str, str]:
        # spawn, never fork: a forked child would share the parent's CUDA state.
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(child_conn, self._opener), daemon=True,
                           name="mirage-gpu")
        proc.start()
        child_conn.close()
        self._conn, self._proc = conn, proc
        self._finalizer = weakref.finalize(self, _stop, conn, proc)
        try:
            kind, value = self._receive(OPEN_TIMEOUT_S)
        except Fault as e:
            self.close()
            raise MirageError(f"the GPU worker process did not start ({e})") from None
        if kind != "ready":
            self.close()
            raise MirageError(str(value))
        return value

    def _receive(self, timeout_s: float) -> tuple[str, Any]:
        if not self._conn.poll(timeout_s):
            raise Fault(f"no answer in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise Fault(f"the process died (exit code {self._proc.exitcode})") from None

    def run(self, job: Any) -> Any:
        """The child's answer to ``job``. Raises :class:`Fault` (after starting a fresh
        child) when the job ended the child, :class:`MirageError` for a diagnostic, and
        :class:`RuntimeError` with the child's text for any other failure."""
        try:
            self._conn.send(job)
            kind, value = self._receive(self._job_timeout_s)
        except (Fault, OSError) as e:
            self._replace()
            raise Fault(str(e)) from None
        if kind == "ok":
            return value
        if kind == "fault":
            self._replace()
            raise Fault(value)
        if kind == "mirage":
            raise MirageError(value)
        raise RuntimeError(value)

    def _replace(self) -> None:
        # The old child is dead, hung in a kernel, or unusable: kill it, do not wait.
        if self._finalizer.detach() is not None:
            _stop(self._conn, self._proc, wait_s=0)
        self._start()

    def close(self) -> None:
        """Stop the child (idempotent)."""
        self._finalizer()


def _stop(conn: Connection, proc: Any, wait_s: float = 10) -> None:
    if wait_s > 0:
        try:
            conn.send(None)
        except OSError:
            pass  # already gone
        proc.join(wait_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()
