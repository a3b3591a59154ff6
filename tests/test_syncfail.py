"""A failed fsync: the segment it failed on is rewritten, never trusted to a second fsync.

Linux may drop the dirty pages it could not write back and report the next fsync of the same
file a success, so a retried fsync proves nothing. These tests fail ``os.fsync`` on chosen files
and check that the next flush copies the doubtful segment's records to a fresh segment (read back
and crc-checked), fsyncs that one instead and deletes the doubtful file; and that a record whose
bytes were lost meanwhile is named, once, and never vouched for.
"""
from __future__ import annotations

import errno
import os

import pytest

from tierkv.storage import CorruptRecordError, DiskTier, RecordKey
from tierkv.storage.manifest import DiskWriteError


def _name(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


class _Fsync:
    """``os.fsync`` that fails (EIO) on the first call for a file named ``fail`` (a segment's
    name, or "dir" for the directory), and records the names of the files it syncs."""

    def __init__(self, fail: str | None, directory: str):
        self.fail, self.directory, self.synced, self.real = fail, directory, [], os.fsync

    def __call__(self, fd: int):
        name = _name(fd)
        name = "dir" if name == self.directory else name
        if name == self.fail:
            self.fail = None
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.synced.append(name)
        return self.real(fd)


def _segments(path) -> list[str]:
    return sorted(p.name for p in path.glob("seg-*.tkv"))


def _keys(n: int) -> list[RecordKey]:
    return [RecordKey("doc", 0, 16 * i, 16 * i + 16) for i in range(n)]


@pytest.mark.parametrize("which", ["first", "last", "dir"])
def test_a_segment_an_fsync_failed_on_is_rewritten_not_synced_again(tmp_path, make_block,
                                                                   blocks_equal, monkeypatch,
                                                                   which):
    keys = _keys(9)
    tier = DiskTier(tmp_path, segment_size=8192)
    for key in keys:
        tier.put(key, make_block(key))
    before = _segments(tmp_path)
    assert len(before) >= 3
    fail = {"first": before[0], "last": before[-1], "dir": "dir"}[which]
    fsync = _Fsync(fail, tmp_path.name)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DiskWriteError, match="fsync"):
        tier.flush()
    doubtful = set(before) if which == "dir" else {fail}
    fsync.synced.clear()

    tier.flush()  # the retry: a rewrite of the doubtful segments, not a second fsync of them
    after = _segments(tmp_path)
    assert not doubtful & set(after) and not doubtful & set(fsync.synced)
    assert set(after) - set(before) <= set(fsync.synced)  # the copies' segments
    assert all(blocks_equal(tier.get(key), make_block(key)) for key in keys)
    extra = RecordKey("doc", 1, 0, 16)  # appends go on, in a segment never doubted
    tier.put(extra, make_block(extra))
    assert tier._files._writer[0] not in {int(n[4:10]) for n in doubtful}
    tier.close()
    with DiskTier(tmp_path) as reopened:
        assert reopened.open_report["listed"] == len(_segments(tmp_path))  # the manifest vouches
        assert all(blocks_equal(reopened.get(key), make_block(key)) for key in keys + [extra])


def test_records_lost_after_a_failed_fsync_are_named_once(tmp_path, make_block, blocks_equal,
                                                         monkeypatch):
    keys = _keys(9)
    tier = DiskTier(tmp_path, segment_size=8192)
    for key in keys:
        tier.put(key, make_block(key))
    first = _segments(tmp_path)[0]
    monkeypatch.setattr(os, "fsync", _Fsync(first, tmp_path.name))
    with pytest.raises(DiskWriteError):
        tier.flush()
    index = tier._files.index
    number = int(first[4:10])
    lost = next(loc for key, loc in index.live.items() if loc.segment == number)
    with open(tmp_path / first, "r+b") as f:  # the write-back the kernel dropped: stale bytes
        f.seek(lost.offset + lost.header.payload_at)
        f.write(b"\x5a" * 16)
    lost_key = lost.header.key

    with pytest.raises(DiskWriteError, match="did not survive") as err:
        tier.flush()
    assert str(lost_key) in str(err.value)
    assert first in _segments(tmp_path)  # kept: the evidence, and where the record still is
    tier.flush()  # named once
    with pytest.raises(CorruptRecordError):
        tier.get(lost_key)
    assert all(blocks_equal(tier.get(k), make_block(k)) for k in keys if k != lost_key)
    tier.close()
    with DiskTier(tmp_path) as reopened:
        with pytest.raises(CorruptRecordError):
            reopened.get(lost_key)
        assert all(blocks_equal(reopened.get(k), make_block(k)) for k in keys if k != lost_key)


def test_another_writers_appends_to_a_doubtful_segment_are_rewritten_too(tmp_path, make_block,
                                                                        blocks_equal,
                                                                        monkeypatch):
    """Two writers share the directory (as two processes do): the records the other one
    appended to the segment after this one's fsync of it failed are copied with it."""
    keys = _keys(4)
    mine = DiskTier(tmp_path, segment_size=1 << 20)
    for key in keys[:2]:
        mine.put(key, make_block(key))
    (segment,) = _segments(tmp_path)
    monkeypatch.setattr(os, "fsync", _Fsync(segment, tmp_path.name))
    with pytest.raises(DiskWriteError):
        mine.flush()
    theirs = DiskTier(tmp_path, segment_size=1 << 20)
    for key in keys[2:]:
        theirs.put(key, make_block(key))
    assert _segments(tmp_path) == [segment]  # they appended to the doubtful segment

    mine.flush()
    assert segment not in _segments(tmp_path)
    for tier in (mine, theirs):
        assert all(blocks_equal(tier.get(key), make_block(key)) for key in keys)
    theirs.close()
    mine.close()
    with DiskTier(tmp_path) as reopened:
        assert all(blocks_equal(reopened.get(key), make_block(key)) for key in keys)
