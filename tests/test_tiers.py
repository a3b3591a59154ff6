"""Device and host tiers: budgets under random workloads, copies, pinning."""
from __future__ import annotations

import mmap
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import block_for
from tierkv.config import CodecConfig, SelectConfig, TierConfig, parse_size
from tierkv.shapes import KVShape
from tierkv.storage import DeviceTier, HostTier, KVBlock, RecordKey, TierFullError, host


def _random_workload(tier, make_block, seed: int, steps: int = 300) -> None:
    rng = random.Random(seed)
    model = {}
    for _ in range(steps):
        key = RecordKey(f"d{rng.randrange(3)}", rng.randrange(2), 0, rng.randrange(1, 40))
        if rng.random() < 0.7:
            block = make_block(key)
            fits = tier.used - model.get(key, 0) + block.nbytes <= tier.budget
            try:
                tier.put(key, block)
                model[key] = block.nbytes
            except TierFullError:
                assert not fits
        else:
            assert tier.remove(key) == model.pop(key, 0)
        assert tier.used == sum(model.values()) <= tier.budget
        assert set(tier.keys()) == set(model)


@pytest.mark.parametrize("seed", range(4))
def test_device_budget_holds(make_block, seed):
    _random_workload(DeviceTier(20_000, torch.device("cpu")), make_block, seed)


@pytest.mark.parametrize("seed", range(4))
def test_host_budget_holds(make_block, seed):
    _random_workload(HostTier("20KB"), make_block, seed)


def test_host_copies_in(make_block, blocks_equal):
    tier = HostTier(1 << 20)
    key = RecordKey("doc", 0, 0, 4)
    block = make_block(key)
    tier.put(key, block)
    stored = tier.get(key)
    assert blocks_equal(stored, block)
    block.keys.zero_()
    assert stored.keys.data_ptr() != block.keys.data_ptr()
    assert blocks_equal(tier.get(key), make_block(key))


def test_host_pin_auto_and_explicit():
    assert HostTier(1024).pin == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin=True"):
            HostTier(1024, pin=True)
    with pytest.raises(ValueError, match="pin="):
        HostTier(1024, pin="yes")


def test_device_tier_places_blocks(make_block):
    tier = DeviceTier("1MB", "cpu")
    key = RecordKey("doc", 0, 0, 4)
    tier.put(key, make_block(key, dtype=torch.bfloat16))
    assert tier.get(key).keys.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            DeviceTier(1024, "cuda")


def test_full_put_changes_nothing(make_block):
    tier = HostTier(2000)
    small, big = RecordKey("a", 0, 0, 2), RecordKey("a", 0, 0, 64)
    tier.put(small, make_block(small))
    with pytest.raises(TierFullError):
        tier.put(big, make_block(big))
    assert tier.keys() == [small] and tier.used == make_block(small).nbytes


def test_bad_budget_is_named():
    with pytest.raises(ValueError, match="budget"):
        HostTier("lots")


