"""KVStore: host first, coldest spill to disk, budgets, fetch, removal."""
from __future__ import annotations

import collections
import os
import random
import threading

import pytest
import torch

from tierkv.config import CodecConfig, TierConfig
from tierkv.shapes import KVShape
from tierkv.storage import KVStore, RecordKey, StorageError, TierFullError
from tierkv.storage.ranking import Ranking

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=8)
BLOCK = 2 * 2 * 2 * 16 * 8 * 4  # bytes of a 16-token block


def _store(tmp_path, host=4 * BLOCK, disk=True, **kw):
    cfg = TierConfig(device_budget="1MB", host_budget=host, device="cpu",
                     disk_dir=tmp_path / "kv" if disk else None, **kw)
    return KVStore(SHAPE, cfg)


def _key(i, doc="doc"):
    return RecordKey(doc, 0, 16 * i, 16 * i + 16)


def test_coldest_spill_first(tmp_path, make_block, blocks_equal):
    with _store(tmp_path) as store:
        for i, imp in enumerate([5.0, 1.0, 3.0, 0.5]):
            store.put(_key(i), make_block(_key(i)), importance=imp)
        store.put(_key(4), make_block(_key(4)), importance=9.0)
        assert store.where(_key(3)) == "disk"
        store.set_importance(_key(0), -1.0)
        store.put(_key(5), make_block(_key(5)), importance=9.0)
        assert store.where(_key(0)) == "disk" and store.where(_key(1)) == "host"
        assert all(blocks_equal(store.get(_key(i)), make_block(_key(i))) for i in range(6))
        stats = store.stats()
        assert stats["host_records"] == 4 and stats["disk_records"] == 2
        assert stats["disk_bytes_written"] > 0 and stats["host_bytes"] <= 4 * BLOCK


def test_promote_keeps_hot_disk_records_on_host_without_rewriting_them(tmp_path, make_block,
                                                                        blocks_equal):
    with _store(tmp_path, codec=CodecConfig(codec="raw")) as store:
        for i, imp in enumerate([5.0, 1.0, 3.0, 0.5, 9.0, 9.0]):
            store.put(_key(i), make_block(_key(i)), importance=imp)
        assert store.where(_key(3)) == "disk" and store.where(_key(1)) == "disk"
        written = store.stats()["disk_bytes_written"]
        assert store.promote(_key(3), store.get(_key(3)), importance=4.0)  # evicts key 2 (3.0)
        assert store.where(_key(3)) == "host" and store.where(_key(2)) == "disk"
        assert not store.promote(_key(1), store.get(_key(1)), importance=2.0)  # all hotter
        assert store.where(_key(1)) == "disk"
        assert store.promote(_key(1), store.get(_key(1)), importance=6.0)  # evicts key 3: clean
        assert store.where(_key(3)) == "disk"
        assert store.stats()["disk_bytes_written"] == written * 3 // 2  # key 2 only (1 + 3 before)
        store.put(_key(1), make_block(_key(7)), importance=0.0)  # new data: no longer clean
        store.put(_key(8), make_block(_key(8)), importance=9.0)
        assert store.where(_key(1)) == "disk"
        assert blocks_equal(store.get(_key(1)), make_block(_key(7)))
        assert all(blocks_equal(store.get(_key(i)), make_block(_key(i))) for i in (0, 2, 3, 4, 5))
        assert store.stats()["host_bytes"] <= 4 * BLOCK


def test_ties_spill_oldest(tmp_path, make_block):
    with _store(tmp_path) as store:
        for i in range(6):
            store.put(_key(i), make_block(_key(i)))
        assert [store.where(_key(i)) for i in range(6)] == ["disk"] * 2 + ["host"] * 4


def test_a_new_record_colder_than_the_host_goes_to_disk_itself(tmp_path, make_block, blocks_equal):
    """A full host keeps its records when a less important one arrives (a prompt's records,
    ranked by how much its last queries attended them, arrive in position order)."""
    with _store(tmp_path) as store:
        for i, imp in enumerate([0.4, 0.3, 0.5, 0.2]):
            store.put(_key(i), make_block(_key(i)), importance=imp)
        store.put(_key(4), make_block(_key(4)), importance=0.1)
        assert store.where(_key(4)) == "disk"
        assert [store.where(_key(i)) for i in range(4)] == ["host"] * 4
        store.put(_key(5), make_block(_key(5)), importance=0.2)  # a tie: the older one spills
        assert store.where(_key(3)) == "disk" and store.where(_key(5)) == "host"
        store.put(_key(2), make_block(_key(6)), importance=0.0)  # held: rewritten in place
        assert store.where(_key(2)) == "host"
        assert all(blocks_equal(store.get(_key(i)), make_block(_key(i))) for i in (0, 1, 3, 4, 5))
        assert blocks_equal(store.get(_key(2)), make_block(_key(6)))


