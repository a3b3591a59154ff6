"""The on-disk record format: a fixed little-endian header, ``pad`` zero bytes, the payload.

Layout of one record (``HEADER.size`` = 144 bytes of header, ``pad`` zero bytes, then
``stored_len`` bytes)::

    magic "TKVR" | version u16 | kind u8 | codec u8 | dtype u8 | doc_len u8 |
    layers u16 | kv_heads u16 | head_dim u16 | group u64 | start u64 | end u64 |
    raw_len u64 | stored_len u64 | seq u64 | doc 64s | pad u8 | reserved 11 bytes | crc32 u32

``pad`` (format version 2; version 1 records, still read, have none) is chosen when the record
is appended, from its offset in the file, so that a chosen point of the payload (the tensor
bytes of a block: ``payload_pad``) lies on a ``PAD_ALIGN``-byte boundary of the file. An
``O_DIRECT`` read lands bytes where they lie in the file's blocks, so the raw codec can decode
such a record as a view of the read, with no copy: in version 1, records start 157 bytes before
their tensor bytes, and half of the fp16 records of a segment (three quarters of fp32 ones) came
misaligned. ``crc32`` is ``crc32(header bytes before it, crc32(payload))``, so the payload's
part is computed outside any lock; the pad bytes must be zero. ``seq`` is a store-wide sequence
number: among records for one key the highest ``seq`` wins, tombstones included. Records are never
changed after they are written; files only grow (or lose a torn tail).
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import torch

from .base import CorruptRecordError, NewerFormatError, RecordKey
from .native import crc32

MAGIC = b"TKVR"
VERSION = 2  # written; every version from 1 up to it is read
HEADER = struct.Struct("<4sHBBBBHHHQQQQQQ64sB11xI")
PAD_ALIGN = 64  # the file boundary ``pad`` aligns a record's payload point to
KIND_DATA, KIND_DOC_TOMBSTONE, KIND_KEY_TOMBSTONE = 0, 1, 2
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}
SEGMENT_RE = re.compile(r"^seg-(\d{6})\.tkv$")
MAX_SEGMENT = 10**6 - 1  # the names hold six digits
MAX_STORED = 1 << 40
_SCAN_WINDOW = 1 << 20


def segment_name(number: int) -> str:
    return f"seg-{number:06d}.tkv"


@dataclass(frozen=True)
class RecordHeader:
    """The decoded header of one record."""

    kind: int
    codec: int
    dtype: int
    layers: int
    kv_heads: int
    head_dim: int
    group: int
    start: int
    end: int
    raw_len: int
    stored_len: int
    seq: int
    doc: str
    crc: int
    pad: int = 0
    version: int = VERSION  # the record format version it was written in

    @property
    def length(self) -> int:
        """Bytes of the whole record (header, pad and payload)."""
        return HEADER.size + self.pad + self.stored_len

    @property
    def payload_at(self) -> int:
        """Where the payload starts in the record."""
        return HEADER.size + self.pad

    @property
    def key(self) -> RecordKey:
        return RecordKey(self.doc, self.group, self.start, self.end)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.kv_heads, self.end - self.start, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES_BY_CODE[self.dtype]


def pack_record(kind: int, key: RecordKey, seq: int, payload=b"", *, payload_crc: int | None = None,
                codec: int = 0, dtype: torch.dtype | None = None, shape=(0, 0, 0, 0),
                raw_len: int = 0, pad: int = 0) -> tuple[bytes, ...]:
    """(header, pad bytes, payload) of one record, written back to back (``payload_crc``: its
    crc32 if known); (header, payload) without pad."""
    if not 0 <= pad < PAD_ALIGN:
        raise ValueError(f"pad={pad}: must be in [0, {PAD_ALIGN})")
    doc = key.doc.encode()
    layers, kv_heads, _, head_dim = shape
    dcode = DTYPE_CODES[dtype] if dtype is not None else 0
    fields = (MAGIC, VERSION, kind, codec, dcode, len(doc), layers, kv_heads, head_dim,
              key.group, key.start, key.end, raw_len, len(payload), seq, doc, pad)
    head = HEADER.pack(*fields, 0)[:-4]
    if payload_crc is None:
        payload_crc = crc32(payload)
    crc = crc32(head, payload_crc)
    head += struct.pack("<I", crc)
    return (head, bytes(pad), payload) if pad else (head, payload)


def payload_pad(offset: int, lead: int) -> int:
    """The pad of a record appended at file ``offset`` that puts byte ``lead`` of its payload on
    a ``PAD_ALIGN`` boundary of the file."""
    return -(offset + HEADER.size + lead) % PAD_ALIGN


def parse_header(buf) -> RecordHeader:
    """Decode and sanity-check a header (not the crc: see ``check_crc``).

    Raises CorruptRecordError naming the first bad field.
    """
    if len(buf) < HEADER.size:
        raise CorruptRecordError(f"record header truncated: {len(buf)} of {HEADER.size} bytes")
    (magic, version, kind, codec, dtype, doc_len, layers, kv_heads, head_dim, group, start, end,
     raw_len, stored_len, seq, doc, pad, crc) = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad magic {magic!r}: not a tierkv record")
    if not 1 <= version <= VERSION:
        raise CorruptRecordError(f"record format version {version}: this build reads 1 to "
                                 f"{VERSION}")
    if pad >= PAD_ALIGN or (pad and version < 2):
        raise CorruptRecordError(f"record pad {pad} invalid for format version {version}")
    if kind not in (KIND_DATA, KIND_DOC_TOMBSTONE, KIND_KEY_TOMBSTONE):
        raise CorruptRecordError(f"record kind {kind} unknown")
    if not 0 < doc_len <= 64 or any(doc[doc_len:]):
        raise CorruptRecordError(f"record doc name length {doc_len} invalid")
    if stored_len > MAX_STORED or raw_len > MAX_STORED:
        raise CorruptRecordError(f"record lengths {raw_len}/{stored_len} absurd")
    header = RecordHeader(kind, codec, dtype, layers, kv_heads, head_dim, group, start, end,
                          raw_len, stored_len, seq, _decode_doc(doc[:doc_len]), crc, pad,
                          version)
    _check_fields(header)
    return header


def _decode_doc(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise CorruptRecordError("record doc name is not ASCII") from None


def _check_fields(h: RecordHeader) -> None:
    try:
        key = RecordKey(h.doc, h.group, h.start, max(h.end, h.start + 1))
    except ValueError as exc:
        raise CorruptRecordError(f"record key invalid: {exc}") from None
    if h.kind == KIND_DATA:
        if h.dtype not in DTYPES_BY_CODE or min(h.layers, h.kv_heads, h.head_dim) < 1:
            raise CorruptRecordError(f"record of {key}: dtype code {h.dtype} or shape invalid")
        if h.end <= h.start:
            raise CorruptRecordError(f"record of {key}: empty token range")
        itemsize = h.torch_dtype.itemsize
        expect = 2 * h.layers * h.kv_heads * (h.end - h.start) * h.head_dim * itemsize
        if h.raw_len != expect:
            raise CorruptRecordError(f"record of {key}: raw length {h.raw_len} != {expect}")
    elif h.stored_len or h.raw_len:
        raise CorruptRecordError(f"tombstone of {key} carries a payload")


def _record_crc(view: memoryview, pad: int) -> int:
    """The crc32 a record's header stores: over the header before it, then the payload."""
    return crc32(view[:HEADER.size - 4], crc32(view[HEADER.size + pad:]))


