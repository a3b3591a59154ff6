"""The disk tier: format round trips, reopen, latest-wins, deletion, compaction, budget."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from tierkv.config import CodecConfig
from tierkv.storage import CorruptRecordError, DiskTier, DocInUseError, RecordKey, StorageError, \
    TierFullError
from tierkv.storage.manifest import MANIFEST
from tierkv.storage.segment import parse_header

LOSSY = CodecConfig(codec="auto", allow_lossy=True)


def _key(doc="doc", group=0, start=0, end=16):
    return RecordKey(doc, group, start, end)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", ["raw", "zstd", "int8", "int4"])
def test_every_codec_round_trips_through_disk(tmp_path, make_block, blocks_equal, codec, dtype):
    key = _key(end=64)
    block = make_block(key, head_dim=64, dtype=dtype)
    with DiskTier(tmp_path, codec=LOSSY) as tier:
        tier.put(key, block, codec=codec)
    with DiskTier(tmp_path, codec=LOSSY) as tier:
        got = tier.get(key)
        assert tier.codec_of(key) == codec
    if codec in ("raw", "zstd"):
        assert blocks_equal(got, block)
    else:
        assert got.keys.dtype == dtype and got.keys.shape == block.keys.shape
        tol = 0.1 if codec == "int8" else 0.6
        assert (got.keys.float() - block.keys.float()).abs().max() < tol


def test_clean_directory_opens_from_headers_and_reads_still_check_crcs(tmp_path, make_block):
    keys = [_key(start=16 * i, end=16 * i + 16) for i in range(8)]
    with DiskTier(tmp_path) as tier:
        for key in keys:
            tier.put(key, make_block(key))
    segment = next(tmp_path.glob("seg-*.tkv"))
    data = bytearray(segment.read_bytes())
    data[parse_header(data).payload_at + 5] ^= 0x10  # the first record's payload
    segment.write_bytes(bytes(data))
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["checked"].startswith("headers") and len(tier) == 8
        with pytest.raises(CorruptRecordError):
            tier.get(keys[0])
        assert tier.get(keys[1]) is not None


def test_records_the_manifest_does_not_list_are_checked_in_full(tmp_path, make_block):
    with DiskTier(tmp_path) as tier:
        tier.put(_key(), make_block(_key()))
    writer = DiskTier(tmp_path)
    writer.put(_key(start=16, end=32), make_block(_key(start=16, end=32)))  # no manifest update
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["checked"] == "every record" and len(tier) == 2
    writer.close()


def test_lossy_codec_needs_allow_lossy(tmp_path, make_block):
    with DiskTier(tmp_path) as tier, pytest.raises(ValueError, match="lossy"):
        tier.put(_key(), make_block(_key()), codec="int4")


def test_reopen_rebuilds_index_and_manifest(tmp_path, make_block, blocks_equal):
    keys = [_key(f"d{i % 3}", i % 2, 16 * i, 16 * i + 16) for i in range(30)]
    with DiskTier(tmp_path, segment_size=8192) as tier:
        for key in keys:
            tier.put(key, make_block(key))
        tier.set_doc_meta("d1", {"tokens": 480, "name": "x"}, {"kmin": torch.arange(6.0)})
    with DiskTier(tmp_path, segment_size=8192) as tier:
        assert tier.open_report["manifest"] == "ok" and tier.open_report["records"] == 30
        assert tier.open_report["segments"] > 1 and not tier.open_report["dropped"]
        assert sorted(tier.keys()) == sorted(keys) and tier.docs() == ["d0", "d1", "d2"]
        meta, arrays = tier.doc_meta("d1")
        assert meta == {"tokens": 480, "name": "x"}
        assert torch.equal(arrays["kmin"], torch.arange(6.0))
        assert all(blocks_equal(b, make_block(k)) for k, b in zip(keys, tier.get_many(keys)))
        assert all(entry["ok"] for entry in tier.check())


def test_reopen_without_manifest_keeps_records(tmp_path, make_block):
    with DiskTier(tmp_path) as tier:
        tier.put(_key(), make_block(_key()))
    os.unlink(tmp_path / MANIFEST)
    with DiskTier(tmp_path) as tier:
        assert tier.open_report["manifest"] == "missing" and tier.keys() == [_key()]


def test_latest_put_wins_and_remove_survives_reopen(tmp_path, make_block, blocks_equal):
    a, b = _key("a"), _key("b")
    with DiskTier(tmp_path) as tier:
        tier.put(a, make_block(b))
        tier.put(a, make_block(a))
        tier.put(b, make_block(b))
        assert tier.remove(b) > 0 and b not in tier
    with DiskTier(tmp_path) as tier:
        assert tier.keys() == [a] and blocks_equal(tier.get(a), make_block(a))
        with pytest.raises(KeyError):
            tier.get(b)


def test_delete_doc_reclaims_and_compacts(tmp_path, make_block, blocks_equal):
    keep = [_key("keep", 0, 16 * i, 16 * i + 16) for i in range(4)]
    drop = [_key("drop", 0, 16 * i, 16 * i + 16) for i in range(40)]
    with DiskTier(tmp_path, segment_size=16384, codec=CodecConfig("raw")) as tier:
        for i, key in enumerate(drop):
            tier.put(key, make_block(key))
            if i % 10 == 0:
                tier.put(keep[i // 10], make_block(keep[i // 10]))
        before = sum(p.stat().st_size for p in tmp_path.glob("seg-*.tkv"))
        tier.set_doc_meta("drop", {"x": 1}, {})
        deleted, compacted = tier.delete_doc("drop")
        after = sum(p.stat().st_size for p in tmp_path.glob("seg-*.tkv"))
        assert deleted + compacted > 0 and after < before / 4
        assert sorted(tier.keys()) == sorted(keep) and tier.docs() == ["keep"]
    with DiskTier(tmp_path) as tier:
        assert sorted(tier.keys()) == sorted(keep) and tier.docs() == ["keep"]
        assert all(blocks_equal(tier.get(k), make_block(k)) for k in keep)
        tier.put(drop[0], make_block(drop[0]))  # the name can be used again
    with DiskTier(tmp_path) as tier:
        assert sorted(tier.keys()) == sorted(keep + drop[:1])


def test_a_document_is_held_by_one_tier_at_a_time(tmp_path, make_block):
    """Two tiers on one directory (as two processes would be): a document one holds, the other
    can neither hold nor delete, until it is released or its tier closes; the lock file goes
    with the claim, and the error names the holder."""
    key = _key("shared")
    with DiskTier(tmp_path) as a, DiskTier(tmp_path) as b:
        a.hold_doc("shared")
        a.put(key, make_block(key))
        assert (tmp_path / "tierkv.doc-shared.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(DocInUseError, match=f"'shared' is in use by a live cache of process "
                                                f"{os.getpid()} \\(this one\\)") as info:
            b.hold_doc("shared")
        assert info.value.doc == "shared" and info.value.holder == os.getpid()
        with pytest.raises(DocInUseError):
            a.hold_doc("shared")  # twice by one tier: a claim is one cache's
        with pytest.raises(DocInUseError):
            b.delete_doc("shared")
        b.refresh()
        assert key in b  # the refused delete changed nothing
        b.hold_doc("other")
        a.release_doc("shared")
        assert not (tmp_path / "tierkv.doc-shared.lock").exists()
        b.hold_doc("shared")
        b.delete_doc("shared")  # its own claim does not stand in the way
        a.refresh()
        assert key not in a
    assert sorted(p.name for p in tmp_path.glob("tierkv.doc-*")) == []  # closing released all
    with DiskTier(tmp_path) as c:
        c.hold_doc("other")
    with DiskTier(tmp_path, read_only=True) as ro, pytest.raises(StorageError, match="read-only"):
        ro.hold_doc("x")


def test_refresh_takes_in_documents_saved_or_deleted_elsewhere(tmp_path, make_block):
    """A tier open for long (another process's) sees, on refresh, a document saved since
    without a single record, and the deletion of one it had read; closing it then keeps what
    the others left in the manifest."""
    key = _key("gone")
    with DiskTier(tmp_path) as writer:
        writer.put(key, make_block(key))
        writer.set_doc_meta("gone", {"n": 1}, {})
    with DiskTier(tmp_path) as old:
        assert old.saved_docs() == ["gone"]
        with DiskTier(tmp_path) as other:
            other.set_doc_meta("empty", {"n": 2}, {"x": torch.arange(3)})
            other.delete_doc("gone")
        assert old.saved_docs() == ["gone"]
        old.refresh()
        assert old.saved_docs() == ["empty"] and key not in old
        assert torch.equal(old.doc_meta("empty")[1]["x"], torch.arange(3))
        old.set_doc_meta("mine", {"n": 3}, {})
    with DiskTier(tmp_path) as after:
        assert after.saved_docs() == ["empty", "mine"]


def test_delete_doc_is_in_the_manifest_before_the_tier_closes(tmp_path, make_block):
    """delete_doc writes the manifest at once: the deletion holds whatever happens to its tier
    next, and a later save of the same id by another tier survives that tier closing."""
    key = _key("doc0")
    with DiskTier(tmp_path) as tier:
        tier.put(key, make_block(key))
        tier.set_doc_meta("doc0", {"v": 1}, {})
    deleter = DiskTier(tmp_path)
    deleter.delete_doc("doc0")
    with DiskTier(tmp_path) as fresh:
        assert fresh.docs() == []
        fresh.put(key, make_block(key))
        fresh.set_doc_meta("doc0", {"v": 2}, {})
    deleter.close()
    with DiskTier(tmp_path) as tier:
        assert tier.doc_meta("doc0")[0] == {"v": 2} and key in tier


def test_a_corrupt_record_is_named_with_its_place(tmp_path, make_block):
    key = _key("doc", 0, 0, 16)
    with DiskTier(tmp_path, codec=CodecConfig("raw")) as tier:
        tier.put(key, make_block(key))
    segment = tmp_path / "seg-000001.tkv"
    data = bytearray(segment.read_bytes())
    data[-5] ^= 0xFF  # a payload byte of the only record
    segment.write_bytes(bytes(data))
    with DiskTier(tmp_path) as tier, pytest.raises(
            CorruptRecordError, match=r"record RecordKey\(doc='doc', group=0, start=0, end=16\) at "
                                      r"seg-000001\.tkv:\d+: record crc32 mismatch"):
        tier.get(key)


def test_read_raw_many_then_decode(tmp_path, make_block, blocks_equal):
    keys = [_key("d", g, 0, 8 + g) for g in range(6)]
    with DiskTier(tmp_path, io_threads=3) as tier:
        for key in keys:
            tier.put(key, make_block(key), codec="raw" if key.group % 2 else "zstd")
        raws = tier.read_raw_many(keys[::-1])
        assert [r.key for r in raws] == keys[::-1]
        assert raws[0].shape == (2, 2, 13, 8) and raws[0].dtype == torch.float32
        assert all(blocks_equal(tier.decode(r), make_block(r.key)) for r in raws)
        assert tier.bytes_read > 0 and tier.bytes_written >= tier.used
        with pytest.raises(KeyError):
            tier.read_raw_many([_key("nope")])


def test_async_api(tmp_path, make_block, blocks_equal):
    async def main(tier):
        await asyncio.gather(*(tier.aput(_key(end=e), make_block(_key(end=e)))
                               for e in range(1, 9)))
        return await asyncio.gather(*(tier.aget(_key(end=e)) for e in range(1, 9)))
    with DiskTier(tmp_path) as tier:
        got = asyncio.run(main(tier))
    assert all(blocks_equal(b, make_block(_key(end=e))) for e, b in zip(range(1, 9), got))


def test_disk_budget(tmp_path, make_block):
    with DiskTier(tmp_path, budget=3000, codec=CodecConfig("raw")) as tier:
        tier.put(_key(end=8), make_block(_key(end=8)))
        with pytest.raises(TierFullError):
            tier.put(_key(end=9), make_block(_key(end=9)))
        assert tier.used <= 3000 and len(tier) == 1
