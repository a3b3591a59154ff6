"""The manifest's listing of the segments' records: a clean directory opens from it without
reading a segment, and anything it does not vouch for is read as before."""
from __future__ import annotations

import os

import pytest
import torch

import tierkv.storage.disk as disk_module
from tierkv import TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.storage import CorruptRecordError, DiskTier, RecordKey
from tierkv.storage.manifest import MANIFEST, encode_manifest, read_manifest
from tierkv.storage.segment import HEADER
from tierkv.storage.segtable import PREFIX

from tinyllama import ids, tiny


def _key(doc="doc", group=0, start=0, end=16):
    return RecordKey(doc, group, start, end)


def _fill(path, make_block, segment_size=8192):
    """Three documents over several segments, with a record replaced, one removed and a
    document deleted: dead records and both kinds of tombstone in the segments."""
    keys = [_key(f"d{i % 3}", i % 2, 16 * i, 16 * i + 16) for i in range(24)]
    with DiskTier(path, segment_size=segment_size) as tier:
        for key in keys:
            tier.put(key, make_block(key))
        tier.put(keys[0], make_block(keys[1]))  # replaced: the first copy is dead
        tier.remove(keys[3])
        tier.delete_doc("d2")
        tier.set_doc_meta("d0", {"n": 1}, {"x": torch.arange(4)})
    return {k: (make_block(keys[1]) if k == keys[0] else make_block(k))
            for k in keys if k != keys[3] and k.doc != "d2"}


def _index(tier):
    index = tier._files.index
    return ({k: (loc.segment, loc.offset, loc.header) for k, loc in index.live.items()},
            {n: (info.size, info.records) for n, info in index.segments.items()},
            index.doc_tombs, index.key_tombs, index.max_seq)


def test_a_clean_directory_opens_from_the_listing_to_the_index_a_full_scan_builds(
        tmp_path, make_block, blocks_equal):
    want = _fill(tmp_path, make_block)
    with DiskTier(tmp_path) as tier:
        report = tier.open_report
        assert report["segments"] > 3 and report["listed"] == report["segments"]
        assert report["manifest"] == "ok" and report["checked"].startswith("headers")
        listed = _index(tier)
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
        assert set(tier.keys()) == set(want) and tier.doc_meta("d0")[0] == {"n": 1}
        tier._files.verify()  # every record read and crc-checked
        assert _index(tier) == listed


def test_an_empty_segment_is_listed(tmp_path, make_block):
    """A segment created and not yet written to (a compaction's fresh top segment)."""
    _fill(tmp_path, make_block)
    with DiskTier(tmp_path) as tier, tier._files.lock.exclusive():
        tier._files._create(max(tier._files.index.segments) + 1)
    for opening in range(2):  # not listed by a close that wrote nothing: the next close lists it
        with DiskTier(tmp_path) as tier:
            report = tier.open_report
            assert report["listed"] == report["segments"] - 1 + opening


def test_a_segment_with_damage_inside_is_not_listed_and_not_asked_for_again(tmp_path,
                                                                            make_block):
    """Records that do not run end to end (damage skipped in the middle of a segment) are
    never listed; the first writable close writes the manifest again, later ones do not."""
    keys = [_key(start=16 * i, end=16 * i + 16) for i in range(4)]
    with DiskTier(tmp_path) as tier:
        for key in keys:
            tier.put(key, make_block(key))
        loc = tier._files.index.live[keys[1]]
    segment = tmp_path / f"seg-{loc.segment:06d}.tkv"
    data = bytearray(segment.read_bytes())
    data[loc.offset + 10] ^= 0xFF  # a header field: that record is dropped, the rest kept
    segment.write_bytes(bytes(data))
    written = []
    for _ in range(3):
        before = (tmp_path / MANIFEST).stat().st_ino
        with DiskTier(tmp_path) as tier:
            assert tier.open_report["dropped"] and tier.open_report["listed"] == 0
            assert len(tier) == 3
        written.append((tmp_path / MANIFEST).stat().st_ino != before)  # replaced by a rename
    assert written == [True, False, False]


def _fsyncs(monkeypatch) -> list[str]:
    """The names of the files ``os.fsync`` is called on from now on."""
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)
    monkeypatch.setattr(os, "fsync", spy)
    return synced


def _segments(path) -> list[str]:
    return sorted(p.name for p in path.glob("seg-*.tkv"))


