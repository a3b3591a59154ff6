"""DeviceCache: admission and eviction of fetched records in the device tier."""
from __future__ import annotations

import pytest
import torch

from dicttier import DictTier
from tierkv.pipeline import DeviceCache
from tierkv.storage.base import KVBlock, RecordKey


def _blk(key, nbytes):
    half = torch.zeros(nbytes // 4, dtype=torch.float16).view(1, 1, key.tokens, -1)
    return KVBlock(half, half.clone())


def test_device_cache_evicts_by_importance_then_age():
    tier = DictTier("device", 300)
    cache = DeviceCache(tier)
    keys = [RecordKey("d", 0, i, i + 1) for i in range(5)]
    assert cache.admit(keys[0], _blk(keys[0], 100), 1.0)
    assert cache.admit(keys[1], _blk(keys[1], 100), 5.0)
    assert cache.admit(keys[2], _blk(keys[2], 100), 1.0)
    assert cache.get(keys[0]) is not None          # keys[0] is now younger than keys[2]
    assert cache.admit(keys[3], _blk(keys[3], 100), 1.0)      # evicts keys[2]: as important, older
    assert keys[2] not in cache and keys[0] in cache
    assert not cache.admit(keys[4], _blk(keys[4], 300), 2.0)  # would need to evict the 5.0 record
    assert len(cache) == 3 and tier.used == 300
    assert cache.admit(keys[4], _blk(keys[4], 200), 2.0)      # evicts the two 1.0 records
    assert {k for k in keys if k in cache} == {keys[1], keys[4]}
    assert (cache.hits, cache.misses) == (1, 0)
    first = RecordKey("d", 0, 9, 10)                 # priority (first group of a plan) wins
    assert cache.admit(first, _blk(first, 200), 0.0, priority=1)
    assert first in cache and keys[1] in cache and keys[4] not in cache


def test_device_cache_leaves_others_records_and_forgets_removed_ones():
    tier = DictTier("device", 200)
    own = RecordKey("d", 0, 0, 1)
    tier.put(own, _blk(own, 100))                     # the store's own device record
    cache = DeviceCache(tier)
    mine = RecordKey("d", 0, 5, 6)
    assert cache.admit(mine, _blk(mine, 100), 0.0)
    assert not cache.admit(RecordKey("d", 0, 7, 8), _blk(RecordKey("d", 0, 7, 8), 200), 9.0)
    tier.remove(mine)                                 # e.g. KVStore.put rewrote the record
    assert cache.get(mine) is None and len(cache) == 0
    with pytest.raises(ValueError, match="Tier"):
        DeviceCache(object())

def test_device_cache_get_many_is_get_of_each_key():
    from tierkv.storage.device import DeviceTier

    tier = DeviceTier(1 << 20, torch.device("cpu"))
    cache = DeviceCache(tier)
    keys = [RecordKey("d", 0, 8 * i, 8 * i + 8) for i in range(4)]
    assert cache.get_many(keys) == [None] * 4 and cache.misses == 4
    for i in (0, 2):
        cache.admit(keys[i], KVBlock(torch.full((1, 1, 8, 4), float(i)),
                                     torch.zeros(1, 1, 8, 4)), importance=1.0)
    tier.remove(keys[2])                                   # dropped by the store meanwhile
    got = cache.get_many(keys, importance=[5.0, 5.0, 5.0, 5.0], priority=1)
    assert got[0].keys[0, 0, 0, 0] == 0.0 and got[1:] == [None, None, None]
    assert (cache.hits, cache.misses) == (1, 7) and keys[2] not in cache._rank
    assert cache._rank[keys[0]][:2] == (1, 5.0)            # the hit took the read's rank

def test_device_cache_reserve_evicts_cached_records_first():
    from tierkv.storage.base import TierFullError
    from tierkv.storage.device import DeviceTier

    tier = DeviceTier(4096, torch.device("cpu"))
    cache = DeviceCache(tier)
    block = KVBlock(torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 16))  # 1 KiB
    for i in range(3):
        assert cache.admit(RecordKey("d", 0, 8 * i, 8 * i + 8), block, importance=float(i))
    cache.reserve("window", 2048)  # needs one eviction: the least important record goes
    assert tier.used == 4096 and len(cache) == 2
    assert RecordKey("d", 0, 0, 8) not in cache
    with pytest.raises(TierFullError):
        cache.reserve("window", 8192)
    assert tier.reserved_for("window") == 2048


def test_device_cache_stops_admitting_what_is_never_read_again():
    """Records evicted without a hit drive the measured reuse below ``min_reuse``: then only
    one admission in ``probe_every`` copies; hits bring admission back."""
    tier = DictTier("device", 200)
    cache = DeviceCache(tier, min_reuse=0.5, probe_every=4, alpha=0.5)
    keys = iter(RecordKey("d", 0, i, i + 1) for i in range(1000))

    def admit():
        key = next(keys)
        return key, cache.admit(key, _blk(key, 100), 1.0)

    assert all(admit()[1] for _ in range(3))         # the third evicts one never hit
    assert cache.reuse == 0.0
    made = [admit()[1] for _ in range(8)]
    assert made.count(True) == 2 and cache.skipped == 6  # probes only
    for _ in range(8):                                # every admitted record is read again
        key, made = admit()
        if made:
            assert cache.get(key) is not None
    while cache.reuse < 0.5:
        key, made = admit()
        if made:
            cache.get(key)
    assert all(admit()[1] for _ in range(2))         # reuse is back: admitted again
    with pytest.raises(ValueError, match="min_reuse"):
        DeviceCache(tier, min_reuse=1.5)
    with pytest.raises(ValueError, match="probe_every"):
        DeviceCache(tier, probe_every=0)


def test_device_cache_always_admits_by_default():
    tier = DictTier("device", 100)
    cache = DeviceCache(tier)
    for i in range(20):
        key = RecordKey("d", 0, i, i + 1)
        assert cache.admit(key, _blk(key, 100), 1.0)
    assert cache.reuse == 0.0 and cache.skipped == 0


def test_device_cache_touch_many_ranks_what_it_holds_as_a_read_would():
    tier = DictTier("device", 200)
    cache = DeviceCache(tier)
    old, young, absent = (RecordKey("d", 0, i, i + 1) for i in range(3))
    assert cache.admit(old, _blk(old, 100), 1.0) and cache.admit(young, _blk(young, 100), 1.0)
    cache.touch_many([old, absent], [1.0, 7.0])  # a consumer read ``old`` again, kept
    assert (cache.hits, cache.misses) == (1, 0)  # a hit; the absent key is no miss
    newcomer = RecordKey("d", 0, 5, 6)
    assert cache.admit(newcomer, _blk(newcomer, 100), 1.0)  # evicts the older-used ``young``
    assert old in cache and young not in cache and absent not in cache
