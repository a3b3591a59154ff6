"""The disk tier facing hostile input, damaged files, newer formats and read-only opens."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from tierkv.config import CodecConfig
from tierkv.storage import CorruptRecordError, DiskTier, RecordKey, StorageError
from tierkv.storage.manifest import MANIFEST, encode_manifest
from tierkv.storage import segment
from tierkv.storage.segment import HEADER


def _key(doc="doc", group=0, start=0, end=16):
    return RecordKey(doc, group, start, end)


@pytest.mark.parametrize("bad", [dict(io_threads=0), dict(segment_size="1k"), dict(codec="zstd"),
                                 dict(budget="much"), dict(direct_io=1)])
def test_bad_arguments_are_named(tmp_path, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DiskTier(tmp_path, **bad)


@pytest.mark.parametrize("doc", ["../x", "a/b", "/abs", ".hidden", "", "x" * 65])
def test_hostile_doc_names_refused(tmp_path, doc):
    with DiskTier(tmp_path) as tier, pytest.raises(ValueError, match="doc"):
        tier.set_doc_meta(doc, {}, {})


def test_hostile_array_names_and_meta_refused(tmp_path):
    with DiskTier(tmp_path) as tier:
        with pytest.raises(ValueError, match="array name"):
            tier.set_doc_meta("d", {}, {"../x": torch.zeros(1)})
        with pytest.raises(ValueError, match="JSON"):
            tier.set_doc_meta("d", {"f": float("nan")}, {})


def test_symlinked_segment_and_manifest_refused(tmp_path, make_block):
    outside = tmp_path / "outside"
    inside = tmp_path / "kv"
    with DiskTier(outside) as tier:
        tier.put(_key(), make_block(_key()))
    inside.mkdir()
    os.symlink(outside / "seg-000001.tkv", inside / "seg-000001.tkv")
    os.symlink(outside / MANIFEST, inside / MANIFEST)
    with DiskTier(inside) as tier:
        assert "seg-000001.tkv" in tier.open_report["refused"]
        assert tier.open_report["manifest"].startswith("corrupt") and len(tier) == 0
        tier.put(_key("new"), make_block(_key("new")))
    assert (outside / "seg-000001.tkv").stat().st_size > 0
    assert os.path.islink(inside / "seg-000001.tkv")


def test_foreign_file_named_like_a_segment_left_alone(tmp_path, make_block, blocks_equal):
    text = b"my precious notes, not a tierkv segment\n" * 100
    (tmp_path / "seg-000001.tkv").write_bytes(text)
    with DiskTier(tmp_path) as tier:
        assert "seg-000001.tkv" in tier.open_report["foreign"]
        tier.put(_key(), make_block(_key()))
    assert (tmp_path / "seg-000001.tkv").read_bytes() == text
    with DiskTier(tmp_path) as tier:
        assert blocks_equal(tier.get(_key()), make_block(_key()))


def test_manifest_with_absurd_offsets_set_aside(tmp_path, make_block):
    with DiskTier(tmp_path) as tier:
        tier.put(_key(), make_block(_key()))
    index = {f: [v] for f, v in dict(segment=1, offset=-5, length=1 << 50, group=0, start=0,
                                     end=16, codec=1, seq=1, doc=0).items()}
    (tmp_path / MANIFEST).write_bytes(encode_manifest(index, ["doc"], {}, {}))
    with DiskTier(tmp_path) as tier:
        report = tier.open_report["manifest"]
        assert "impossible" in report and "moved aside" in report and len(tier) == 1
    assert list(tmp_path.glob("manifest.corrupt-*.safetensors"))


def test_manifest_header_length_absurd(tmp_path, make_block):
    with DiskTier(tmp_path) as tier:
        tier.put(_key(), make_block(_key()))
    (tmp_path / MANIFEST).write_bytes(struct.pack("<Q", 1 << 60) + json.dumps({}).encode())
    with DiskTier(tmp_path) as tier:
        assert "absurd" in tier.open_report["manifest"] and len(tier) == 1


def test_pad_bytes_and_fields_are_checked(tmp_path, make_block):
    """A record's pad bytes must be zero, its pad below PAD_ALIGN, and absent from version 1."""
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
        path = tmp_path / "seg-000001.tkv"
        data = bytearray(path.read_bytes())
        header = segment.parse_header(data)
        assert header.pad > 0  # the first record of a file: 157 bytes to its tensor bytes
        data[HEADER.size + header.pad - 1] = 1
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptRecordError, match="pad bytes are not zero"):
            tier.get(_key())
    head = bytearray(data[:HEADER.size])
    pad_at = HEADER.size - 4 - 12  # the field after doc
    for version, pad, problem in ((2, segment.PAD_ALIGN, "pad 64 invalid"),
                                  (1, 3, "pad 3 invalid for format version 1")):
        struct.pack_into("<H", head, 4, version)
        head[pad_at] = pad
        with pytest.raises(CorruptRecordError, match=problem):
            segment.parse_header(bytes(head))
    with pytest.raises(ValueError, match="pad=64"):
        segment.pack_record(segment.KIND_DATA, _key(), 1, b"x", pad=64)


