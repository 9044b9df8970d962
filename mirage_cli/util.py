"""Output files, written as a compiler's build system expects them.

- Atomic: data goes to a temporary file in the target's directory, then a rename, so
  a reader never sees half a file; a set of files (``.cu``, ``.h``, depfile) is
  written as one :class:`OutputSet`: every temporary is written before the first
  rename, and a failure leaves none of them behind.
- Only regular files: an existing device node, FIFO, socket or directory is refused
  (``-o -`` is how to ask for stdout); a symlink is followed, so the file it points
  to is replaced and the link is kept.
- Never over an input: an output that is the same file as an input is refused.
- Unchanged files keep their modification time: identical content is not rewritten,
  so dependents in Make or Ninja do not rebuild.
- New files get the mode a plain ``open()`` would give them (0666 less the umask).
- An :class:`OutputSet` holds an advisory lock (``.<name>.lock`` beside its first
  file) from before the work until after the renames, so concurrent runs writing
  the same outputs produce one run's complete set, never a mix. The lock file is
  removed when the run ends (nothing is left beside the outputs; a run killed by a
  signal leaves the empty file, which the next run takes over and removes).
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from mirage_cli.diagnostics import MirageError


def file_mode() -> int:
    """0666 less the process umask (what ``open(path, 'w')`` would create)."""
    old = os.umask(0o022)
    os.umask(old)
    return 0o666 & ~old


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def output_target(path: str | os.PathLike[str], inputs: Sequence[str] = ()) -> Path:
    """The regular file that writing ``path`` replaces (symlinks followed), or a
    diagnostic: not a regular file, or the same file as one of ``inputs``."""
    target = Path(os.path.realpath(path))
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise MirageError(f"cannot write the output: {e.strerror}", file=str(path)) from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        hint = " (use -o - for standard output)" if not stat.S_ISDIR(st.st_mode) else ""
        raise MirageError(f"refusing to write to a {_kind(st.st_mode)}; outputs are regular "
                          f"files{hint}", file=str(path))
    for src in inputs:
        if src != "-" and (os.path.realpath(src) == str(target)
                           or (st is not None and os.path.exists(src)
                               and os.path.samefile(src, target))):
            raise MirageError(f"the output is the input file {src}: refusing to overwrite it",
                              file=str(path))
    return target


def _same_content(target: Path, payload: bytes) -> bool:
    try:
        if target.stat().st_size != len(payload):
            return False
        return target.read_bytes() == payload
    except OSError:
        return False


def _stage(target: Path, payload: bytes, mode: int) -> str:
    """Write ``payload`` to a new temporary beside ``target``; its path."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(payload)
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _encode(data: str | bytes) -> bytes:
    return data if isinstance(data, bytes) else data.encode("utf-8")


def _write_all(files: Sequence[tuple[str | os.PathLike[str], str | bytes]],
               inputs: Sequence[str]) -> list[str]:
    """:func:`write_files` that lets an OSError through (after cleaning up)."""
    mode = file_mode()
    staged: list[tuple[str, Path, str]] = []
    try:
        for path, data in files:
            target = output_target(path, inputs)
            payload = _encode(data)
            if not _same_content(target, payload):
                staged.append((_stage(target, payload, mode), target, str(path)))
        for tmp, target, _ in staged:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _, _ in staged:
            _unlink(tmp)
        raise
    return [p for _, _, p in staged]


def write_files(files: Sequence[tuple[str | os.PathLike[str], str | bytes]],
                inputs: Sequence[str] = ()) -> list[str]:
    """Write every ``(path, data)`` as one unit (see the module docstring); the paths
    whose content changed. Raises :class:`MirageError` (exit 2) when a file cannot be
    written, having changed nothing."""
    try:
        return _write_all(files, inputs)
    except OSError as e:
        name = e.filename or (str(files[0][0]) if files else None)
        raise MirageError(f"cannot write the output: {e.strerror or e}",
                          file=str(name) if name else None) from None


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> bool:
    """Write one file atomically (see the module docstring); whether it changed.
    Raises OSError when it cannot (callers such as the cache ignore that)."""
    return bool(_write_all([(path, data)], ()))


class OutputSet:
    """The outputs of one command: checked and locked on entry (before any long work),
    written together by :meth:`commit`.

    ``with OutputSet([cu, h, d], inputs=[src]) as out: ...; out.commit({cu: text, ...})``
    """

    def __init__(self, paths: Sequence[str], inputs: Sequence[str] = ()) -> None:
        self.paths = list(paths)
        self.inputs = list(inputs)
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None

    def __enter__(self) -> Self:
        targets = [output_target(p, self.inputs) for p in self.paths]
        if len(set(targets)) != len(targets):
            raise MirageError("two outputs name the same file: "
                              + ", ".join(self.paths))
        self._lock(targets[0], self.paths[0])
        return self

    def _lock(self, target: Path, shown: str) -> None:
        from mirage_cli.console import info

        lock = target.parent / f".{target.name}.lock"
        self._lock_path = lock
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MirageError(f"cannot write the output: {e.strerror}", file=shown) from None
        told = False
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode())
            except OSError as e:
                raise MirageError(f"cannot write the output: {e.strerror}",
                                  file=shown) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    info(f"waiting for another mirage run writing {shown}")
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            # The holder before us removes the file before it unlocks: a lock on a
            # file no longer at the path (or replaced by a newer run's) locks
            # nothing; open the path again.
            if _same_file(fd, lock):
                self._lock_fd = fd
                return
            os.close(fd)

    def commit(self, files: dict[str, str | bytes]) -> list[str]:
        """Write ``files`` (a subset of the paths given) as one unit; the changed ones."""
        unknown = set(files) - set(self.paths)
        assert not unknown, unknown
        return write_files([(p, files[p]) for p in self.paths if p in files], self.inputs)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._lock_fd is not None:
            # Removed while still held, so no other run can hold a lock on it: one
            # that opened it meanwhile sees, once it gets the lock, that the file is
            # gone from the path, and starts again (see _lock).
            try:
                if self._lock_path is not None:
                    os.unlink(self._lock_path)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None



def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file now at ``path``."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
