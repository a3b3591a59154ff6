"""The segment files of one disk-tier directory: listing, scanning, appending, reclaiming.

Every change (append, torn-tail cut, compaction, deletion) happens under the directory's
exclusive lock, after a refresh that takes in what other processes appended. The highest-numbered
segment is never deleted (a fresh one is created first), so segment names are never reused and a
record, once written, never changes: readers need no lock.
"""
from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

from .base import CorruptRecordError, NewerFormatError, StorageError
from .diskindex import DiskIndex, SegmentInfo
from .locking import DirLock
from .manifest import DiskWriteError
from .segtable import Listing
from .segment import HEADER, MAGIC, MAX_SEGMENT, PAD_ALIGN, SEGMENT_RE, VERSION, Scanned, \
    check_crc, newer_version, parse_header, scan_headers, scan_segment, segment_name

ZERO_TAIL_MAX = 1 << 20  # a longer tail of zeros is kept aside all the same, not judged torn
_RO = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECT = getattr(os, "O_DIRECT", 0)
_WO = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class SegmentDir:
    """Segments of ``path`` and the index rebuilt from them.

    Attributes ``foreign`` (segment-named files that hold no tierkv record: left untouched),
    ``refused`` (symlinks and non-regular files), ``problems`` (skipped bad bytes),
    ``truncated`` (tails cut, bytes per file) and ``kept`` (cut tails that were not a torn
    record, copied first to ``<segment>.cut-N``, per file) describe what scanning found.
    """

    def __init__(self, path: Path, segment_size: int, read_only: bool = False):
        self.path, self.read_only = path, read_only
        if not read_only:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # named: a bare errno line does not say which directory
                raise type(exc)(exc.errno, f"disk tier directory {str(path)!r}: cannot create "
                                           f"it ({exc.strerror})") from None
        elif not path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory")
        self.dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.lock = DirLock(self.dir_fd, create=not read_only)
        self.segment_size = segment_size
        self.index = DiskIndex()
        self.foreign: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.problems: list[str] = []
        self.truncated: dict[str, int] = {}
        self.kept: dict[str, str] = {}
        self.bytes_written = 0
        self.generation = 0  # bumped whenever the index changes other than by this append
        self._unusable: set[int] = set()  # foreign or refused: never read, written or reused
        self._sealed: set[int] = set()
        self.unverified: set[int] = set()  # segments taken in from headers alone (see refresh)
        self.listed: set[int] = set()  # segments taken in from the manifest's listing, unread
        self._writer: tuple[int, int] | None = None
        self._unsynced: set[int] = set()  # segments changed since the last ``sync`` (see there)
        self._doubtful: set[int] = set()  # segments an fsync failed on (``sync`` rewrites them)

    # -- scanning -----------------------------------------------------------------------
    def refresh(self, headers_only: bool = False, listing: Listing | None = None) -> bool:
        """Take in segments and tails written since the last refresh; True if any changed.

        ``headers_only``: take in whole segments from their record headers without reading the
        payloads (``unverified`` names them) -- for an open whose manifest vouches for them;
        ``verify()`` rescans them if it does not. ``listing``: the manifest's listing of the
        records (``segtable``); a segment it lists as the file is now is taken in from it,
        without a read (``listed`` names them), as unverified as its headers would be: the
        manifest was written after the segment was fsynced, and the segment is unchanged since.
        """
        with self.lock.exclusive():
            stats = self.stat_segments()
            gone = set(self.index.segments) - set(stats)
            if gone:
                self.index = self.index.without(gone)
            changed = bool(gone)
            for number in sorted(set(stats) - self._unusable):
                info, (size, mtime) = self.index.segments.get(number), stats[number]
                if info is not None and info.size == size:
                    continue
                found = None if info is not None or listing is None \
                    else listing.records(number, size, mtime)
                if found is None:
                    changed |= self._scan_tail(number, headers_only)
                    continue
                self._take_in(number, found, [])
                self.index.segments[number].size = size
                self.unverified.add(number)
                self.listed.add(number)
                changed = True
            self.generation += changed
            return changed

    def verify(self, listing: Listing | None = None) -> None:
        """Rebuild the index by scanning every segment in full (payload crcs included), but
        for those the manifest's ``listing`` lists as they are now (taken from it, unread)."""
        with self.lock.exclusive():
            self.index, self.problems = DiskIndex(), []
            self.unverified.clear()
            self.listed.clear()
            self.refresh(listing=listing)
            self.generation += 1

    def stat_segments(self) -> dict[int, tuple[int, int]]:
        """Size and modification time (ns) of every regular segment file, by number (symlinks
        and the like are refused)."""
        stats = {}
        with os.scandir(self.dir_fd) as entries:
            for entry in entries:
                match = SEGMENT_RE.match(entry.name)
                if not match:
                    continue
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    self.refused[entry.name] = "symlink or not a regular file: not read"
                    self._unusable.add(int(match.group(1)))
                    continue
                stats[int(match.group(1))] = (st.st_size, st.st_mtime_ns)
        return stats

    def _scan_tail(self, number: int, headers_only: bool = False) -> bool:
        info = self.index.segments.get(number)
        start = info.size if info is not None else 0
        fd = self.open_read(number)
        try:
            size = os.fstat(fd).st_size
            if info is not None and size == start:
                return False
            if size < start:  # cut by another process: rebuild that segment from its start
                self.index = self.index.without({number})
                start = 0
            if start == 0 and size and os.pread(fd, len(MAGIC), 0) != MAGIC \
                    and not scan_segment(fd, 0, size)[0]:
                self._mark_foreign(number)
                return False
            found = scan_headers(fd, size) if headers_only and start == 0 else None
            if found is not None:
                self.unverified.add(number)
                found, valid_end, problems = found, size, []
            else:
                found, valid_end, problems = scan_segment(fd, start, size)
        finally:
            os.close(fd)
        self._take_in(number, found, problems)
        if found and not self.read_only:  # another process's appends this one's manifest lists
            self._unsynced.add(number)
        self.index.segments[number].size = valid_end
        if valid_end < size:
            self._cut_tail(number, valid_end, size)
        return True

    def _mark_foreign(self, number: int) -> None:
        name = segment_name(number)
        self._unusable.add(number)
        self.foreign[name] = "no tierkv record in it: not a tierkv segment, left untouched"

    def _take_in(self, number: int, found: list[Scanned], problems: list[str]) -> None:
        self.index.segments.setdefault(number, SegmentInfo(number))
        for record in found:
            self.index.add(number, record)
        self.problems += [f"{segment_name(number)} {p}" for p in problems]

    def _cut_tail(self, number: int, valid_end: int, size: int) -> None:
        """Cut the segment back to its last valid record, so appends follow valid records.

        A torn append (a header cut short, or one whose record runs past the end) is dropped.
        Anything else there (a complete record that fails its crc, bytes no tierkv record
        explains) may be someone's data: it is copied to ``<segment>.cut-N`` first.
        """
        name = segment_name(number)
        self._refuse_newer(number, valid_end)
        if self.read_only:  # reported, left as it is (and not scanned again while unchanged)
            self.truncated[name] = size - valid_end
            self.index.segments[number].size = size
            return
        if not self._torn(number, valid_end, size):
            self.kept[name] = self._copy_aside(number, valid_end, size)
        fd = os.open(name, _WO, dir_fd=self.dir_fd)
        try:
            os.ftruncate(fd, valid_end)
        finally:
            os.close(fd)
        self._unsynced.add(number)
        self.truncated[name] = self.truncated.get(name, 0) + size - valid_end

    def _refuse_newer(self, number: int, offset: int) -> None:
        """NewerFormatError when the bytes at ``offset`` start a record of a newer format
        version (this build cannot tell a valid one from damage: it leaves them alone)."""
        fd = self.open_read(number)
        try:
            version = newer_version(os.pread(fd, len(MAGIC) + 2, offset))
        finally:
            os.close(fd)
        if version is not None:
            raise NewerFormatError.of(f"{segment_name(number)} at offset {offset}: record format",
                                      version, VERSION)

    def _torn(self, number: int, offset: int, size: int) -> bool:
        """Whether the bytes from ``offset`` to ``size`` are the start of one record cut short,
        or zeros (space the file system allocated, never written)."""
        fd = self.open_read(number)
        try:
            tail = os.pread(fd, min(size - offset, ZERO_TAIL_MAX), offset)
        finally:
            os.close(fd)
        head = tail[:HEADER.size]
        if size - offset <= ZERO_TAIL_MAX and not tail.strip(b"\0"):
            return True
        if len(head) < HEADER.size:
            lead = head[:len(MAGIC)]
            return lead == MAGIC[:len(lead)]
        try:
            return offset + parse_header(head).length > size
        except CorruptRecordError:
            return False

    def _copy_aside(self, number: int, start: int, end: int) -> str:
        """Copy bytes ``[start, end)`` of segment ``number`` to a new ``<segment>.cut-N``
        (fsynced); its name."""
        base = segment_name(number)
        src = self.open_read(number)
        try:
            for n in itertools.count(1):
                name = f"{base}.cut-{n}"
                try:
                    dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, 0o644, dir_fd=self.dir_fd)
                    break
                except FileExistsError:
                    continue
            try:
                offset = start
                while offset < end:
                    chunk = os.pread(src, min(1 << 22, end - offset), offset)
                    if not chunk:
                        break
                    os.write(dst, chunk)
                    offset += len(chunk)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        os.fsync(self.dir_fd)
        return name

    def _check_writable(self) -> None:
        if self.read_only:
            raise StorageError(f"{self.path} is open read-only")

    def open_read(self, number: int, direct: bool = False) -> int:
        """A read-only descriptor of segment ``number`` (FileNotFoundError once it is deleted);
        ``direct``: opened with O_DIRECT (OSError where the file system refuses it)."""
        return os.open(segment_name(number), _RO | (_DIRECT if direct else 0), dir_fd=self.dir_fd)

    # -- appending ----------------------------------------------------------------------
    def append(self, make_record, moved: bool = False):
        """Append ``make_record(seq, offset)`` (the record's buffers for the next seq, to be
        written at file ``offset``) to the active file. It is first called with offset None to
        size the record, which may then grow by a pad of less than ``PAD_ALIGN`` bytes.

        Returns (segment, Scanned, keys no longer live, key now live). On a write error the
        partial record is cut off again and DiskWriteError raised; nothing else changes.
        """
        self._check_writable()
        with self.lock.exclusive():
            self.refresh()
            seq = self.index.max_seq + 1
            size = sum(len(p) for p in make_record(seq, None))
            number, fd = self._active(size + PAD_ALIGN - 1)
            offset = self.index.segments[number].size
            parts = make_record(seq, offset)
            size = sum(len(p) for p in parts)
            try:
                _write_all(fd, parts, offset)
            except OSError as exc:
                self._cut_after_failure(fd, number, offset)
                raise DiskWriteError(f"writing {size} B to {segment_name(number)} "
                                     f"failed: {exc}") from exc
            self.index.segments[number].size = offset + size
            self.bytes_written += size
            self._unsynced.add(number)
            record = Scanned(parse_header(parts[0][:HEADER.size]), offset)
            return (number, record) + self.index.add(number, record, moved)

    def _active(self, nbytes: int) -> tuple[int, int]:
        top = max(set(self.index.segments) | self._unusable, default=0)
        info = self.index.segments.get(top)
        if info is None or top in self._sealed or \
                (info.size and info.size + nbytes > self.segment_size):
            top = self._create(top + 1)
        if self._writer is None or self._writer[0] != top:
            self._close_writer()
            self._writer = (top, os.open(segment_name(top), _WO, dir_fd=self.dir_fd))
        return self._writer

    def _create(self, number: int) -> int:
        if number > MAX_SEGMENT:  # a seventh digit would name a file no opening lists
            raise StorageError(f"disk tier {self.path}: no segment number is left after "
                               f"{segment_name(MAX_SEGMENT)} (a file of that name is here); "
                               "nothing was written")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(segment_name(number), flags, 0o644, dir_fd=self.dir_fd))
        self.index.segments[number] = SegmentInfo(number)
        return number

    def _cut_after_failure(self, fd: int, number: int, offset: int) -> None:
        try:
            os.ftruncate(fd, offset)
        except OSError:  # the garbage stays at this file's tail: write on in a fresh segment
            self._sealed.add(number)

    def sync(self, segments: set[int] | None = None) -> None:
        """fsync every segment appended to, cut or taken in from another process's appends
        since the last sync (the manifest written after a sync lists them all), or only
        ``segments``, and the directory (DiskWriteError on failure).

        After a failed fsync the kernel may have dropped the pages it could not write and
        report the next fsync of the file a success (Linux does): a segment an fsync failed
        on is not fsynced again but rewritten. The next sync copies its live records, read
        back and checked against their crc32, to a fresh segment, fsyncs that one and deletes
        the doubtful file, so no manifest ever lists it. A record whose bytes no longer pass
        is lost: its bytes are kept aside first (``<segment>.cut-N``), an older copy of its key
        is live again if there is one (as after a crash before the flush), and DiskWriteError
        names it, once.
        """
        self._check_writable()
        with self.lock.exclusive():
            wanted = set(self._unsynced if segments is None else segments)
            rescued, targets, lost = self._rescue(wanted & self._doubtful)
            if segments is None:  # and what the rescue's refreshes took in from other writers
                wanted = set(self._unsynced)
            numbers = sorted((wanted - rescued) | targets)
            number = None  # the segment being fsynced; None: the directory
            try:
                for number in numbers:
                    if self._writer is not None and self._writer[0] == number:
                        os.fsync(self._writer[1])
                        continue
                    try:
                        fd = self.open_read(number)
                    except FileNotFoundError:  # compacted away since
                        continue
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                number = None
                os.fsync(self.dir_fd)
            except OSError as exc:  # the directory's failing doubts every segment it names
                self._doubtful.update(numbers if number is None else [number])
                raise DiskWriteError(f"fsync of {self.path} failed: {exc}") from exc
            self._unsynced.difference_update(numbers)
            self._retire(rescued, lost)

    def _rescue(self, doubtful: set[int]) -> tuple[set[int], set[int], dict[int, list[Scanned]]]:
        """Copy the live records of the ``doubtful`` segments (sealed first: appends go on in
        a fresh segment) to the active one: (the segments, those the copies went to,
        {segment: its records that failed their crc})."""
        if doubtful:
            self.refresh()  # another process's appends to them are copied too
        rescued = {n for n in doubtful if n in self.index.segments}
        self._doubtful -= doubtful - rescued  # deleted since
        if not rescued:
            return rescued, set(), {}
        self._sealed |= rescued
        top = max(set(self.index.segments) | self._unusable)
        if top in rescued:  # the highest segment is never deleted (names are never reused)
            self._create(top + 1)
        targets, lost = set(), {}
        for number in sorted(rescued):
            info = self.index.segments[number]
            for record in [r for r in info.records if self.index.is_live(number, r)]:
                target = self._copy(number, record)
                if target is None:
                    lost.setdefault(number, []).append(record)
                else:
                    targets.add(target)
        return rescued, targets, lost

    def _retire(self, rescued: set[int], lost: dict[int, list[Scanned]]) -> None:
        """Delete the ``rescued`` segments, their records now in synced copies, keeping the
        bytes of the ``lost`` ones aside first; DiskWriteError naming what was lost, and any
        segment that could not be deleted (rescued again at the next sync)."""
        named, failures = [], []
        for number in sorted(rescued):
            self._doubtful.discard(number)
            self._unsynced.discard(number)
            try:
                kept = [self._copy_aside(number, r.offset, r.offset + r.header.length)
                        for r in lost.get(number, ())]
                self._delete(number)
            except (OSError, StorageError) as exc:
                self._doubtful.add(number)
                self._unsynced.add(number)
                failures.append(f"{segment_name(number)}: {exc}")
                continue
            if kept:
                keys = ", ".join(str(r.header.key) for r in lost[number])
                named.append(f"{segment_name(number)}: {keys} (bytes kept in {', '.join(kept)})")
        parts = []
        if named:
            parts.append("; ".join(named) + " did not survive it (the rest were rewritten)")
        if failures:
            parts.append("not deleted, to be rewritten at the next sync: " + "; ".join(failures))
        if parts:
            raise DiskWriteError(f"an earlier fsync of {self.path} failed: " + "; ".join(parts))

    # -- reclaiming ---------------------------------------------------------------------
    def reclaim(self, max_dead: float = 0.5) -> tuple[int, int]:
        """Delete dead segments and compact those more than ``max_dead`` dead.

        Live records are copied (same seq) and fsynced before the old file is unlinked, so a
        crash at any point leaves every live record in at least one segment.
        Returns (segments deleted, segments compacted).
        """
        self._check_writable()
        deleted = compacted = 0
        with self.lock.exclusive():
            self.refresh()
            for number in sorted(self.index.segments):
                info = self.index.segments.get(number)
                if info is None:  # rewritten by a sync below (its fsync had failed)
                    continue
                live = [r for r in info.records if self.index.is_live(number, r)]
                if not info.size or sum(r.header.length for r in live) > (1 - max_dead) * info.size:
                    continue
                if number == max(self.index.segments):
                    self._create(number + 1)
                copies = [self._copy(number, record) for record in live]
                if None in copies:
                    continue  # a live record is corrupt: keep its file as evidence
                if live:
                    self.sync(set(copies))  # not the segments this loop may delete next
                if number not in self.index.segments:
                    continue  # doubtful, rewritten and deleted by that sync
                self._delete(number)
                deleted, compacted = deleted + (not live), compacted + bool(live)
        return deleted, compacted

    def _copy(self, number: int, record: Scanned) -> int | None:
        """Append ``record`` of segment ``number`` again, as it is; the segment it went to, or
        None when it fails its crc."""
        fd = self.open_read(number)
        try:
            data = os.pread(fd, record.header.length, record.offset)
        finally:
            os.close(fd)
        try:
            check_crc(record.header, data)
        except CorruptRecordError:
            return None
        return self.append(lambda seq, offset: (data,), moved=True)[0]  # its pad stays valid

    def _delete(self, number: int) -> None:
        if self._writer is not None and self._writer[0] == number:
            self._close_writer()
        try:
            os.unlink(segment_name(number), dir_fd=self.dir_fd)
            os.fsync(self.dir_fd)
        except OSError as exc:
            raise DiskWriteError(f"deleting {segment_name(number)} failed: {exc}") from exc
        self.index = self.index.without({number})
        self._unsynced.discard(number)
        self._doubtful.discard(number)
        self.generation += 1

    def _close_writer(self) -> None:
        if self._writer is not None:
            os.close(self._writer[1])
            self._writer = None

    def close(self) -> None:
        self._close_writer()
        self.lock.close()
        os.close(self.dir_fd)


def _write_all(fd: int, parts, offset: int) -> None:
    """``pwritev`` of ``parts`` at ``offset``, continuing after short writes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][written:]