def test_a_flush_syncs_every_segment_the_manifest_then_lists(tmp_path, make_block,
                                                             monkeypatch):
    """Segments filled before the one being written, those another process appended to and
    one whose torn tail an opening cut are fsynced before the manifest lists them."""
    keys = [_key(start=16 * i, end=16 * i + 16) for i in range(12)]
    tier = DiskTier(tmp_path, segment_size=4096)
    for key in keys[:6]:
        tier.put(key, make_block(key))
    synced = _fsyncs(monkeypatch)
    tier.flush()
    assert len(_segments(tmp_path)) > 2 and set(_segments(tmp_path)) <= set(synced)
    synced.clear()
    tier.close()  # nothing appended since: no segment synced again
    assert not [name for name in synced if name.startswith("seg-")]

    before = {p.name: p.stat().st_size for p in tmp_path.glob("seg-*.tkv")}
    other = DiskTier(tmp_path, segment_size=4096)  # another process's appends, not flushed
    for key in keys[6:]:
        other.put(key, make_block(key))
    theirs = {p.name for p in tmp_path.glob("seg-*.tkv") if p.stat().st_size != before.get(p.name)}
    assert theirs and set(before) - theirs  # segments it appended to, and others it did not
    synced.clear()
    with DiskTier(tmp_path, segment_size=1 << 20) as tier:
        tier.put(_key("mine"), make_block(_key("mine")))
    assert theirs - {_segments(tmp_path)[-1]} <= set(synced)
    other.close()

    last = tmp_path / _segments(tmp_path)[-1]
    with open(last, "ab") as f:
        f.write(b"TKVR\x02")  # an append torn by a crash
    synced.clear()
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["truncated"] == {last.name: 5}
    assert last.name in synced


def test_compaction_syncs_the_segments_it_copied_to_not_those_it_deletes(tmp_path, make_block,
                                                                       monkeypatch):
    keys = [_key(start=16 * i, end=16 * i + 16) for i in range(12)]
    with DiskTier(tmp_path, segment_size=16384) as tier:  # three records a segment
        for key in keys:
            tier.put(key, make_block(key))
        for key in keys[1:3] + keys[4:6] + keys[7:9]:
            tier.remove(key)
        before = set(_segments(tmp_path))
        synced = _fsyncs(monkeypatch)
        deleted, compacted = tier.reclaim(0.5)
        gone = before - set(_segments(tmp_path))
        assert compacted >= 2 and len(gone) == deleted + compacted
        assert not gone & set(synced)
        assert set(_segments(tmp_path)) - before <= set(synced)  # the copies' segments
        assert set(tier.keys()) == set(keys[::3]) | set(keys[10:])


def test_the_listing_is_used_only_for_segments_unchanged_since(tmp_path, make_block,
                                                                blocks_equal):
    """A segment whose time changed is read (its headers); one a record was appended to since
    the manifest was written makes the manifest disagree with the records: then every record
    of the segments it does not list as they are is read and crc-checked (a writer that died
    after appending changed only those)."""
    want = _fill(tmp_path, make_block)
    touched = sorted(tmp_path.glob("seg-*.tkv"))[1]
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1))
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["listed"] == tier.open_report["segments"] - 1
        assert tier.open_report["checked"].startswith("headers")
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
    writer = DiskTier(tmp_path, segment_size=1 << 20)
    extra = _key("d0", 0, 10_000, 10_016)
    writer.put(extra, make_block(extra))  # appended after the manifest was written
    with DiskTier(tmp_path) as tier:
        report = tier.open_report
        assert report["listed"] == report["segments"] - 1  # all but the one appended to
        assert report["checked"].startswith("every record but") and report["manifest"] == "ok"
        assert blocks_equal(tier.get(extra), make_block(extra))
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
    writer.close()


def test_after_a_writer_died_only_the_segments_it_changed_are_read_in_full(tmp_path,
                                                                          make_block,
                                                                          blocks_equal):
    """A writer that died after appending a new copy of a record whose payload never reached
    the disk (zeros where it should be): the opening reads that segment in full and drops the
    copy, so the older copy stays live, and takes the others from the listing."""
    want = _fill(tmp_path, make_block)
    victim = next(iter(want))
    writer = DiskTier(tmp_path, segment_size=1 << 20)
    other = make_block(_key("x", 0, 0, victim.end - victim.start))
    writer.put(victim, other)
    loc = writer._files.index.live[victim]
    with open(tmp_path / f"seg-{loc.segment:06d}.tkv", "r+b") as f:
        f.seek(loc.offset + loc.header.payload_at)
        f.write(bytes(loc.length - loc.header.payload_at))
    with DiskTier(tmp_path) as tier:
        report = tier.open_report
        assert report["listed"] == report["segments"] - 1
        assert report["dropped"] and report["checked"].startswith("every record but")
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
    with DiskTier(tmp_path) as tier:  # the manifest written at close lists them all again
        assert tier.open_report["listed"] == tier.open_report["segments"]
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
    writer._files.close()  # died: no manifest of its own