def test_no_disk_full_loses_nothing(tmp_path, make_block, blocks_equal):
    with _store(tmp_path, disk=False) as store:
        for i in range(4):
            store.put(_key(i), make_block(_key(i)))
        with pytest.raises(TierFullError):
            store.put(_key(4), make_block(_key(4)))
        assert store.where(_key(4)) is None
        assert all(blocks_equal(store.get(_key(i)), make_block(_key(i))) for i in range(4))


def test_oversized_record_goes_to_disk(tmp_path, make_block, blocks_equal):
    with _store(tmp_path, host=BLOCK // 2) as store:
        store.put(_key(0), make_block(_key(0)))
        assert store.where(_key(0)) == "disk"
        assert blocks_equal(store.get(_key(0)), make_block(_key(0)))


@pytest.mark.parametrize("seed", range(3))
def test_budgets_hold_under_random_ops(tmp_path, make_block, blocks_equal, seed):
    rng = random.Random(seed)
    live = set()
    with _store(tmp_path, host=3 * BLOCK + 100, disk_budget=40 * BLOCK) as store:
        for _ in range(150):
            key = RecordKey(f"d{rng.randrange(2)}", rng.randrange(2), 0, rng.randrange(1, 24))
            op = rng.random()
            if op < 0.6:
                store.put(key, make_block(key), importance=rng.random())
                live.add(key)
            elif op < 0.8:
                store.remove(key)
                live.discard(key)
            elif live:
                probe = rng.choice(sorted(live))
                assert blocks_equal(store.get(probe), make_block(probe))
            assert store.host.used <= store.host.budget
            assert store.disk.used <= store.disk.budget
        assert {k for k in live if store.where(k)} == live
        got = store.fetch(sorted(live), "cpu")
        assert all(blocks_equal(b, make_block(k)) for k, b in zip(sorted(live), got))


def test_fetch_mixed_tiers(tmp_path, make_block, blocks_equal):
    with _store(tmp_path, host=2 * BLOCK) as store:
        keys = [_key(i) for i in range(5)]
        for key in keys:
            store.put(key, make_block(key))
        store.device.put(keys[4], make_block(keys[4]))
        assert store.where(keys[4]) == "device" and store.where(keys[0]) == "disk"
        got = store.fetch(keys[::-1], torch.device("cpu"))
        assert all(blocks_equal(b, make_block(k)) for k, b in zip(keys[::-1], got))
        with pytest.raises(KeyError):
            store.fetch([_key(9)], "cpu")


def test_remove_and_delete_doc(tmp_path, make_block):
    with _store(tmp_path, host=2 * BLOCK) as store:
        for i in range(4):
            store.put(_key(i, "a"), make_block(_key(i, "a")))
            store.put(_key(i, "b"), make_block(_key(i, "b")))
        assert store.remove(_key(0, "b")) and not store.remove(_key(0, "b"))
        store.delete_doc("a")
        assert all(store.where(_key(i, "a")) is None for i in range(4))
        assert [store.where(_key(i, "b")) for i in range(4)].count(None) == 1
        with pytest.raises(KeyError):
            store.set_importance(_key(0, "a"), 1.0)
    with _store(tmp_path, host=2 * BLOCK) as store:
        assert {k.doc for k in store.disk.keys()} == {"b"} and "a" not in store.disk.docs()


def test_codec_choice_reaches_disk(tmp_path, make_block):
    with _store(tmp_path, host=BLOCK, codec=CodecConfig("raw")) as store:
        store.put(_key(0), make_block(_key(0)), codec="zstd")
        store.put(_key(1), make_block(_key(1)))
        assert store.disk.codec_of(_key(0)) == "zstd"


def test_shape_validation(tmp_path, make_block):
    with _store(tmp_path) as store:
        for bad in (dict(kv_heads=3), dict(head_dim=4), dict(layers=3), dict(dtype=torch.float16)):
            with pytest.raises(ValueError, match="KVShape"):
                store.put(_key(0), make_block(_key(0), **bad))
        with pytest.raises(ValueError, match="tokens"):
            store.put(_key(0), make_block(RecordKey("x", 0, 0, 3)))


def test_ranking_cold_share_counts_ties_as_hot():
    ranks = Ranking()
    keys = [_key(i) for i in range(4)]
    for key in keys:
        ranks.set(key, 0.0)
    assert not any(ranks.is_cold(k, 0.5) for k in keys)      # nobody ranked them: none cold
    assert all(ranks.is_cold(k, 1.0) for k in keys)
    for key, importance in zip(keys, [3.0, 0.5, 2.0, 1.0]):
        ranks.set(key, importance)
    assert [ranks.is_cold(k, 0.5) for k in keys] == [False, True, False, True]
    assert not any(ranks.is_cold(k, 0.0) for k in keys)
    ranks.discard(keys[1])                                     # 1.0 is now the lowest of three
    assert [ranks.is_cold(k, 0.5) for k in keys] == [False, False, False, True]
    assert ranks.coldest(set(keys), exclude=keys[3]) == keys[2]
    assert ranks.coldest(set(), exclude=keys[3]) is None



def test_ranking_re_ranked_every_step_keeps_its_heap_small_and_its_order():
    """Decode re-ranks the records it reads every step: the stale heap entries that leaves are
    dropped, and the coldest is still the least recently ranked."""
    ranks = Ranking()
    keys = [_key(i) for i in range(8)]
    for step in range(2000):
        for i, key in enumerate(keys):
            if i != 5 or step < 10:  # key 5 was last read at step 9
                ranks.set(key, float(step))
    assert len(ranks._heap) <= 2 * len(keys) + 1024
    assert ranks.coldest(set(keys), exclude=None) == keys[5]
    assert keys[0] in ranks.keys() and _key(99) not in ranks.keys()


def test_ranking_raise_many_ranks_as_raise_to_one_by_one():
    one, many = Ranking(), Ranking()
    keys = [_key(i) for i in range(40)]
    rng = random.Random(3)
    for ranks in (one, many):
        for i, key in enumerate(keys):
            ranks.set(key, float(i % 5))
    for step in range(5, 60):
        pairs = [(key, float(rng.choice([0, 2, step, step]))) for key in rng.sample(keys, 12)]
        pairs.append((_key(99), float(step)))  # unranked: stays so
        for key, importance in pairs:
            one.raise_to(key, importance)
        many.raise_many(pairs)
    assert {k: one.importance(k) for k in keys} == {k: many.importance(k) for k in keys}
    assert _key(99) not in many.keys()
    counted = collections.Counter(many.importance(k) for k in many.keys())
    assert many._count == dict(counted) and many._levels == sorted(counted)
    for fraction in (0.1, 0.5):
        assert [one.is_cold(k, fraction) for k in keys] == [many.is_cold(k, fraction) for k in keys]
    assert one.coldest(set(keys), exclude=None) == many.coldest(set(keys), exclude=None)


def test_locate_finds_each_record_in_its_fastest_tier(tmp_path, make_block, blocks_equal):
    with _store(tmp_path) as store:
        for i in range(6):  # the host holds four: two spill
            store.put(_key(i), make_block(_key(i)), importance=float(i))
        store.device.put(_key(5), make_block(_key(5)))
        keys = [_key(5), _key(0), _key(3), _key(7), _key(1)]
        found = store.locate(keys)
        assert [where for _, where in found] == [store.where(k) for k in keys]
        assert [where for _, where in found] == ["device", "disk", "host", None, "disk"]
        assert blocks_equal(found[0][0], store.device.get(_key(5)))
        assert found[2][0].keys is store.host.get(_key(3)).keys  # the stored tensors, no copy
        assert found[1][0] is None and found[3][0] is None
    with pytest.raises(StorageError, match="closed"):
        store.locate([_key(0)])


def test_touch_raises_ranks_never_lowers_them_and_waits_for_a_busy_store(tmp_path, make_block):
    """A read ranks a record at least as hot as the read: a pinned record stays pinned and a read
    without an importance (0) keeps the caller's; a read while the store is busy ranks once the
    next decision needs it, and the reading thread does not wait."""
    with _store(tmp_path) as store:
        for i, imp in enumerate([2.0 ** 60, 2.0 ** 60, 5.0, 1.0]):
            store.put(_key(i), make_block(_key(i)), importance=imp)
        store.touch([(_key(0), 7.0), (_key(2), 0.0), (_key(3), 6.0), (_key(9), 8.0)])
        assert [store._ranks.importance(_key(i)) for i in range(4)] == [2.0 ** 60, 2.0 ** 60, 5.0, 6.0]
        assert _key(9) not in store._ranks.keys()                # no tier holds it: skipped
        held, release = threading.Event(), threading.Event()

        def busy():  # e.g. the main thread spilling to disk under the store's lock
            with store._lock:
                held.set()
                release.wait(5)
        worker = threading.Thread(target=busy)
        worker.start()
        held.wait(5)
        store.touch([(_key(2), 9.0)])                            # returns at once
        assert store._ranks.importance(_key(2)) == 5.0
        release.set()
        worker.join()
        store.put(_key(4), make_block(_key(4)), importance=8.0)  # the spill ranks it first
        assert store.where(_key(2)) == "host" and store.where(_key(3)) == "disk"

def test_inputs_of_the_wrong_kind_are_named(tmp_path, make_block):
    from tierkv.storage import KVBlock, StorageError

    block = make_block(_key(0))
    with _store(tmp_path) as store:
        for bad, message in [((block.keys, block.values), "expected a KVBlock"),
                             (None, "expected a KVBlock"),
                             (KVBlock(block.keys[:0], block.values[:0]), "at least 1"),
                             (KVBlock(block.keys.to_sparse(), block.values.to_sparse()), "dense"),
                             (KVBlock(block.keys.to("meta"), block.values.to("meta")), "meta")]:
            with pytest.raises(ValueError, match=message):
                store.put(_key(0), bad)
        assert len(store.host) == 0 and not store.disk.keys()  # nothing half-stored
        store.put(_key(0), block)
        with pytest.raises(ValueError, match="is one key; pass a list"):
            store.fetch(_key(0), "cpu")
        with pytest.raises(ValueError, match="not a RecordKey"):
            store.fetch(["doc/0/0-16"], "cpu")
        with pytest.raises(ValueError, match="'gpu' is not a device"):
            store.fetch([_key(0)], "gpu")
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="CUDA is not available"):
                store.fetch([_key(0)], "cuda")
    for call in (lambda: store.where(_key(0)), store.stats, lambda: store.remove(_key(0))):
        with pytest.raises(StorageError, match="closed"):
            call()