def check_crc(header: RecordHeader, record) -> None:
    """Raise CorruptRecordError unless ``record`` (header, pad and payload bytes) matches its
    crc32 and its pad bytes are zero."""
    view = memoryview(record)
    if len(view) != header.length:
        raise CorruptRecordError(f"record truncated: {len(view)} of {header.length} bytes")
    crc = _record_crc(view, header.pad)
    if crc != header.crc:
        raise CorruptRecordError(f"record crc32 mismatch ({crc:#010x} != {header.crc:#010x})")
    if header.pad and any(view[HEADER.size:header.payload_at]):
        raise CorruptRecordError(f"record pad bytes are not zero ({header.pad} bytes)")


@dataclass(frozen=True)
class Scanned:
    """A valid record found by ``scan_segment``."""

    header: RecordHeader
    offset: int


def scan_segment(fd: int, start: int, end: int) -> tuple[list[Scanned], int, list[str]]:
    """Every valid record of a segment file in ``[start, end)``.

    Invalid bytes are skipped up to the next valid record (found by its magic and crc).
    Returns the records, the end of the last valid record (the place to cut a torn tail) and a
    description of each skipped region.
    """
    found, problems, offset, valid_end = [], [], start, start
    while offset < end:
        try:
            header = _read_valid(fd, offset, end)
        except CorruptRecordError as exc:
            nxt = _next_valid(fd, offset + 1, end)
            if nxt is None:
                problems.append(f"offset {offset}: {exc}; {end - offset} bytes to end dropped")
                break
            problems.append(f"offset {offset}: {exc}; {nxt - offset} bytes skipped")
            offset = nxt
            continue
        found.append(Scanned(header, offset))
        offset = valid_end = offset + header.length
    return found, valid_end, problems