@pytest.mark.parametrize("make, message", [
    (lambda: parse_size("0.1", "host_budget"), "host_budget='0.1': a byte count must be a whole"),
    (lambda: parse_size(1.7, "host_budget"), "whole number"),
    (lambda: parse_size("0.0001KB", "device_budget"), r"device_budget='0.0001KB' is 0.1 bytes: "
                                                       "less than one byte"),
    (lambda: CodecConfig(allow_lossy="no"), "allow_lossy='no': expected True or False"),
    (lambda: SelectConfig(full_after_filter="no"), "full_after_filter='no'"),
    (lambda: SelectConfig(filter_layers=5), "filter_layers=5: expected a sequence"),
    (lambda: TierConfig(direct_io="yes"), "direct_io='yes': expected 'auto', True or False"),
    (lambda: TierConfig(direct_io=1), "direct_io=1: expected 'auto', True or False"),
])
def test_config_values_of_the_wrong_kind(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    assert parse_size("0.5GB") == 500_000_000 and parse_size(2.0) == 2


def test_byte_counts_exact_and_bounded():
    """Whole byte counts are taken exactly (a float would round past 2**53), and one past
    2**62 is refused by name, not by an OverflowError."""
    assert parse_size(2**53 + 1) == 2**53 + 1 == parse_size(str(2**53 + 1))
    for huge in (10**400, 2**62 + 1, -1):
        with pytest.raises(ValueError, match=r"device_budget=.*between 0 and 2\*\*62"):
            TierConfig(device_budget=huge)


@pytest.mark.parametrize("config, message", [
    (SimpleNamespace(num_hidden_layers=2, num_attention_heads=0, hidden_size=64),
     "num_attention_heads=0 and hidden_size=64 give no head_dim"),
    (SimpleNamespace(num_hidden_layers=2, num_attention_heads=4), "has no hidden_size"),
    (SimpleNamespace(num_attention_heads=4, hidden_size=64), "has no num_hidden_layers"),
])
def test_shape_of_a_model_config_that_has_none(config, message):
    with pytest.raises(ValueError, match=message):
        KVShape.from_config(config)
    shape = KVShape(2, 2, 8)
    for bad in ("3", -1, 1.5):
        with pytest.raises(ValueError, match="count >= 0"):
            shape.kv_bytes(bad)
        with pytest.raises(ValueError, match="count >= 0"):
            shape.token_bytes(bad)


@pytest.mark.parametrize("block", [None, (torch.zeros(1, 1, 4, 2),) * 2])
def test_put_of_something_else_than_a_kvblock_named(block):
    with pytest.raises(ValueError, match="expected a KVBlock"):
        HostTier(1000).put(RecordKey("d", 0, 0, 4), block)


@pytest.mark.parametrize("nbytes", [-1, 1.5, "10", None])
def test_reserve_takes_whole_byte_counts(nbytes, make_block):
    """A negative reservation would free room the tier's records then fill past its budget."""
    tier = HostTier(1000)
    with pytest.raises(ValueError, match="byte count"):
        tier.reserve("x", nbytes)
    assert tier.used == 0
    tier.reserve("x", torch.tensor(10))  # an integer tensor is a count
    assert tier.used == 10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers(make_block, blocks_equal):
    key = RecordKey("doc", 0, 0, 4)
    device, host = DeviceTier("1MB", "cuda"), HostTier("1MB")
    host.put(key, make_block(key))
    assert host.get(key).keys.is_pinned()
    device.put(key, host.get(key))
    assert device.get(key).keys.is_cuda and blocks_equal(device.get(key), make_block(key))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_tier_keeps_big_blocks_pinned(blocks_equal):
    """A pinned tier never puts a block in a memory map of its own: a map is pageable memory,
    and a copy from it to the GPU could not run asynchronously."""
    tier = HostTier("8MB")
    key = RecordKey("doc", 0, 0, 64)
    tier.put(key, _big(key))
    assert tier.pin and tier._mapped == set()
    assert tier.get(key).keys.is_pinned() and blocks_equal(tier.get(key), _big(key))


def _big(key: RecordKey) -> KVBlock:
    """A block of 1 MiB: over host.MAPPED_MIN_BYTES."""
    return block_for(key, layers=2, kv_heads=8, head_dim=128)


def test_host_maps_big_blocks(blocks_equal):
    tier = HostTier("8MB", pin=False)  # a pinned tier (the default with CUDA) never maps
    big, small = RecordKey("doc", 0, 0, 64), RecordKey("doc", 0, 64, 68)
    tier.put(big, _big(big))
    tier.put(small, block_for(small))
    stored = tier.get(big)
    assert blocks_equal(stored, _big(big)) and blocks_equal(tier.get(small), block_for(small))
    assert stored.keys.data_ptr() % mmap.PAGESIZE == 0  # the start of its own map
    assert stored.values.data_ptr() - stored.keys.data_ptr() == stored.keys.nbytes
    assert tier._mapped == {big}
    tier.put(big, block_for(big))  # replaced by a small block: back on the heap
    assert tier._mapped == set() and blocks_equal(tier.get(big), block_for(big))
    other = RecordKey("doc", 0, 128, 192)
    tier.put(other, _big(other))
    assert tier._mapped == {other}
    tier.remove(other)
    assert tier._mapped == set()
    assert tier.used == block_for(big).nbytes + block_for(small).nbytes


def test_host_map_count_is_capped(monkeypatch, blocks_equal):
    monkeypatch.setattr(host, "MAX_MAPS", 1)
    tier = HostTier("8MB", pin=False)
    a, b = RecordKey("doc", 0, 0, 64), RecordKey("doc", 0, 64, 128)
    tier.put(a, _big(a))
    tier.put(b, _big(b))
    assert tier._mapped == {a} and blocks_equal(tier.get(b), _big(b))
    tier.remove(a)
    tier.put(a, _big(a))
    assert tier._mapped == {a}
    tier.close()
    assert tier._mapped == set()


def test_mapped_copy_is_a_copy():
    key = RecordKey("doc", 0, 0, 64)
    block = _big(key)
    copy = host.mapped_copy(block)
    block.keys.zero_()
    assert torch.equal(copy.keys, _big(key).keys) and torch.equal(copy.values, _big(key).values)
    assert copy.keys.dtype == block.keys.dtype and copy.keys.shape == block.keys.shape
