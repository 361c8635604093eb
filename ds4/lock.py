"""The single-instance lock: one process at a time owns the model and the accelerator (product.md §0).

Same contract as ds4: an exclusive, non-blocking `flock` on one machine-wide lock file, `/tmp/ds4.lock`
(the system temp dir), overridable with the environment variable DS4_LOCK_FILE; the holder writes its PID
into the file. A second process fails with `another ds4 process is already running (pid N); refusing to
start` (the CLI prints it as one `ds4:` line and exits 2).

Why a global lock rather than one per model path: the resource being protected is the GPU memory (and on
the CPU path, RAM), which two different models would fight over just as well. Why flock: the kernel
releases it when the process dies, however it dies, so a stale file left by a killed process never blocks
anyone (only the PID text inside is stale, and it is rewritten by the next owner). The file itself is
never deleted, because deleting a lock file races with a process that has just opened it.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from ds4.errors import Ds4Error

LOCK_ENV = "DS4_LOCK_FILE"


class LockError(Ds4Error):
    """Another process holds the instance lock, or the lock file cannot be used."""


def lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or Path(tempfile.gettempdir()) / "ds4.lock")


class InstanceLock:
    """Context manager / explicit acquire-release around the instance lock."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else lock_path()
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> InstanceLock:
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise LockError(f"cannot open the instance lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "pid unknown"
            raise LockError(f"another ds4 process is already running ({who}); refusing to start") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a holder-less file says nothing misleading
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> InstanceLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
