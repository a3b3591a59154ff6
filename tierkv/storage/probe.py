"""A quick measure of how fast a directory's disk reads, for codec choices made before any
record was read back (a prefill writes everything before decode reads anything).

The probe writes a scratch file, makes it durable, drops it from the page cache and reads it
back in record-sized pieces; the result is kept per filesystem for the life of the process.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PROBE_BYTES = 8 << 20
PIECE_BYTES = 256 << 10

_measured: dict[int, float] = {}
_lock = threading.Lock()


def read_bandwidth(directory: str | os.PathLike, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s read from ``directory``'s filesystem with a cold page cache (a few tens of ms
    the first time per filesystem; cached after). ``directory`` must exist and be writable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} does not exist")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < PIECE_BYTES:
        raise ValueError(f"nbytes={nbytes!r}: must be an integer >= {PIECE_BYTES}")
    device = directory.stat().st_dev
    with _lock:
        if device in _measured:
            return _measured[device]
        bandwidth = _probe(directory, nbytes)
        _measured[device] = bandwidth
        return bandwidth


def _probe(directory: Path, nbytes: int) -> float:
    path = directory / f".tierkv-probe-{os.getpid()}-{threading.get_ident()}"
    piece = os.urandom(PIECE_BYTES)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(nbytes // PIECE_BYTES):
                os.write(fd, piece)
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start, read = time.perf_counter(), 0
            while chunk := os.pread(fd, PIECE_BYTES, read):
                read += len(chunk)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return read / max(seconds, 1e-9)