def test_corrupt_payload_raises_never_returns(tmp_path, make_block):
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
        path = tmp_path / "seg-000001.tkv"
        data = bytearray(path.read_bytes())
        data[HEADER.size + 40] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptRecordError, match="crc32"):
            tier.get(_key())
        assert tier.check()[0]["ok"] is False


def test_directory_path_validation(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="'.*file' exists and is not a directory"):
        DiskTier(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    with pytest.raises(ValueError, match="path"):
        DiskTier("")
    # a directory that cannot be made (a file in the way; /proc takes no new directories)
    with pytest.raises(OSError, match="disk tier directory '.*file/sub': cannot create it"):
        DiskTier(tmp_path / "file" / "sub")
    with pytest.raises(FileNotFoundError, match="disk tier directory '/proc/tierkv-.*': cannot"):
        DiskTier("/proc/tierkv-test")


def test_removed_records_reclaimed(tmp_path, make_block, blocks_equal):
    keys = [_key("d", 0, 16 * i, 16 * i + 16) for i in range(20)]
    with DiskTier(tmp_path, segment_size=8192, codec=CodecConfig("raw")) as tier:
        for key in keys:
            tier.put(key, make_block(key))
        for key in keys[:15]:
            tier.remove(key)
        deleted, compacted = tier.reclaim()
        assert deleted > 0 and sorted(tier.keys()) == keys[15:]
    with DiskTier(tmp_path) as tier:
        assert sorted(tier.keys()) == keys[15:]
        assert all(blocks_equal(tier.get(k), make_block(k)) for k in keys[15:])


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_a_manifest_whose_version_damage_made_newer_is_repaired_not_refused(tmp_path, make_block,
                                                                            blocks_equal):
    """A bit flipped in the version ('1' to '5') leaves the manifest's crc32 failing: damage,
    set aside and rebuilt from the segments, not a newer build's directory to refuse."""
    with DiskTier(tmp_path / "d") as tier:
        tier.put(_key(), make_block(_key()))
    path = tmp_path / "d" / MANIFEST
    data = path.read_bytes()
    at = data.index(b'"version":"1"') + len(b'"version":"')
    path.write_bytes(data[:at] + b"5" + data[at + 1:])
    with DiskTier(tmp_path / "d") as tier:
        assert tier.open_report["manifest"] != "ok"
        assert blocks_equal(tier.get(_key()), make_block(_key()))
    assert list((tmp_path / "d").glob("manifest.corrupt-*"))  # kept as evidence


def test_a_newer_format_is_refused_and_left_as_it_is(tmp_path, make_block, monkeypatch):
    """Records or a manifest a newer tierkv wrote: opening refuses with NewerFormatError and
    changes nothing (no tail cut, no manifest set aside), torn tail or not; an impossible older
    version is only damage: cut, kept aside."""
    import tierkv.storage.manifest as manifest
    import tierkv.storage.segment as segment
    from tierkv.storage.base import NewerFormatError

    newer = tmp_path / "newer"
    monkeypatch.setattr(segment, "VERSION", segment.VERSION + 1)
    with DiskTier(newer, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
    monkeypatch.undo()
    before = _snapshot(newer)
    newer_version = f"record format version {segment.VERSION + 1}: this tierkv reads"
    with pytest.raises(NewerFormatError, match=newer_version):
        DiskTier(newer)
    assert _snapshot(newer) == before

    with DiskTier(tmp_path / "m") as tier:
        tier.put(_key(), make_block(_key()))
    monkeypatch.setattr(manifest, "VERSION", "2")
    with DiskTier(tmp_path / "m") as tier:
        tier.put(_key("b"), make_block(_key("b")))
    monkeypatch.undo()
    before = _snapshot(tmp_path / "m")
    with pytest.raises(NewerFormatError, match="manifest version 2"):
        DiskTier(tmp_path / "m")
    assert _snapshot(tmp_path / "m") == before

    torn = tmp_path / "torn-newer"  # a torn tail is not cut before the manifest refuses
    with DiskTier(torn, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
    monkeypatch.setattr(manifest, "VERSION", "2")
    with DiskTier(torn) as tier:
        tier.put(_key("b"), make_block(_key("b")))
    monkeypatch.undo()
    seg = sorted(torn.glob("seg-*.tkv"))[-1]
    os.truncate(seg, seg.stat().st_size - 50)
    before = _snapshot(torn)
    with pytest.raises(NewerFormatError, match="manifest version 2"):
        DiskTier(torn)
    assert _snapshot(torn) == before

    tail = tmp_path / "newer-tail"  # newer records appended after ours: never cut
    with DiskTier(tail, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
    monkeypatch.setattr(segment, "VERSION", segment.VERSION + 1)
    with DiskTier(tail, codec=CodecConfig("raw")) as tier:
        tier.put(_key("b"), make_block(_key("b")))
    monkeypatch.undo()
    os.unlink(tail / MANIFEST)
    seg = tail / "seg-000001.tkv"
    os.truncate(seg, seg.stat().st_size - 50)  # the newer record, torn
    before = _snapshot(tail)
    with pytest.raises(NewerFormatError, match=f"format version {segment.VERSION + 1}"):
        DiskTier(tail)
    assert _snapshot(tail) == before

    damaged = tmp_path / "damaged"
    with DiskTier(damaged, codec=CodecConfig("raw")) as tier:
        tier.put(_key(), make_block(_key()))
    os.unlink(damaged / MANIFEST)
    seg = damaged / "seg-000001.tkv"
    data = bytearray(seg.read_bytes())
    data[4] += 1  # the version field, little-endian u16 after the magic: a newer one at the tail
    seg.write_bytes(bytes(data))
    with pytest.raises(NewerFormatError):  # newer or damaged, it is not this build's to cut
        DiskTier(damaged)
    assert seg.read_bytes() == bytes(data)
    data[4] = 0  # an older, impossible version: damage, kept aside
    seg.write_bytes(bytes(data))
    with DiskTier(damaged) as tier:
        assert len(tier) == 0 and tier.open_report["kept"] == {"seg-000001.tkv": "seg-000001.tkv.cut-1"}
    assert (damaged / "seg-000001.tkv.cut-1").read_bytes() == bytes(data)


def test_a_cut_tail_is_kept_unless_it_is_a_torn_append(tmp_path, make_block, blocks_equal):
    """Reopening cuts a segment back to its last valid record. A complete last record whose
    payload fails its crc (with no manifest vouching for it) is copied to seg-*.cut-N first;
    an append cut short by a crash is just dropped."""
    a, b = _key("a"), _key("b")
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as tier:
        tier.put(a, make_block(a))
        tier.put(b, make_block(b))
    os.unlink(tmp_path / MANIFEST)
    seg = tmp_path / "seg-000001.tkv"
    data = bytearray(seg.read_bytes())
    data[-7] ^= 0x01  # inside b's payload
    seg.write_bytes(bytes(data))
    with DiskTier(tmp_path) as tier:
        assert tier.keys() == [a] and blocks_equal(tier.get(a), make_block(a))
        kept = tmp_path / tier.open_report["kept"]["seg-000001.tkv"]
        tier.put(b, make_block(b))
    assert kept.read_bytes() == bytes(data[len(data) - len(kept.read_bytes()):])
    assert len(kept.read_bytes()) > HEADER.size

    torn = tmp_path / "torn"
    with DiskTier(torn, codec=CodecConfig("raw")) as tier:
        tier.put(a, make_block(a))
        tier.put(b, make_block(b))
    seg = torn / "seg-000001.tkv"
    os.truncate(seg, seg.stat().st_size - 100)
    with DiskTier(torn) as tier:
        assert tier.keys() == [a] and tier.open_report["truncated"] and not tier.open_report["kept"]
    assert not list(torn.glob("*.cut-*"))


def test_read_only_open_changes_nothing(tmp_path, make_block, blocks_equal):
    """``read_only=True`` (tierkv inspect): a torn tail is reported, not cut; a damaged manifest
    is reported, not set aside; no lock file appears; the records read back; writes raise."""
    a, b = _key("a"), _key("b")
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as tier:
        tier.put(a, make_block(a))
        tier.put(b, make_block(b))
    seg = tmp_path / "seg-000001.tkv"
    os.truncate(seg, seg.stat().st_size - 100)  # b torn
    (tmp_path / MANIFEST).write_bytes(b"not a manifest")
    (tmp_path / "tierkv.lock").unlink()
    before = _snapshot(tmp_path)
    with DiskTier(tmp_path, read_only=True) as tier:
        report = tier.open_report
        assert report["truncated"] and "left in place (read-only)" in report["manifest"]
        assert tier.keys() == [a] and blocks_equal(tier.get(a), make_block(a))
        for write in (lambda: tier.put(b, make_block(b)), lambda: tier.remove(a), tier.flush,
                      lambda: tier.delete_doc("a")):
            with pytest.raises(StorageError, match="read-only"):
                write()
    assert _snapshot(tmp_path) == before
    torn_bytes = report["truncated"]["seg-000001.tkv"]
    assert 0 < torn_bytes < make_block(b).nbytes + HEADER.size
    with DiskTier(tmp_path, read_only=True) as tier:  # the tail's bytes, counted once
        assert tier.open_report["truncated"] == {"seg-000001.tkv": torn_bytes}
        tier.refresh()
        tier.refresh()
        assert tier.open_report["truncated"]["seg-000001.tkv"] == torn_bytes
        assert tier._files.truncated["seg-000001.tkv"] == torn_bytes
        with pytest.raises(StorageError, match="read-only"):
            tier.set_doc_meta("a", {}, {})
    with pytest.raises(FileNotFoundError):
        DiskTier(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()


@pytest.mark.timeout(30)  # a regression blocks on the FIFO: failed here, not the suite hung
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_manifest_that_is_no_regular_file_is_set_aside_not_read(tmp_path, make_block, blocks_equal,
                                                                  kind):
    """A FIFO in the manifest's place would block the opening for ever; a directory would fail
    it with a bare OS error. Both are damage: set aside, the records kept."""
    with DiskTier(tmp_path) as tier:
        tier.put(_key(), make_block(_key()))
    (tmp_path / MANIFEST).unlink()
    os.mkfifo(tmp_path / MANIFEST) if kind == "fifo" else (tmp_path / MANIFEST).mkdir()
    with DiskTier(tmp_path, read_only=True) as tier:  # left in place
        report = tier.open_report["manifest"]
        assert report.startswith("corrupt")
        assert ("not a regular file" if kind == "fifo" else "a directory") in report
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["manifest"].startswith("corrupt")
        assert blocks_equal(tier.get(_key()), make_block(_key()))
    assert (tmp_path / MANIFEST).is_file()  # a fresh one, written at close


def test_no_segment_number_left_refuses_the_write(tmp_path, make_block, blocks_equal):
    """Segment names hold six digits: a stray ``seg-999999.tkv`` leaves no number for a new
    segment, and the write is refused before anything lands in a file no opening would list."""
    with DiskTier(tmp_path) as tier:
        tier.put(_key("kept"), make_block(_key("kept")))
        tier.set_doc_meta("kept", {"n": 1}, {})
    (tmp_path / "seg-999999.tkv").write_bytes(b"junk\n")
    with DiskTier(tmp_path) as tier:
        with pytest.raises(StorageError, match="no segment number is left"):
            tier.put(_key("new"), make_block(_key("new")))
    assert not (tmp_path / "seg-1000000.tkv").exists()
    with DiskTier(tmp_path) as tier:
        assert blocks_equal(tier.get(_key("kept")), make_block(_key("kept")))
        assert tier.doc_meta("kept")[0] == {"n": 1}


def test_doc_meta_arrays_checked_when_set(tmp_path, make_block):
    """A tensor the manifest can hold is saved whatever its shape (0-dim too); one it cannot is
    refused when set, naming it, with the document's metadata as it was: never a save that
    fails from then on and takes the other documents' metadata with it."""
    with DiskTier(tmp_path) as tier:
        tier.put(_key("a"), make_block(_key("a")))
        tier.set_doc_meta("a", {"title": "A"}, {"ids": torch.arange(4)})
        tier.set_doc_meta("b", {"v": 1}, {"t": torch.tensor(0.7), "x": torch.arange(3)})
        for bad in (torch.eye(3).to_sparse(), torch.empty(3, device="meta")):
            with pytest.raises(ValueError, match="array 'x' of 'b'"):
                tier.set_doc_meta("b", {"v": 2}, {"x": bad})
        with pytest.raises(ValueError, match="not a tensor"):
            tier.set_doc_meta("b", {"v": 2}, {"x": [1, 2]})
    with DiskTier(tmp_path) as tier:
        assert tier.saved_docs() == ["a", "b"]
        meta, arrays = tier.doc_meta("b")
        assert meta == {"v": 1} and torch.equal(arrays["x"], torch.arange(3))
        assert arrays["t"].shape == () and arrays["t"].item() == pytest.approx(0.7)
        assert torch.equal(tier.doc_meta("a")[1]["ids"], torch.arange(4))


@pytest.mark.parametrize("bad", ["x", float("nan"), -0.1, 1.5, True])
def test_reclaim_share_checked(tmp_path, bad):
    with DiskTier(tmp_path) as tier, pytest.raises(ValueError, match="max_dead"):
        tier.reclaim(bad)


@pytest.mark.parametrize("block", [None, "kv", (torch.zeros(1, 1, 16, 4),) * 2])
def test_put_of_something_else_than_a_kvblock_named(tmp_path, block):
    with DiskTier(tmp_path) as tier, pytest.raises(ValueError, match="expected a KVBlock"):
        tier.put(_key(), block)
