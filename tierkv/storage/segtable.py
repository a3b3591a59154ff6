"""The manifest's listing of every record of each segment file, so that a directory closed
cleanly opens without reading one record header from disk.

Without it an opening reads each record's header (``scan_headers``): one small read per record,
spread over the segments a record's length apart, so one read per record from a cold disk.
Measured on a saved 7.5K-token SmolLM2 document (3,635 records, page cache dropped, 2-core
VM): 0.39 s of a 0.58 s ``TieredCache.open``; a million-token document holds ~100x the records.

A segment is listed with its size and modification time (ns) as the manifest is written, under
the directory's lock. An opening takes a listed segment's records from the listing when the file
still has that size and time (segments only grow, so an append since changes both; so does
cutting a torn tail) and reads the headers of every other segment as before. A listing is
checked as the headers would be (fields in range, records end to end from offset 0 to the
size); one that fails is not used. Every read checks its record's crc32 against the bytes on
disk (``check_crc``), so a header damaged in place with the file's size and time kept is found
when its record is read, as a damaged payload is.
"""
from __future__ import annotations

import json

import torch

from .base import RecordKey
from .segment import DTYPES_BY_CODE, HEADER, KIND_DATA, KIND_KEY_TOMBSTONE, MAX_SEGMENT, \
    MAX_STORED, PAD_ALIGN, VERSION, RecordHeader, Scanned

SEGMENT_COLUMNS = ("number", "size", "mtime", "count")
# RecordHeader's fields in order, "doc" an index into the listing's document names
RECORD_COLUMNS = ("kind", "codec", "dtype", "layers", "kv_heads", "head_dim", "group", "start",
                  "end", "raw_len", "stored_len", "seq", "doc", "crc", "pad", "version")
PREFIX = "listing."
DOCS_KEY = "listing_docs"  # the manifest metadata entry naming the documents
KEY_LIMIT = 2**40  # RecordKey's range of groups and token positions


