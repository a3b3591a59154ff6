"""Batched disk reads (tierkv.storage.diskread): the read-ahead hint, O_DIRECT reads."""
import errno
import os
from collections import namedtuple

import pytest
import torch

from conftest import block_for, same
from tierkv.config import CodecConfig
from tierkv.storage import CorruptRecordError, RecordKey, diskread, segment
from tierkv.storage import disk as disktier
from tierkv.storage.codec import BLOCK_HEADER_SIZE
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
    """Read through the page cache, raw records come back as 64-byte-aligned views of the batch
    buffer (no decode copy), with the right bytes, across segments and in any key order; other
    codecs decode."""
    keys = [RecordKey("doc", g, s, s + 8) for g in range(3) for s in range(0, 96, 8)]
    with DiskTier(tmp_path, io_threads=2, segment_size=4096, codec=CodecConfig(codec),
                  direct_io=False) as disk:
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


def _direct_ok(path) -> bool:
    """Whether the file system of ``path`` takes O_DIRECT (tmpfs, for one, does not)."""
    probe = path / "probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        probe.unlink()


def test_direct_spans_join_records_whose_blocks_touch():
    B = diskread.DIRECT_BLOCK
    extents = [(0, 100), (100, B), (5 * B + 5, 10), (3 * B, 7), (4 * B, 9), (B, 1), (B, 1)]
    locs = [Loc2(seg, off, n) for seg, (off, n) in zip([1, 1, 1, 1, 1, 1, 2], extents)]
    order = sorted(range(len(locs)), key=lambda i: (locs[i].segment, locs[i].offset))
    assert diskread._direct_spans(order, locs) == [
        (1, 0, 2 * B, [0, 1, 5]),      # 0 .. B + 100: two blocks; record 5 in block 1
        (1, 3 * B, 6 * B, [3, 4, 2]),  # a block after the first span; blocks 3, 4, 5 touch
        (2, B, 2 * B, [6]),            # another segment
    ]
    # a limit of 2 blocks: the span that reached it takes no more records
    assert diskread._direct_spans(order, locs, limit=2 * B)[:3] == [
        (1, 0, 2 * B, [0, 1, 5]), (1, 3 * B, 5 * B, [3, 4]), (1, 5 * B, 6 * B, [2])]


Loc2 = namedtuple("Loc2", "segment offset length")


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_direct_reads_give_what_page_cache_reads_give(tmp_path, codec):
    """Records of several sizes over small segments (a file's last block short), just written
    (still dirty in the page cache) and after a reopen, in any order, a record read twice."""
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    keys = [RecordKey("doc", g, s, s + n) for g in range(3) for s, n in ((0, 5), (5, 64), (69, 1))]
    wanted = keys[::-1] + keys[:4]
    with DiskTier(tmp_path, io_threads=3, segment_size=16384, codec=CodecConfig(codec),
                  direct_io=True) as disk:
        for key in keys:
            disk.put(key, block_for(key, dtype=torch.float16))
        assert disk.reads_direct() and len(list(tmp_path.glob("seg-*"))) > 1
        assert all(same(b, block_for(k, dtype=torch.float16))
                   for k, b in zip(wanted, disk.get_many(wanted)))
    for direct in (True, False):
        with DiskTier(tmp_path, io_threads=2, direct_io=direct) as disk:
            blocks = disk.get_many(wanted)
            assert disk.reads_direct() is direct
            assert all(same(b, block_for(k, dtype=torch.float16)) for k, b in zip(wanted, blocks))
            if codec == "raw":  # views of the read, aligned: the file aligns the tensor bytes
                _assert_views_of_one_read(disk, wanted, blocks)


def _assert_views_of_one_read(disk, keys, blocks):
    """Every block's keys 64-byte aligned and inside one buffer the size of the batch (a decode
    copy would be an allocation of its own)."""
    assert all(b.keys.data_ptr() % diskread.ALIGN == 0 for b in blocks)
    ptrs = [b.keys.data_ptr() for b in blocks]
    assert max(ptrs) - min(ptrs) < sum(disk.size_of(k) + diskread.DIRECT_BLOCK for k in keys)


def _tensor_offsets(disk, keys):
    live = disk._files.index.live
    return [live[k].offset + live[k].header.payload_at + BLOCK_HEADER_SIZE for k in keys]


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_records_put_their_tensor_bytes_on_64_byte_boundaries_of_the_file(tmp_path, codec):
    """Whatever the record sizes before them (odd ones here), across segments and after a
    tombstone; the pad is at most 63 bytes."""
    keys = [RecordKey("doc", 0, s, s + n) for s, n in ((0, 31), (31, 17), (48, 45), (93, 9),
                                                        (102, 33))]
    with DiskTier(tmp_path, segment_size=4096, codec=CodecConfig(codec)) as disk:
        for key in keys[:3]:
            disk.put(key, block_for(key, dtype=torch.float16))
        disk.remove(keys[1])
        for key in keys[3:] + keys[1:2]:
            disk.put(key, block_for(key, dtype=torch.float16))
        assert len(list(tmp_path.glob("seg-*"))) > 1
        assert all(at % segment.PAD_ALIGN == 0 for at in _tensor_offsets(disk, keys))
        assert all(disk._files.index.live[k].header.pad < segment.PAD_ALIGN for k in keys)


