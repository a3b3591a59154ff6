"""Batched disk reads (tierkv.storage.diskread): the read-ahead hint."""
import os
from collections import namedtuple

import pytest

from conftest import block_for, same
from tierkv.config import CodecConfig
from tierkv.storage import RecordKey, diskread
from tierkv.storage.disk import DiskTier

Loc = namedtuple("Loc", "offset length")


def test_advise_merges_adjacent_extents(monkeypatch):
    calls = []
    monkeypatch.setattr(diskread, "_ADVISE", True)
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: calls.append(args), raising=False)
    diskread._advise(7, [Loc(0, 10), Loc(10, 5), Loc(20, 4), Loc(24, 1), Loc(100, 3)])
    advice = getattr(os, "POSIX_FADV_WILLNEED", None)
    assert calls == [(7, 0, 15, advice), (7, 20, 5, advice), (7, 100, 3, advice)]


@pytest.mark.parametrize("hint", ["on", "off", "fails"])
def test_reads_do_not_depend_on_the_hint(tmp_path, monkeypatch, hint):
    keys = [RecordKey("doc", g, s, s + 16) for g in range(2) for s in range(0, 160, 16)]
    with DiskTier(tmp_path, io_threads=3) as disk:
        for key in keys:
            disk.put(key, block_for(key))
        monkeypatch.setattr(diskread, "_ADVISE", hint != "off")
        if hint == "fails":
            def refuse(*args):
                raise OSError("no hints here")
            monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
        wanted = keys[::3] + keys[1:3]
        assert all(same(block, block_for(key)) for key, block in zip(wanted, disk.get_many(wanted)))


@pytest.mark.parametrize("codec, views", [("raw", True), ("zstd", False)])
def test_raw_records_arrive_aligned_as_views_of_the_read(tmp_path, codec, views):
    """Raw records come back as 64-byte-aligned views of the batch buffer (no decode copy),
    with the right bytes, across segments and in any key order; other codecs decode."""
    keys = [RecordKey("doc", g, s, s + 8) for g in range(3) for s in range(0, 96, 8)]
    with DiskTier(tmp_path, io_threads=2, segment_size=4096, codec=CodecConfig(codec)) as disk:
        for key in keys:
            disk.put(key, block_for(key))
        wanted = keys[::-2] + keys[1:5]
        blocks = disk.get_many(wanted)
        longest = max(disk.size_of(key) for key in wanted)
    assert all(same(block, block_for(key)) for key, block in zip(wanted, blocks))
    if views:  # raw: aligned, and all inside the one buffer the batch was read into
        assert all(b.keys.data_ptr() % diskread.ALIGN == 0 for b in blocks)
        ptrs = [b.keys.data_ptr() for b in blocks]
        assert max(ptrs) - min(ptrs) < len(wanted) * (longest + diskread.ALIGN)
