"""Batched record reads: disk-ordered extents split among I/O threads, crc checked in place.

One buffer is allocated per batch and laid out in disk order, so each thread reads a contiguous
run of it with one gathered ``pread_extents`` per segment (the C helper releases the GIL; the
kernel's readahead sees sequential access). Each thread verifies, and optionally decodes, the
records it read.

Each record is placed so that its tensor bytes (after the record and block headers) start on a
64-byte boundary: a thread reads up to 63 bytes before a record's extent to get there. The raw
codec can then decode a record as a view of the buffer, with no copy (``RawCodec.decode``).

Before reading, a thread hints all its extents to the kernel (``POSIX_FADV_WILLNEED``), so the
disk has them in flight at once rather than one per thread at a time: on a virtio disk, 86
scattered 1 MiB records in batches of 32 read in 130 ms instead of 148 (median, 8 threads).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from .base import CorruptRecordError, RecordKey
from .codec import BLOCK_HEADER_SIZE
from .native import pread_extents
from .segment import HEADER, check_crc, parse_header, segment_name

_ADVISE = hasattr(os, "posix_fadvise")
ALIGN = 64  # where in the batch buffer each record's tensor bytes start


class RawRecord(NamedTuple):
    """A record read and crc-checked but not decoded.

    payload : memoryview of the encoded bytes; shape : (layers, kv_heads, tokens, head_dim).
    """

    key: RecordKey
    codec: int
    dtype: torch.dtype
    shape: tuple[int, int, int, int]
    payload: memoryview


def read_batch(files, keys: list[RecordKey], locs: list, pool, threads: int, decode=None) -> list:
    """RawRecords (or ``decode(raw)`` of each) of ``keys`` at ``locs``, in key order.

    Raises CorruptRecordError for a record that fails its checks or cannot be read, and
    FileNotFoundError when a segment was deleted since ``locs`` was looked up.
    """
    order = sorted(range(len(locs)), key=lambda i: (locs[i].segment, locs[i].offset))
    pos, pad, total = [0] * len(locs), [0] * len(locs), 0
    body = HEADER.size + BLOCK_HEADER_SIZE
    for i in order:  # a lead before each record aligns its tensor bytes: bytes read from
        lead = (-(total + body)) % ALIGN  # before its extent, or left unread at a file's start
        pad[i] = min(lead, locs[i].offset)
        pos[i] = total + lead
        total = pos[i] + locs[i].length
    buf = memoryview(np.empty(total + ALIGN, np.uint8)).cast("B")
    buf = buf[(-np.frombuffer(buf, np.uint8).ctypes.data) % ALIGN:][:total]
    out = [None] * len(locs)

    def job(indices: list[int]) -> None:
        _read_runs(files, indices, locs, pos, pad, buf)
        for i in indices:
            record = buf[pos[i]:pos[i] + locs[i].length]
            raw = _verified(keys[i], locs[i], record)
            out[i] = raw if decode is None else decode(raw)

    jobs = _balanced(order, locs, total, threads)
    if len(jobs) == 1:
        job(jobs[0])
    else:
        list(pool.map(job, jobs))
    return out


def _balanced(order: list[int], locs: list, total: int, threads: int) -> list[list[int]]:
    """Contiguous slices of ``order`` holding about equal bytes, at most ``threads`` of them."""
    jobs, current, done = [], [], 0
    for i in order:
        current.append(i)
        done += locs[i].length
        if done >= total * (len(jobs) + 1) / threads and len(jobs) < threads - 1:
            jobs.append(current)
            current = []
    return jobs + [current] if current else jobs


def _read_runs(files, indices: list[int], locs: list, pos: list[int], pad: list[int],
               buf: memoryview) -> None:
    """Read the records ``indices`` (in disk order) into ``buf``: one gathered read per segment,
    after a WILLNEED hint for all their extents, so the disk gets them all at once instead of one
    request at a time while this thread waits."""
    runs = _segment_runs(indices, locs, pos, pad)
    fds: list[int] = []
    try:
        for run in runs:
            fds.append(files.open_read(locs[run[0]].segment))
            _advise(fds[-1], [locs[i] for i in run])
        for run, fd in zip(runs, fds):
            lo, hi = pos[run[0]] - pad[run[0]], pos[run[-1]] + locs[run[-1]].length
            try:
                pread_extents(fd, [locs[i].offset - pad[i] for i in run],
                              [locs[i].length + pad[i] for i in run], buf[lo:hi])
            except OSError as exc:
                raise CorruptRecordError(f"{segment_name(locs[run[0]].segment)}: read failed "
                                         f"({exc})") from exc
    finally:
        for fd in fds:
            os.close(fd)


def _segment_runs(indices: list[int], locs: list, pos: list[int], pad: list[int]
                  ) -> list[list[int]]:
    """``indices`` cut into runs of consecutive records of one segment, each read back to back
    into the buffer (a lead left unread starts a new run)."""
    runs: list[list[int]] = []
    for i in indices:
        last = runs[-1][-1] if runs else None
        if last is not None and locs[last].segment == locs[i].segment \
                and pos[last] + locs[last].length == pos[i] - pad[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _advise(fd: int, locs: list) -> None:
    """Ask the kernel to start reading ``locs`` (extents of ``fd``, in order) now; a hint only."""
    if not _ADVISE:
        return
    extents: list[list[int]] = []
    for loc in locs:
        if extents and extents[-1][0] + extents[-1][1] == loc.offset:
            extents[-1][1] += loc.length
        else:
            extents.append([loc.offset, loc.length])
    try:
        for offset, length in extents:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def _verified(key: RecordKey, loc, record: memoryview) -> RawRecord:
    header = parse_header(record)
    if (header.doc, header.group, header.start, header.end, header.seq, header.length) != \
            (key.doc, key.group, key.start, key.end, loc.header.seq, loc.length):
        raise CorruptRecordError(f"record at {segment_name(loc.segment)}:{loc.offset} is not the "
                                 f"one indexed ({header.key} seq {header.seq})")
    try:
        check_crc(header, record)
    except CorruptRecordError as exc:
        raise CorruptRecordError(f"record {key} at {segment_name(loc.segment)}:{loc.offset}: "
                                 f"{exc}") from None
    return RawRecord(key, header.codec, header.torch_dtype, header.shape, record[HEADER.size:])
