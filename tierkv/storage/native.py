"""Byte shuffles and gathered file reads: the C helpers of ``tierkv._native`` when built,
numpy / ``os.preadv`` fallbacks with identical results otherwise. ``crc32``: zlib-ng's (SIMD,
3.6x the standard library's on this project's machine) when installed, else ``zlib.crc32``;
the same values (zlib's polynomial), both release the GIL.

``shuffle_py``, ``unshuffle_py`` and ``pread_extents_py`` are always the fallbacks, so tests and
benchmarks can compare both. The C helpers release the GIL.
"""
from __future__ import annotations

import errno
import os
from typing import Sequence

import numpy as np

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without its wheel
    from zlib import crc32

try:
    from tierkv._native import pread_extents as _pread_extents_c
    from tierkv._native import shuffle as _shuffle_c
    from tierkv._native import unshuffle as _unshuffle_c
    HAVE_NATIVE = True
except ImportError:  # not built (no compiler), or built from an older source
    HAVE_NATIVE = False


def _check_items(src, itemsize: int, out) -> np.ndarray:
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or not 1 <= itemsize <= 64:
        raise ValueError(f"itemsize={itemsize!r}: must be an int in [1, 64]")
    data = np.frombuffer(src, np.uint8)
    if data.size % itemsize:
        raise ValueError(f"src holds {data.size} bytes, not a multiple of itemsize={itemsize}")
    if out is not None and memoryview(out).nbytes != data.size:
        raise ValueError(f"out holds {memoryview(out).nbytes} bytes, src {data.size}")
    return data


def _writable(out) -> np.ndarray:
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise ValueError("out must be a writable, contiguous buffer")
    return np.frombuffer(view.cast("B"), np.uint8)


def shuffle_py(src, itemsize: int, out=None):
    """Byte planes of ``src``: byte 0 of every item, then byte 1 of every item, ...

    Parameters
    ----------
    src : buffer of n items of ``itemsize`` bytes (e.g. a uint8 view of a fp16 tensor).
    itemsize : bytes per item, 1 to 64.
    out : optional writable contiguous buffer of ``len(src)`` bytes to write into.

    Returns
    -------
    bytes, or ``out`` when given.
    """
    items = _check_items(src, itemsize, out).reshape(-1, itemsize)
    if out is None:
        return items.T.tobytes()
    _writable(out).reshape(itemsize, -1)[:] = items.T
    return out


def unshuffle_py(src, itemsize: int, out=None):
    """The inverse of ``shuffle``; same parameters and return value."""
    planes = _check_items(src, itemsize, out).reshape(itemsize, -1)
    if out is None:
        return planes.T.tobytes()
    _writable(out).reshape(-1, itemsize)[:] = planes.T
    return out


def pread_extents_py(fd: int, offsets: Sequence[int], lengths: Sequence[int], out) -> int:
    """Read extent i (``lengths[i]`` bytes at ``offsets[i]`` of ``fd``) into ``out``, back to back.

    Returns the bytes read (``sum(lengths)``). Raises OSError on a read error or at end of file,
    ValueError on bad arguments (negative values, ``out`` too small or read-only).
    """
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise ValueError("out must be a writable, contiguous buffer")
    view = view.cast("B")
    if len(offsets) != len(lengths):
        raise ValueError(f"{len(offsets)} offsets but {len(lengths)} lengths")
    if any(o < 0 for o in offsets) or any(n < 0 for n in lengths):
        raise ValueError("offsets and lengths must be >= 0")
    if sum(lengths) > len(view):
        raise ValueError(f"extents total {sum(lengths)} bytes, out holds {len(view)}")
    pos = 0
    for offset, length in zip(offsets, lengths):
        _read_full(fd, view[pos:pos + length], offset)
        pos += length
    return pos


def _read_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)  # retries EINTR itself (PEP 475)
        if got == 0:
            raise OSError(errno.EIO, f"unexpected end of file at offset {offset + done} "
                          f"({len(view) - done} bytes short)")
        done += got


if HAVE_NATIVE:
    shuffle, unshuffle, pread_extents = _shuffle_c, _unshuffle_c, _pread_extents_c
else:
    shuffle, unshuffle, pread_extents = shuffle_py, unshuffle_py, pread_extents_py
