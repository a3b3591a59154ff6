"""Plain reads that bound the disk tier's: the disk's raw bandwidth, and that of a given set of
record extents, each the best of reads through the page cache and O_DIRECT reads."""
from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import drop_page_cache
from tierkv.storage.diskread import DIRECT_BLOCK
from tierkv.storage.segment import segment_name

DIRECT = getattr(os, "O_DIRECT", 0)


def open_direct(path: Path) -> int | None:
    """``path`` opened for O_DIRECT reads, or None where that is refused (tmpfs, say)."""
    if not DIRECT:
        return None
    try:
        return os.open(path, os.O_RDONLY | DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class RawReads:
    """A file of ``nbytes`` (written and fsynced once) whose plain sequential reads, page cache
    dropped, give the raw disk bandwidth."""

    def __init__(self, path: Path, nbytes: int, threads: int, chunk: int = 1 << 20):
        self.path, self.chunk, self.threads = path, chunk, threads
        self.nbytes = max(chunk, nbytes // chunk * chunk)
        data = os.urandom(chunk)
        with open(path, "wb") as f:
            for _ in range(self.nbytes // chunk):
                f.write(data)
            os.fsync(f.fileno())

    def gbps(self) -> float:
        """The best of two plain ways of reading the file from start to end: one thread through
        the page cache (the kernel reads ahead), and ``threads`` threads with O_DIRECT taking
        1 MiB pieces in turn (the disk gets them all at once; skipped where it is refused)."""
        return max(self._buffered(), self._direct(self.threads))

    def _buffered(self) -> float:
        drop_page_cache(self.path)
        buf = bytearray(self.chunk)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            for offset in range(0, self.nbytes, self.chunk):
                os.preadv(fd, [buf], offset)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
        return self.nbytes / seconds / 1e9

    def _direct(self, threads: int) -> float:
        offsets = range(0, self.nbytes, self.chunk)
        parts = [offsets[i::threads] for i in range(threads)]
        fd = open_direct(self.path)
        if fd is None:
            return 0.0

        def read(part) -> None:
            buf = mmap.mmap(-1, self.chunk)  # page-aligned, as O_DIRECT needs
            for offset in sorted(part):
                os.preadv(fd, [buf], offset)
        try:
            return self.nbytes / _timed_map(read, parts, threads) / 1e9
        finally:
            os.close(fd)


def extent_reads(directory: Path, locs: list, threads: int, direct: bool) -> float:
    """GB/s of reading the record extents ``locs`` (disk order) of the segments in ``directory``,
    page cache dropped, ``threads`` at a time; ``direct``: with O_DIRECT, whole blocks (0.0
    where O_DIRECT is refused)."""
    block = DIRECT_BLOCK if direct else 1
    segments = {loc.segment for loc in locs}
    for n in segments:
        drop_page_cache(directory / segment_name(n))
    fds = {n: open_direct(directory / segment_name(n)) if direct else
           os.open(directory / segment_name(n), os.O_RDONLY) for n in segments}
    if None in fds.values():
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        return 0.0
    buffers = threading.local()

    def read(loc) -> None:
        lo = loc.offset // block * block
        length = -(-(loc.offset + loc.length - lo) // block) * block
        if getattr(buffers, "buf", None) is None or len(buffers.buf) < length:
            buffers.buf = mmap.mmap(-1, length)
        os.preadv(fds[loc.segment], [memoryview(buffers.buf)[:length]], lo)

    try:
        return sum(loc.length for loc in locs) / _timed_map(read, locs, threads) / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)


def _timed_map(fn, items, threads: int) -> float:
    """Seconds to run ``fn`` on every item, ``threads`` at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))
    return time.perf_counter() - start