def test_non_finite_blocks_never_block_a_spill(tmp_path, make_block, blocks_equal):
    """A block holding NaN goes to the host tier; when it must spill while the codec chosen for
    disk is lossy, it is written losslessly, and a lossy codec named at put refuses it then."""
    nan = make_block(_key(0))
    nan.keys[0, 0, 0, 0] = float("nan")
    lossy = CodecConfig("auto", allow_lossy=True)
    with _store(tmp_path, host=BLOCK, codec=lossy) as store:
        with pytest.raises(ValueError, match="NaN or inf.*int8"):
            store.put(_key(0), nan, codec="int8")
        store.controller = type("Lossy", (), {"choose_for": lambda self, b, cold: "int8"})()
        store.put(_key(0), nan, importance=0.0)
        store.put(_key(1), make_block(_key(1)), importance=5.0)  # spills the NaN block
        assert store.where(_key(0)) == "disk" and store.disk.codec_of(_key(0)) == "zstd"
        back = store.get(_key(0))
        assert torch.isnan(back.keys[0, 0, 0, 0]) and torch.equal(back.values, nan.values)
        store.put(_key(2), make_block(_key(2)), importance=9.0)  # a finite one: int8
        assert store.disk.codec_of(_key(1)) == "int8"
    with _store(tmp_path / "fixed", host=BLOCK,
                codec=CodecConfig("int8", allow_lossy=True)) as store:  # lossy by default
        store.put(_key(0), nan, importance=0.0)
        store.put(_key(1), make_block(_key(1)), importance=5.0)
        assert store.disk.codec_of(_key(0)) == "zstd" and torch.isnan(store.get(_key(0)).keys).any()


