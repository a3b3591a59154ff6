"""The in-memory index of a disk-tier directory, rebuilt from the records found in segments.

Order-independent rules, so segments may be scanned in any order: among data records for one key
the highest ``seq`` wins; a document tombstone hides every record of its document with a lower
``seq``, a key tombstone every record of its key with a lower ``seq``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .base import RecordKey
from .segment import KIND_DATA, KIND_DOC_TOMBSTONE, RecordHeader, Scanned


@dataclass(frozen=True)
class Location:
    """Where the live record of a key is."""

    segment: int
    offset: int
    header: RecordHeader

    @property
    def length(self) -> int:
        return self.header.length


@dataclass
class SegmentInfo:
    """What one segment file holds: its valid length and every valid record in it."""

    number: int
    size: int = 0
    records: list[Scanned] = field(default_factory=list)


class DiskIndex:
    """Live records, tombstones and per-segment contents of a directory."""

    def __init__(self):
        self.live: dict[RecordKey, Location] = {}
        self.segments: dict[int, SegmentInfo] = {}
        self.doc_tombs: dict[str, int] = {}
        self.key_tombs: dict[RecordKey, int] = {}
        self.max_seq = 0

    def add(self, segment: int, record: Scanned, moved: bool = False):
        """Take in one valid record; return (keys that stopped being live, key now live or None).

        ``moved``: the record is a compaction copy, which replaces its equal-``seq`` original.
        """
        info = self.segments.setdefault(segment, SegmentInfo(segment))
        info.records.append(record)
        h = record.header
        self.max_seq = max(self.max_seq, h.seq)
        if h.kind == KIND_DATA:
            return self._add_data(segment, record, moved)
        if h.kind == KIND_DOC_TOMBSTONE:
            self.doc_tombs[h.doc] = max(self.doc_tombs.get(h.doc, 0), h.seq)
            gone = [k for k, loc in self.live.items() if k.doc == h.doc and loc.header.seq < h.seq]
        else:
            key = h.key
            self.key_tombs[key] = max(self.key_tombs.get(key, 0), h.seq)
            loc = self.live.get(key)
            gone = [key] if loc is not None and loc.header.seq < h.seq else []
        for key in gone:
            del self.live[key]
        return gone, None

    def _add_data(self, segment: int, record: Scanned, moved: bool):
        h = record.header
        key = h.key
        if h.seq < self.doc_tombs.get(h.doc, 0) or h.seq < self.key_tombs.get(key, 0):
            return [], None
        old = self.live.get(key)
        if old is not None and (old.header.seq > h.seq or old.header.seq == h.seq and not moved):
            return [], None
        self.live[key] = Location(segment, record.offset, h)
        return [], key

    def is_live(self, segment: int, record: Scanned) -> bool:
        """Whether ``record`` of ``segment`` must be kept (live data or a needed tombstone)."""
        h = record.header
        if h.kind == KIND_DATA:
            loc = self.live.get(h.key)
            return loc is not None and (loc.segment, loc.offset) == (segment, record.offset)
        return self._tombstone_needed(segment, h)

    def _tombstone_needed(self, segment: int, tomb: RecordHeader) -> bool:
        doc_wide = tomb.kind == KIND_DOC_TOMBSTONE
        for number, info in self.segments.items():
            if number == segment:
                continue
            for rec in info.records:
                h = rec.header
                if h.kind != KIND_DATA or h.seq >= tomb.seq or h.doc != tomb.doc:
                    continue
                if doc_wide or h.key == tomb.key:
                    return True
        return False

    def live_bytes(self, segment: int) -> int:
        return sum(loc.length for loc in self.live.values() if loc.segment == segment)

    def without(self, gone: set[int]) -> "DiskIndex":
        """A new index over the records of every segment except ``gone`` (deleted files)."""
        index = DiskIndex()
        for number in sorted(self.segments):
            if number not in gone:
                index.segments[number] = SegmentInfo(number, self.segments[number].size)
                for record in self.segments[number].records:
                    index.add(number, record)
        return index