def scan_headers(fd: int, end: int) -> list[Scanned] | None:
    """The records of a segment file ``[0, end)`` from their headers alone (no payload read).

    For opening a directory whose manifest vouches for its records: the caller compares the
    result with the manifest and falls back to ``scan_segment`` on any difference. Returns None
    when the header chain is broken (bad header, a record running past ``end``, a gap): then
    only ``scan_segment`` can say what is valid. Payload crcs are checked on every read.
    """
    found, offset = [], 0
    while offset < end:
        try:
            header = parse_header(os.pread(fd, HEADER.size, offset))
        except CorruptRecordError:
            return None
        if offset + header.length > end:
            return None
        found.append(Scanned(header, offset))
        offset += header.length
    return found


def _read_valid(fd: int, offset: int, end: int) -> RecordHeader:
    head = os.pread(fd, HEADER.size, offset)
    try:
        header = parse_header(head)
    except CorruptRecordError:
        _raise_if_newer(fd, head, offset, end)
        raise
    if offset + header.length > end:
        raise CorruptRecordError(f"record runs past end of file ({header.length} bytes)")
    check_crc(header, os.pread(fd, header.length, offset))
    return header


def newer_version(head: bytes) -> int | None:
    """The format version of the record ``head`` starts when it is newer than this build's
    (the magic, then a little-endian u16), else None."""
    if len(head) < len(MAGIC) + 2 or not head.startswith(MAGIC):
        return None
    version = int.from_bytes(head[len(MAGIC):len(MAGIC) + 2], "little")
    return version if version > VERSION else None


def _raise_if_newer(fd: int, head: bytes, offset: int, end: int) -> None:
    """NewerFormatError when ``head`` starts an intact record of a newer format version: its
    crc32, which covers the version field, holds (a damaged version field breaks it)."""
    version = newer_version(head)
    if version is None or len(head) < HEADER.size:
        return
    fields = HEADER.unpack_from(head)
    stored_len, pad, crc = fields[13], fields[16], fields[-1]
    if offset + HEADER.size + pad + stored_len > end:
        return
    record = os.pread(fd, HEADER.size + pad + stored_len, offset)
    if _record_crc(memoryview(record), pad) == crc:
        raise NewerFormatError.of("record format", version, VERSION)


def _next_valid(fd: int, offset: int, end: int) -> int | None:
    """Offset of the next valid record at or after ``offset``, searching by magic."""
    while offset < end:
        window = os.pread(fd, min(_SCAN_WINDOW, end - offset), offset)
        pos = window.find(MAGIC)
        while pos >= 0:
            try:
                _read_valid(fd, offset + pos, end)
                return offset + pos
            except CorruptRecordError:
                pos = window.find(MAGIC, pos + 1)
        offset += max(1, len(window) - len(MAGIC) + 1)
    return None
