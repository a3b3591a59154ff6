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

With ``direct=True`` records are read with O_DIRECT instead (``_read_direct``): no copy through
the page cache, no readahead past a record, nothing served from RAM either. The disk tier does so
when its records outgrow the machine's available memory (``DiskTier.direct_io``). On this
project's virtio disk (page cache dropped), a step reading every record of a 64K-token context
(4.6 GB, scattered 1 MiB records) took 4.5-5.1 s against 7.8 through the page cache
(``bench.scale``); records read in disk order came 1.2x faster at 1-4 MiB and 0.6x as fast at
64 KiB (``bench.storage``). Records the page cache holds come 1.8x faster through it. Tensor
bytes lie in the buffer as they lie in the file: records written by this version put them on a
64-byte boundary of the file (the header's ``pad``, ``segment.payload_pad``), so the raw codec
decodes them as views here too. Records of format version 1 had no pad and lie where they fell
(157 bytes after their record's start: half of fp16 records, three quarters of fp32 ones, are
misaligned); their decode copies them. At 128K tokens of ``bench.scale`` with O_DIRECT (300 MB
of fp16 records a step), steps over records of this version took 0.96x the time of steps over
the same records written without pads (median of 10 alternating pairs, one process), and 191
against 231 ms of CPU a step.
"""
from __future__ import annotations

import errno
import os
from typing import NamedTuple

import numpy as np
import torch

from .base import CorruptRecordError, RecordKey
from .codec import BLOCK_HEADER_SIZE
from .native import pread_extents
from .segment import PAD_ALIGN, check_crc, parse_header, segment_name

_ADVISE = hasattr(os, "posix_fadvise")
DIRECT_BLOCK = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (512 on most disks)
ALIGN = 64  # where in the batch buffer each record's tensor bytes start
# O_DIRECT places records in the buffer as they lie in the file (block-aligned spans): their
# tensor bytes are ALIGN-aligned there only if the file's pad aligns them to a multiple of it
assert PAD_ALIGN % ALIGN == 0 and DIRECT_BLOCK % PAD_ALIGN == 0


class RawRecord(NamedTuple):
    """A record read and crc-checked but not decoded.

    payload : memoryview of the encoded bytes; shape : (layers, kv_heads, tokens, head_dim).
    """

    key: RecordKey
    codec: int
    dtype: torch.dtype
    shape: tuple[int, int, int, int]
    payload: memoryview


class DirectIOUnsupported(OSError):
    """The file system or the device refuses O_DIRECT reads as ``read_batch`` makes them."""


def read_batch(files, keys: list[RecordKey], locs: list, pool, threads: int, decode=None,
               direct: bool = False) -> list:
    """RawRecords (or ``decode(raw)`` of each) of ``keys`` at ``locs``, in key order.

    ``direct``: read with O_DIRECT (``_read_direct``); raises DirectIOUnsupported where that
    cannot be done, before any record is returned.

    Raises CorruptRecordError for a record that fails its checks or cannot be read, and
    FileNotFoundError when a segment was deleted since ``locs`` was looked up.
    """
    order = sorted(range(len(locs)), key=lambda i: (locs[i].segment, locs[i].offset))
    if direct:
        return _read_direct(files, keys, locs, order, pool, threads, decode)
    pos, pad, total = [0] * len(locs), [0] * len(locs), 0
    for i in order:  # a lead before each record aligns its tensor bytes: bytes read from
        body = locs[i].header.payload_at + BLOCK_HEADER_SIZE  # before its extent, or left
        lead = (-(total + body)) % ALIGN  # unread at a file's start
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

    jobs = _balanced(order, [loc.length for loc in locs], total, threads)
    if len(jobs) == 1:
        job(jobs[0])
    else:
        list(pool.map(job, jobs))
    return out


def _balanced(order: list[int], sizes, total: int, threads: int) -> list[list[int]]:
    """Contiguous slices of ``order`` holding about equal bytes (item ``i`` weighs
    ``sizes[i]``), at most ``threads`` of them."""
    jobs, current, done = [], [], 0
    for i in order:
        current.append(i)
        done += sizes[i]
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
    return RawRecord(key, header.codec, header.torch_dtype, header.shape,
                     record[header.payload_at:])


DIRECT_AVAILABLE = hasattr(os, "O_DIRECT")


def _read_direct(files, keys: list[RecordKey], locs: list, order: list[int], pool, threads: int,
                 decode) -> list:
    """``read_batch`` with O_DIRECT: the disk's data lands in the buffer with no page-cache copy
    and no readahead past the records, which scattered reads pay for in bandwidth.

    Records are read in spans of whole ``DIRECT_BLOCK`` blocks (records whose blocks touch share
    a span, up to about an equal share of the batch per thread, so that the threads also share
    the checks and decodes), each span at a block-aligned place of the buffer; a record lies in
    its span where it lies in its blocks. Tensor bytes are aligned as in the file (module
    docstring). ``order``: the records' indices in disk order.
    """
    spans = _direct_spans(order, locs, sum(loc.length for loc in locs) // threads)
    starts, total = [], 0
    for _, lo, hi, _ in spans:
        starts.append(total)
        total += hi - lo
    raw = np.empty(total + DIRECT_BLOCK, np.uint8)
    buf = memoryview(raw[(-raw.ctypes.data) % DIRECT_BLOCK:][:total]).cast("B")
    out = [None] * len(locs)

    def job(indices: list[int]) -> None:
        fds: dict[int, int] = {}
        try:
            for s in indices:
                segment, lo, hi, members = spans[s]
                if segment not in fds:
                    fds[segment] = _open_direct(files, segment)
                need = max(locs[i].offset + locs[i].length for i in members) - lo
                _pread_direct(fds[segment], buf[starts[s]:starts[s] + hi - lo], lo, need, segment)
        finally:
            for fd in fds.values():
                os.close(fd)
        for s in indices:
            segment, lo, _, members = spans[s]
            for i in members:
                at = starts[s] + locs[i].offset - lo
                record = _verified(keys[i], locs[i], buf[at:at + locs[i].length])
                out[i] = record if decode is None else decode(record)

    jobs = _balanced(range(len(spans)), [hi - lo for _, lo, hi, _ in spans], total, threads)
    if len(jobs) == 1:
        job(jobs[0])
    else:
        list(pool.map(job, jobs))
    return out


def _direct_spans(order: list[int], locs: list, limit: int | None = None
                  ) -> list[tuple[int, int, int, list[int]]]:
    """(segment, first byte, end, record indices) of each span of whole blocks to read, in disk
    order: records (``order``: in disk order) whose blocks touch share one, until it holds
    ``limit`` bytes (then a record that needs more blocks starts a span, which may read a block
    again)."""
    spans: list[list] = []
    for i in order:
        loc = locs[i]
        lo = loc.offset // DIRECT_BLOCK * DIRECT_BLOCK
        hi = -(-(loc.offset + loc.length) // DIRECT_BLOCK) * DIRECT_BLOCK
        if spans and spans[-1][0] == loc.segment and lo <= spans[-1][2] and \
                (limit is None or hi <= spans[-1][2] or spans[-1][2] - spans[-1][1] < limit):
            spans[-1][2] = max(spans[-1][2], hi)
            spans[-1][3].append(i)
        else:
            spans.append([loc.segment, lo, hi, [i]])
    return [tuple(span) for span in spans]


# What a file system or device answers when it will not do O_DIRECT (as asked)
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)


def _open_direct(files, segment: int) -> int:
    try:
        return files.open_read(segment, direct=True)
    except OSError as exc:
        if exc.errno in _REFUSALS:  # the file system has no O_DIRECT
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT: {exc.strerror}") from exc
        raise


def _pread_direct(fd: int, view: memoryview, offset: int, need: int, segment: int) -> None:
    """Read whole blocks at ``offset`` into ``view`` until its first ``need`` bytes are in (a
    file's last block may end short of a block)."""
    done = 0
    while done < need:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno in _REFUSALS:  # e.g. an alignment the device will not take
                raise DirectIOUnsupported(exc.errno, f"O_DIRECT read: {exc.strerror}") from exc
            raise CorruptRecordError(f"{segment_name(segment)}: read failed ({exc})") from exc
        if got == 0 or (got % DIRECT_BLOCK and done + got < need):
            raise CorruptRecordError(f"{segment_name(segment)}: read failed (unexpected end of "
                                     f"file at offset {offset + done + got}, {need - done - got} "
                                     f"bytes short)")
        done += got