def test_record_key_hashes_once_and_pickles_by_value_across_processes():
    """Keys cache their hash (decode hashes thousands a step); a pickled key is hashed anew
    where it is loaded, under that process's string hashing."""
    import pickle
    import subprocess
    import sys

    key = RecordKey("doc", 2, 8, 16)
    assert hash(key) == hash(RecordKey("doc", 2, 8, 16)) and {key: 1}[RecordKey("doc", 2, 8, 16)]
    code = ("import pickle, sys; from tierkv.storage.base import RecordKey; "
            "k = pickle.loads(sys.stdin.buffer.read()); "
            "print({RecordKey('doc', 2, 8, 16): 'found'}.get(k), k == RecordKey('doc', 2, 8, 16))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(key), capture_output=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    assert out.stdout.decode().split() == ["found", "True"]


def test_reopening_with_another_shape_refused(tmp_path, make_block):
    """Records written for one KVShape, read back under another, would come back as blocks of
    the old shape: the store refuses the directory, names both, and leaves it as it was."""
    with _store(tmp_path, host=1) as store:
        store.put(_key(0), make_block(_key(0)))
    other = TierConfig(device_budget="1MB", host_budget=1, device="cpu", disk_dir=tmp_path / "kv")
    for shape in (KVShape(layers=2, kv_heads=4, head_dim=8), KVShape(layers=2, kv_heads=2, head_dim=16),
                  KVShape(layers=1, kv_heads=2, head_dim=8),
                  KVShape(layers=2, kv_heads=2, head_dim=8, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"the records of 'doc' are 2 layers x 2 KV heads x "
                                             r"head_dim 8, torch.float32, which do not fit KVShape"):
            KVStore(shape, other)
    with KVStore(KVShape(layers=3, kv_heads=2, head_dim=8), other) as store:  # more layers: fits
        assert store.where(_key(0)) == "disk"
    with _store(tmp_path, host=1) as store:
        assert torch.equal(store.get(_key(0)).keys, make_block(_key(0)).keys)

