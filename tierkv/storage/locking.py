"""The directory lock that lets several processes share one disk-tier directory.

``tierkv.lock`` in the directory is locked with ``fcntl.flock``: exclusively by anything that
appends, scans a file tail, truncates a torn tail, compacts, deletes a segment or replaces the
manifest; shared by a process that only reads a consistent snapshot of the manifest. Reading a
record needs no lock at all: records never change after they are written and segment names are
never reused, so a process whose index is stale at worst finds a segment gone and rescans.
Within a process one ``threading.RLock`` guards the flock, so threads nest freely.

A document has a lock of its own (``DocHold``), held by the one live cache that writes it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading

from .base import StorageError

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


DOC_LOCK = "tierkv.doc-{}.lock"


class DocInUseError(StorageError):
    """A document of the directory is held by another live cache, in this or another process.

    ``doc`` names it; ``holder`` is the id of the process holding it, when it could be read.
    """

    def __init__(self, path, doc: str, holder: int | None):
        self.doc, self.holder = doc, holder
        by = f"process {holder}" if holder is not None else "another process"
        mine = " (this one)" if holder == os.getpid() else ""
        super().__init__(f"{path}: document {doc!r} is in use by a live cache of {by}{mine}: "
                         "close that cache first; two caches writing one document would "
                         "overwrite each other's records")


class DocHold:
    """An exclusive claim on one document of a directory, across processes, until ``release()``.

    ``tierkv.doc-<doc>.lock`` in the directory is locked with ``fcntl.flock`` (so the claim
    ends with its process, however that ends) and holds the claimant's pid for the error of the
    next one. Releasing unlinks the file while still holding it; a claimant that locked the
    unlinked file finds the name gone or pointing elsewhere, and tries again.

    Raises DocInUseError when another ``DocHold`` (of any process, this one included) has it.
    """

    def __init__(self, dir_fd: int, doc: str, path=""):
        self.doc, self._dir_fd = doc, dir_fd
        self._name = DOC_LOCK.format(doc)
        while True:
            fd = os.open(self._name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _pid_in(fd)
                os.close(fd)
                raise DocInUseError(path, doc, holder) from None
            if _same_file(fd, self._name, dir_fd):
                break
            os.close(fd)  # its last holder released it in between: lock the current file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """End the claim (idempotent)."""
        if self._fd is None:
            return
        try:
            os.unlink(self._name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, name: str, dir_fd: int) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _pid_in(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
