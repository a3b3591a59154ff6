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

from tierkv.storage import DiskTier, RecordKey
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


def _stale(path, loc) -> None:
    """The record at ``loc`` as the disk holds it after its write-back was dropped: stale
    bytes in its payload."""
    with open(path / f"seg-{loc.segment:06d}.tkv", "r+b") as f:
        f.seek(loc.offset + loc.header.payload_at)
        f.write(b"\x5a" * 16)


def test_records_lost_after_a_failed_fsync_are_named_once_and_kept_aside(tmp_path, make_block,
                                                                        blocks_equal,
                                                                        monkeypatch):
    """The doubtful segment is deleted all the same (kept, it would tie with the copies of its
    good records, and win at the next opening: it has the lower number), the lost record's
    bytes kept aside; an older copy of its key is live again, as after a crash before the
    flush, and the reclaim after it keeps the copies."""
    keys = _keys(6)
    tier = DiskTier(tmp_path, segment_size=16384)  # three records a segment
    tier.put(keys[1], make_block(_key_x()))  # keys[1]'s earlier version, made durable
    for key in (RecordKey("y", 0, 0, 16), RecordKey("y", 0, 16, 32)):
        tier.put(key, make_block(key))
    tier.flush()
    for key in keys:
        tier.put(key, make_block(key))
    where = tier._files.index.live
    segment = f"seg-{where[keys[0]].segment:06d}.tkv"
    assert where[keys[1]].segment == where[keys[0]].segment > 1
    monkeypatch.setattr(os, "fsync", _Fsync(segment, tmp_path.name))
    with pytest.raises(DiskWriteError):
        tier.flush()
    for key in keys[:2]:
        _stale(tmp_path, tier._files.index.live[key])

    with pytest.raises(DiskWriteError, match="did not survive") as err:
        tier.flush()
    assert str(keys[0]) in str(err.value) and str(keys[1]) in str(err.value)
    assert segment not in _segments(tmp_path)
    assert sorted(p.name for p in tmp_path.glob(f"{segment}.cut-*")) == \
        [f"{segment}.cut-1", f"{segment}.cut-2"]
    tier.flush()  # named once
    with pytest.raises(KeyError):
        tier.get(keys[0])
    assert blocks_equal(tier.get(keys[1]), make_block(_key_x()))  # the older copy
    assert all(blocks_equal(tier.get(k), make_block(k)) for k in keys[2:])
    tier.close()
    with DiskTier(tmp_path) as reopened:
        reopened.reclaim(0.0)
        assert all(blocks_equal(reopened.get(k), make_block(k)) for k in keys[2:])
        assert blocks_equal(reopened.get(keys[1]), make_block(_key_x()))
        assert keys[0] not in reopened.keys()


def _key_x() -> RecordKey:
    return RecordKey("x", 0, 16, 32)


def test_a_rescue_that_cannot_delete_a_segment_still_names_what_was_lost(tmp_path, make_block,
                                                                        monkeypatch):
    tier = DiskTier(tmp_path, segment_size=8192)
    keys = _keys(2)
    for key in keys:
        tier.put(key, make_block(key))
    first, second = _segments(tmp_path)
    monkeypatch.setattr(os, "fsync", _Fsync("dir", tmp_path.name))  # both doubtful
    with pytest.raises(DiskWriteError):
        tier.flush()
    _stale(tmp_path, tier._files.index.live[keys[0]])
    real, failed = os.unlink, []

    def unlink(path, *args, **kwargs):
        if path == second and not failed:
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(DiskWriteError) as err:
        tier.flush()
    assert str(keys[0]) in str(err.value) and second in str(err.value)
    tier.flush()  # the segment not deleted is rewritten (nothing of it is live) and deleted
    assert first not in _segments(tmp_path) and second not in _segments(tmp_path)
    tier.close()


def test_a_flush_syncs_what_its_rescue_took_in_from_another_writer(tmp_path, make_block,
                                                                  monkeypatch):
    """The manifest the flush writes lists every segment the rescue's refresh took in, so
    each must be fsynced first."""
    mine = DiskTier(tmp_path, segment_size=8192)
    for key in _keys(3):
        mine.put(key, make_block(key))
    doubtful = _segments(tmp_path)[-1]
    fsync = _Fsync(doubtful, tmp_path.name)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DiskWriteError):
        mine.flush()
    theirs = DiskTier(tmp_path, segment_size=8192)
    key = RecordKey("theirs", 0, 0, 16)
    theirs.put(key, make_block(key))
    added = set(_segments(tmp_path)) - {doubtful} - set(fsync.synced)
    fsync.synced.clear()
    mine.flush()
    assert added and added <= set(fsync.synced)
    assert key in mine.keys()  # taken in, and counted
    theirs._files.close()
    mine.close()


def test_compaction_whose_sync_rewrites_the_active_segment(tmp_path, make_block, blocks_equal,
                                                          monkeypatch):
    """The segment being written is doubtful; compaction copies into it and syncs the copies:
    that sync rewrites it (and deletes it) under the compaction's loop."""
    from tierkv.config import CodecConfig

    tier = DiskTier(tmp_path, segment_size=16384, codec=CodecConfig(codec="raw"))
    keys = _keys(4)
    for key in keys:
        tier.put(key, make_block(key))
    segments = _segments(tmp_path)
    assert len(segments) >= 2
    monkeypatch.setattr(os, "fsync", _Fsync(segments[-1], tmp_path.name))
    with pytest.raises(DiskWriteError):
        tier.flush()
    first = [k for k, loc in tier._files.index.live.items() if loc.segment == 1]
    for key in first[1:]:
        tier.remove(key)
    tier.reclaim()
    kept = [k for k in keys if k not in first[1:]]
    assert all(blocks_equal(tier.get(k), make_block(k)) for k in kept)
    assert segments[-1] not in _segments(tmp_path)
    tier.close()
    with DiskTier(tmp_path) as reopened:
        assert sorted(reopened.keys()) == sorted(kept)


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
