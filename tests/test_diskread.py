"""Batched disk reads (tierkv.storage.diskread): the read-ahead hint."""
import os
from collections import namedtuple

import pytest

from conftest import block_for, same
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
