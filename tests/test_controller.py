"""CompressionController and ThrottledDisk: choices follow the measured bandwidths."""
from __future__ import annotations

import time

import pytest
import torch

from test_pipeline import FakeStore
from tierkv.config import CodecConfig
from tierkv.pipeline import CompressionController, FetchPlan, Pipeline, ThrottledDisk
from tierkv.storage.base import KVBlock, RecordKey

MB = 1e6


def seeded(disk_bw):
    return CompressionController(("raw", "zstd"), disk_bw=disk_bw,
                                 decode_bw={"raw": 5000 * MB, "zstd": 800 * MB},
                                 ratio={"raw": 1.0, "zstd": 0.6})


def test_slow_disk_prefers_compression_fast_disk_none():
    assert seeded(200 * MB).choose(1 << 20) == "zstd"
    assert seeded(5000 * MB).choose(1 << 20) == "raw"
    slow = seeded(200 * MB)
    assert slow.expected_time("zstd", 10**6) < slow.expected_time("raw", 10**6)


def test_pipelined_cost_is_the_slower_stage():
    rates = dict(disk_bw=180 * MB, decode_bw={"raw": 2400 * MB, "zstd": 880 * MB},
                 ratio={"raw": 1.0, "zstd": 0.85})
    assert CompressionController(**rates).choose(1 << 20) == "raw"       # 6.0 vs 5.9 ms/MB
    piped = CompressionController(**rates, pipelined=True)
    assert piped.choose(1 << 20) == "zstd"                                # 5.6 vs 4.7 ms/MB
    assert piped.expected_time("zstd", 10**6) == pytest.approx(0.85 / 180)


def test_margin_keeps_the_cheaper_codec_on_a_small_gain():
    rates = dict(disk_bw=1000 * MB, decode_bw={"raw": 10000 * MB, "int8": 1800 * MB},
                 ratio={"raw": 1.0, "int8": 0.3})                         # 1.10 vs 0.86 ms/MB
    assert CompressionController(("raw", "int8"), **rates).choose(1 << 20, cold=True) == "int8"
    rates["decode_bw"]["int8"] = 1400 * MB                                # 1.10 vs 1.01 ms/MB
    assert CompressionController(("raw", "int8"), **rates).choose(1 << 20, cold=True) == "raw"
    eager = CompressionController(("raw", "int8"), **rates, margin=0)
    assert eager.choose(100, cold=True) == "int8"
    with pytest.raises(ValueError, match="margin"):
        CompressionController(margin=1.0)


def test_lossy_only_for_cold_records():
    ctl = CompressionController.from_config(
        CodecConfig(allow_lossy=True), disk_bw=200 * MB,
        decode_bw={"raw": 5000 * MB, "zstd": 800 * MB, "int8": 900 * MB, "int4": 900 * MB},
        ratio={"raw": 1.0, "zstd": 0.6, "int8": 0.55, "int4": 0.3})
    assert ctl.candidates == ("raw", "zstd", "int8", "int4")
    assert ctl.choose(1 << 20) == "zstd"
    assert ctl.choose(1 << 20, cold=True) == "int4"
    assert CompressionController.from_config(CodecConfig()).candidates == ("raw", "zstd")


def test_unmeasured_codecs_and_validation():
    ctl = CompressionController(("zstd", "raw"))
    assert ctl.choose(100) == "zstd"              # nothing known: the first candidate
    ctl.observe_read(10**6, 0.01)
    ctl.observe_decode("raw", 1000, 1000, 1e-6)
    assert ctl.choose(100) == "raw"               # zstd still unmeasured, raw is
    assert ctl.state()["disk_bw"] == pytest.approx(1e8)
    with pytest.raises(ValueError, match="candidates"):
        CompressionController(("lz4",))
    with pytest.raises(ValueError, match="nbytes_raw"):
        ctl.choose(0)
    with pytest.raises(ValueError, match="disk_bw"):
        CompressionController(disk_bw=-1)


def test_ema_moves_toward_new_samples():
    ctl = CompressionController(alpha=0.5, disk_bw=100 * MB)
    ctl.observe_read(300 * 10**6, 1.0)
    assert ctl.state()["disk_bw"] == pytest.approx(200 * MB)


def test_throttled_disk_caps_bandwidth():
    store = FakeStore()
    keys = [RecordKey("doc", 0, i * 64, (i + 1) * 64) for i in range(4)]
    for key in keys:
        store.disk.put(key, _compressible(key))
    throttled = ThrottledDisk(store.disk, 2 * MB)
    nbytes = sum(len(store.disk.records[k].payload) for k in keys)
    start = time.perf_counter()
    throttled.read_raw_many(keys)
    assert time.perf_counter() - start >= nbytes / (2 * MB)
    ctl = CompressionController(disk_bw=5000 * MB)
    ctl.calibrate_disk(throttled, [keys[:2], keys[2:]])   # replaces the estimate
    assert 0.2 * 2 * MB < ctl.state()["disk_bw"] <= 1.05 * 2 * MB   # capped; slower when busy
    assert throttled.records is store.disk.records  # everything else is the wrapped tier's
    with pytest.raises(ValueError, match="bandwidth"):
        ThrottledDisk(store.disk, 0)


def _compressible(key):
    """Low-entropy fp16 KV (few distinct values) that zstd shrinks several-fold."""
    g = torch.Generator().manual_seed(key.start)
    shape = (4, 2, key.tokens, 8)
    return KVBlock(torch.randint(-4, 4, shape, generator=g).half(),
                   torch.randint(-4, 4, shape, generator=g).half())


def _measure(disk_wrapper):
    """Run a pipeline over zstd and raw records; return the calibrated controller."""
    store = FakeStore(device_budget=0)
    keys = [RecordKey("doc", 0, i * 4096, (i + 1) * 4096) for i in range(8)]  # 0.5 MB each
    for i, key in enumerate(keys):
        store.disk.put(key, _compressible(key), "zstd" if i % 2 else "raw")
    ctl = CompressionController(("raw", "zstd"))
    ctl.calibrate(_compressible(keys[0]))
    disk = disk_wrapper(store.disk)
    with Pipeline(store, "cpu", controller=ctl, disk=disk) as pipe:
        for _ in range(3):
            pipe.submit(FetchPlan([(0, keys)])).wait(0)
    return ctl


def test_controller_chooses_differently_on_throttled_and_fast_disk():
    slow = _measure(lambda disk: ThrottledDisk(disk, 100 * MB))
    fast = _measure(lambda disk: disk)
    assert slow.state()["disk_bw"] < 150 * MB < fast.state()["disk_bw"]
    assert slow.choose(1 << 20) == "zstd"
    assert fast.choose(1 << 20) == "raw"