def list_segments(files) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The listing of the segments of ``files`` (a SegmentDir; its lock held) whose file is as
    its index describes it (the size, records end to end from 0): tensors named ``PREFIX +``
    a column, and the document names the ``doc`` column indexes."""
    segments, records, offsets, docs = [], [], [], {}
    stats = files.stat_segments()
    for number, info in sorted(files.index.segments.items()):
        if number not in stats or stats[number][0] != info.size or not listable(info):
            continue
        segments.append((number, info.size, stats[number][1], len(info.records)))
        for record in info.records:
            h = record.header
            offsets.append(record.offset)
            records.append((h.kind, h.codec, h.dtype, h.layers, h.kv_heads, h.head_dim, h.group,
                            h.start, h.end, h.raw_len, h.stored_len, h.seq,
                            docs.setdefault(h.doc, len(docs)), h.crc, h.pad, h.version))
    tensors = {PREFIX + "offset": torch.tensor(offsets, dtype=torch.int64)}
    for name, column in zip(SEGMENT_COLUMNS, _columns(segments, len(SEGMENT_COLUMNS))):
        tensors[PREFIX + name] = column
    for name, column in zip(RECORD_COLUMNS, _columns(records, len(RECORD_COLUMNS))):
        tensors[PREFIX + name] = column
    return tensors, list(docs)


def listable(info) -> bool:
    """Whether a segment's records (``SegmentInfo``) run end to end from 0 to its size: one
    with bytes skipped as damage, or a tail left in place read-only, is never listed."""
    start = 0
    for record in info.records:
        if record.offset != start:
            return False
        start += record.header.length
    return start == info.size


def _columns(rows: list[tuple], width: int) -> list[torch.Tensor]:
    columns = list(zip(*rows)) or [()] * width
    return [torch.tensor(column, dtype=torch.int64) for column in columns]


class Listing:
    """A manifest's listing, decoded: ``records(number, size, mtime)`` gives a segment's."""

    def __init__(self, tensors: dict[str, torch.Tensor], docs: list[str]):
        self._docs = docs
        self._segments = {}
        first = 0
        for number, size, mtime, count in zip(*(tensors[PREFIX + c].tolist()
                                                for c in SEGMENT_COLUMNS)):
            self._segments[number] = (size, mtime, first, first + count)
            first += count
        self._offsets = tensors[PREFIX + "offset"]
        self._table = torch.stack([tensors[PREFIX + c] for c in RECORD_COLUMNS], 1)

    @classmethod
    def decode(cls, tensors: dict[str, torch.Tensor], info: dict) -> "Listing | None":
        """The listing a manifest holds (its ``tensors`` and metadata ``info``), None when it
        holds none or one malformed (then every segment's headers are read)."""
        names = [PREFIX + c for c in SEGMENT_COLUMNS + RECORD_COLUMNS + ("offset",)]
        if not all(n in tensors for n in names) or DOCS_KEY not in info:
            return None
        try:
            docs = json.loads(info[DOCS_KEY])
        except ValueError:
            return None
        if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            return None
        segs = [tensors[PREFIX + c] for c in SEGMENT_COLUMNS]
        rows = [tensors[PREFIX + c] for c in RECORD_COLUMNS + ("offset",)]
        if any(t.dtype != torch.int64 or t.dim() != 1 for t in segs + rows) \
                or len({t.numel() for t in segs}) != 1 or len({t.numel() for t in rows}) != 1 \
                or bool((segs[3] < 0).any()) or int(segs[3].sum()) != rows[0].numel() \
                or len(set(segs[0].tolist())) != segs[0].numel():
            return None
        return cls(tensors, docs)

    def records(self, number: int, size: int, mtime: int) -> list[Scanned] | None:
        """The records of segment ``number`` when the listing holds it with this ``size`` and
        ``mtime`` and its rows check out (``_valid``); else None: read its headers."""
        listed = self._segments.get(number)
        if listed is None or listed[:2] != (size, mtime) or not 0 < number <= MAX_SEGMENT:
            return None
        lo, hi = listed[2:]
        table, offsets = self._table[lo:hi], self._offsets[lo:hi]
        if not self._valid(table, offsets, size):
            return None
        return [Scanned(RecordHeader(*row[:12], self._docs[row[12]], *row[13:]), offset)
                for row, offset in zip(table.tolist(), offsets.tolist())]

    def _valid(self, table: torch.Tensor, offsets: torch.Tensor, size: int) -> bool:
        """The checks ``parse_header`` makes of each header, and the records end to end. A
        record of a newer format version fails them: its segment's headers are read, and the
        directory refused (``NewerFormatError``) as it would be without a listing."""
        if offsets.numel() == 0:
            return size == 0  # a segment created and not yet written to
        col = {name: table[:, i] for i, name in enumerate(RECORD_COLUMNS)}
        lengths = HEADER.size + col["pad"] + col["stored_len"]
        starts = torch.cat([offsets.new_zeros(1), (offsets + lengths)[:-1]])
        if not torch.equal(offsets, starts) \
                or int(offsets[-1] + lengths[-1]) != size:
            return False
        data = col["kind"] == KIND_DATA
        itemsize = torch.zeros_like(col["dtype"])
        for code, dtype in DTYPES_BY_CODE.items():
            itemsize[col["dtype"] == code] = dtype.itemsize
        raw = 2 * col["layers"] * col["kv_heads"] * (col["end"] - col["start"]) \
            * col["head_dim"] * itemsize
        shaped = (itemsize > 0) & (torch.stack([col["layers"], col["kv_heads"],
                                                col["head_dim"]]).amin(0) >= 1) \
            & (col["end"] > col["start"]) & (col["raw_len"] == raw)
        empty = (col["stored_len"] == 0) & (col["raw_len"] == 0)
        ok = ((col["kind"] >= 0) & (col["kind"] <= KIND_KEY_TOMBSTONE)
              & (col["version"] >= 1) & (col["version"] <= VERSION)
              & (col["pad"] >= 0) & (col["pad"] < PAD_ALIGN)
              & ((col["pad"] == 0) | (col["version"] >= 2))
              & (col["stored_len"] >= 0) & (col["stored_len"] <= MAX_STORED)
              & (col["raw_len"] <= MAX_STORED) & (col["codec"] >= 0) & (col["codec"] < 256)
              & (col["doc"] >= 0) & (col["doc"] < len(self._docs))
              & (col["group"] >= 0) & (col["group"] < KEY_LIMIT) & (col["start"] >= 0)
              & (col["end"] >= 0) & (col["end"] < KEY_LIMIT) & (col["start"] < KEY_LIMIT)
              & (col["seq"] >= 0)
              & (col["crc"] >= 0) & (col["crc"] < 1 << 32)
              & torch.where(data, shaped, empty))
        if not bool(ok.all()):
            return False
        try:  # the names a record key accepts
            for doc in {self._docs[i] for i in col["doc"].tolist()}:
                RecordKey(doc, 0, 0, 1)
        except ValueError:
            return False
        return True
