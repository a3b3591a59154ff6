"""Device and host tiers: budgets under random workloads, copies, pinning."""
from __future__ import annotations

import random

import pytest
import torch

from tierkv.storage import DeviceTier, HostTier, RecordKey, TierFullError


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers(make_block, blocks_equal):
    key = RecordKey("doc", 0, 0, 4)
    device, host = DeviceTier("1MB", "cuda"), HostTier("1MB")
    host.put(key, make_block(key))
    assert host.get(key).keys.is_pinned()
    device.put(key, host.get(key))
    assert device.get(key).keys.is_cuda and blocks_equal(device.get(key), make_block(key))