def test_a_header_damaged_in_place_is_found_when_its_record_is_read(tmp_path, make_block,
                                                                     blocks_equal):
    want = _fill(tmp_path, make_block)
    with DiskTier(tmp_path) as tier:
        victim, loc = next((k, loc) for k, loc in tier._files.index.live.items())
    segment = tmp_path / f"seg-{loc.segment:06d}.tkv"
    st = segment.stat()
    data = bytearray(segment.read_bytes())
    data[loc.offset + HEADER.size - 8] ^= 0x01  # a reserved byte of its header
    segment.write_bytes(bytes(data))
    os.utime(segment, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and time as listed
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["listed"] == tier.open_report["segments"]
        with pytest.raises(CorruptRecordError, match="crc32"):
            tier.get(victim)
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items() if k != victim)


def _rewrite_listing(path, change):
    """The manifest again with ``change(tensors, info)`` applied to its listing (crc32 kept
    valid: what a build with another idea of the listing would write)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        manifest = read_manifest(fd)
    finally:
        os.close(fd)
    assert manifest.listing is not None
    from safetensors.torch import load_file
    tensors = {n[len(PREFIX):]: t for n, t in load_file(path / MANIFEST).items()
               if n.startswith(PREFIX)}
    docs = list(manifest.listing._docs)
    listing = change(tensors, docs)
    data = encode_manifest(manifest.index, manifest.docs, manifest.meta, manifest.arrays,
                           None if listing is None else
                           ({PREFIX + n: t for n, t in listing[0].items()}, listing[1]))
    (path / MANIFEST).write_bytes(data)


def _shift_offsets(tensors, docs):
    tensors["offset"] = tensors["offset"] + 64
    return tensors, docs


def _wrong_lengths(tensors, docs):
    tensors["stored_len"] = tensors["stored_len"] + 1
    return tensors, docs


def _tombstone_with_a_payload(tensors, docs):  # a row the index snapshot does not cross-check
    tensors["raw_len"] = torch.where(tensors["kind"] != 0, 8, tensors["raw_len"])
    return tensors, docs


def _bad_doc_name(tensors, docs):
    return tensors, [".bad"] + docs[1:]


def _newer_records(tensors, docs):
    tensors["version"] = tensors["version"] + 5
    return tensors, docs


def _short_column(tensors, docs):
    tensors["crc"] = tensors["crc"][1:]
    return tensors, docs


@pytest.mark.parametrize("change", [_shift_offsets, _wrong_lengths, _tombstone_with_a_payload,
                                    _bad_doc_name, _newer_records, _short_column,
                                    lambda tensors, docs: None])
def test_a_listing_that_does_not_check_out_is_not_used(tmp_path, make_block, blocks_equal,
                                                       change):
    """Offsets or lengths that do not chain, fields out of range, a malformed or missing
    listing (a manifest written before listings): the headers of each segment it would have
    given are read, the index is the one a scan builds, and a writable close lists them all
    again."""
    want = _fill(tmp_path, make_block)
    with DiskTier(tmp_path) as tier:
        clean = _index(tier)
    _rewrite_listing(tmp_path, change)
    with DiskTier(tmp_path) as tier:
        report = tier.open_report  # the segments whose rows check out are still listed
        assert report["listed"] < report["segments"] and report["manifest"] == "ok"
        assert _index(tier) == clean
        assert all(blocks_equal(tier.get(k), b) for k, b in want.items())
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["listed"] == tier.open_report["segments"]
        assert _index(tier) == clean


def test_a_reopened_document_opens_its_directory_once(tmp_path, monkeypatch):
    """``TieredCache.open`` reads the document's metadata from the disk tier the cache then
    keeps (the directory opened and its manifest read once), and the document goes on as the
    cache that saved it would."""
    model, where = tiny(), tmp_path / "saved"
    config = TierConfig(device_budget="1MB", host_budget="16KB", disk_dir=where)
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        model(ids(300, seed=1), **cache_kwargs(model, cache), use_cache=True)
        cache.save(where)
        live = model(ids(3, seed=4), **cache_kwargs(model, cache), use_cache=True).logits
    opened = []
    real = disk_module.DiskTier._open
    monkeypatch.setattr(disk_module.DiskTier, "_open",
                        lambda self: opened.append(self.path) or real(self))
    with TieredCache.open(model, where) as reopened, torch.no_grad():
        report = reopened.store.disk.open_report
        assert opened == [where] and report["listed"] == report["segments"] > 0
        again = model(ids(3, seed=4), **cache_kwargs(model, reopened), use_cache=True).logits
    assert torch.equal(live, again)
