"""The directory lock that lets several processes share one disk-tier directory.

``tierkv.lock`` in the directory is locked with ``fcntl.flock``: exclusively by anything that
appends, scans a file tail, truncates a torn tail, compacts, deletes a segment or replaces the
manifest; shared by a process that only reads a consistent snapshot of the manifest. Reading a
record needs no lock at all: records never change after they are written and segment names are
never reused, so a process whose index is stale at worst finds a segment gone and rescans.
Within a process one ``threading.RLock`` guards the flock, so threads nest freely.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading

LOCK_NAME = "tierkv.lock"


class DirLock:
    """A re-entrant, process-shared lock on ``<directory>/tierkv.lock``.

    Parameters
    ----------
    dir_fd : int
        An open descriptor of the directory (the lock file is created relative to it).
    create : create the lock file when it is missing; when False and it is missing, the lock
        holds nothing across processes (a read-only look at a directory no process uses).
    """

    def __init__(self, dir_fd: int, create: bool = True):
        try:
            self._fd = os.open(LOCK_NAME, (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
                               | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        except FileNotFoundError:
            self._fd = None
        self._mutex = threading.RLock()
        self._depth = 0
        self._mode = None

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the directory exclusively (re-entrant within this process)."""
        with self._hold(fcntl.LOCK_EX):
            yield

    @contextlib.contextmanager
    def shared(self):
        """Hold the directory shared with other readers (exclusive holders are waited for)."""
        with self._hold(fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def _hold(self, mode: int):
        with self._mutex:
            outer = self._depth == 0
            if outer:
                if self._fd is not None:
                    fcntl.flock(self._fd, mode)
                self._mode = mode
            elif mode == fcntl.LOCK_EX and self._mode != fcntl.LOCK_EX:
                raise RuntimeError("cannot upgrade a shared directory lock to exclusive")
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if outer:
                    self._mode = None
                    if self._fd is not None:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