def test_version_1_records_without_pad_are_still_read(tmp_path, monkeypatch):
    """Records of the first format (no pad: tensor bytes wherever they fall) and new ones in one
    segment read back right through the page cache and with O_DIRECT (misaligned ones copied)."""
    old = [RecordKey("doc", 0, s, s + n) for s, n in ((0, 3), (3, 1), (4, 7))]
    new = [RecordKey("doc", 1, s, s + n) for s, n in ((0, 2), (2, 5))]
    with monkeypatch.context() as m:
        m.setattr(segment, "VERSION", 1)
        m.setattr(disktier, "payload_pad", lambda offset, lead: 0)
        with DiskTier(tmp_path, codec=CodecConfig("raw")) as disk:
            for key in old:
                disk.put(key, block_for(key, dtype=torch.float16))
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as disk:
        for key in new:
            disk.put(key, block_for(key, dtype=torch.float16))
    data = (tmp_path / "seg-000001.tkv").read_bytes()
    assert int.from_bytes(data[4:6], "little") == 1
    modes = (True, False) if _direct_ok(tmp_path) else (False,)
    for direct in modes:
        with DiskTier(tmp_path, direct_io=direct) as disk:
            live = disk._files.index.live
            assert [live[k].header.pad for k in old] == [0, 0, 0]
            assert any(at % 2 for at in _tensor_offsets(disk, old))  # misaligned as they were
            assert all(at % segment.PAD_ALIGN == 0 for at in _tensor_offsets(disk, new))
            wanted = new + old + old[:1]
            assert all(same(b, block_for(k, dtype=torch.float16))
                       for k, b in zip(wanted, disk.get_many(wanted)))


def test_a_file_system_that_refuses_o_direct_is_read_through_the_page_cache(tmp_path,
                                                                             monkeypatch):
    keys = [RecordKey("doc", 0, s, s + 16) for s in range(0, 160, 16)]
    with DiskTier(tmp_path, io_threads=2) as disk:
        for key in keys:
            disk.put(key, block_for(key))
        opened = disk._files.open_read

        def refuse(number, direct=False):
            if direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return opened(number)
        monkeypatch.setattr(disk._files, "open_read", refuse)
        disk.direct_io = True
        assert disk.reads_direct()
        assert all(same(b, block_for(k)) for k, b in zip(keys, disk.get_many(keys)))
        assert not disk.reads_direct()  # and it stays off: the next read opens without asking
        assert same(disk.get(keys[3]), block_for(keys[3]))


def test_a_direct_read_past_the_end_of_a_cut_file_names_it(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    keys = [RecordKey("doc", 0, s, s + 64) for s in range(0, 640, 64)]
    with DiskTier(tmp_path, direct_io=True) as disk:
        for key in keys:
            disk.put(key, block_for(key))
        disk.flush()
        segment = next(tmp_path.glob("seg-*.tkv"))
        os.truncate(segment, segment.stat().st_size - 10000)  # behind the tier's back
        with pytest.raises(CorruptRecordError, match=f"{segment.name}: read failed .*end of file"):
            disk.get_many(keys[-3:])
        assert same(disk.get(keys[0]), block_for(keys[0]))


def test_auto_reads_direct_only_while_the_records_outgrow_available_memory(tmp_path,
                                                                          monkeypatch):
    """``direct_io="auto"``: through the page cache while RAM could keep the tier's records,
    with O_DIRECT once they outgrow it; the same blocks either way."""
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    keys = [RecordKey("doc", 0, s, s + 16) for s in range(0, 320, 16)]
    asked = []
    read = diskread.read_batch
    monkeypatch.setattr("tierkv.storage.disk.read_batch",
                        lambda *args, **kw: asked.append(kw.get("direct", False)) or read(*args, **kw))
    available = {"bytes": 1 << 40}
    monkeypatch.setattr("tierkv.storage.disk.psutil.virtual_memory",
                        lambda: namedtuple("vm", "available")(available["bytes"]))
    monkeypatch.setattr("tierkv.storage.disk.time.monotonic", lambda: len(asked) * 10.0)
    with DiskTier(tmp_path) as disk:
        for key in keys:
            disk.put(key, block_for(key))
        first = disk.get_many(keys)
        available["bytes"] = disk.used - 1
        second = disk.get_many(keys)
    assert asked == [False, True]
    assert all(same(a, block_for(k)) and same(b, block_for(k))
               for k, a, b in zip(keys, first, second))
