"""CompressionController and ThrottledDisk: choices follow the measured bandwidths, and a
KVStore writes each disk record with the codec its controller chooses."""
from __future__ import annotations

import time

import pytest
import torch

from test_pipeline import FakeStore
from tierkv.config import CodecConfig, TierConfig
from tierkv.pipeline import CompressionController, FetchPlan, Pipeline, ThrottledDisk
from tierkv.shapes import KVShape
from tierkv.storage import KVStore
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


# -- KVStore asks the controller for the codec of each disk write ----------------------------
SHAPE = KVShape(layers=2, kv_heads=2, head_dim=8)
RATES = dict(decode_bw={"raw": 5000 * MB, "zstd": 800 * MB, "int8": 900 * MB, "int4": 900 * MB},
             ratio={"raw": 1.0, "zstd": 0.6, "int8": 0.55, "int4": 0.3})
IMPORTANCE = {0: 5.0, 1: 6.0, 2: 0.1, 3: 0.2}   # put in this order: 0, 1 hot; 2, 3 cold


def _store(tmp_path, codec=CodecConfig(allow_lossy=True), controller=None, host=0, shape=SHAPE):
    """A store whose records go straight to disk (host budget 0), judged as they arrive."""
    config = TierConfig(device_budget="1MB", host_budget=host, disk_dir=tmp_path / "kv",
                        device="cpu", codec=codec)
    return KVStore(shape, config, controller=controller)


def _key(i):
    return RecordKey("doc", 0, 16 * i, 16 * i + 16)


def _put_ranked(store, make_block):
    for i, importance in IMPORTANCE.items():
        store.put(_key(i), make_block(_key(i)), importance=importance)
    return [store.disk.codec_of(_key(i)) for i in IMPORTANCE]


def test_store_writes_cold_records_lossy_hot_lossless_on_a_slow_disk(tmp_path, make_block,
                                                                      blocks_equal):
    ctl = CompressionController.from_config(CodecConfig(allow_lossy=True), disk_bw=200 * MB,
                                            **RATES)
    with _store(tmp_path, controller=ctl) as store:
        assert _put_ranked(store, make_block) == ["zstd", "zstd", "int4", "int4"]
        for i in (0, 1):
            assert blocks_equal(store.get(_key(i)), make_block(_key(i)))
        for i in (2, 3):
            got, want = store.get(_key(i)), make_block(_key(i))
            assert not torch.equal(got.keys, want.keys)
            assert torch.allclose(got.keys, want.keys, atol=0.5)
            assert torch.allclose(got.values, want.values, atol=0.5)


def test_put_many_judges_coldness_against_the_whole_batch(tmp_path, make_block):
    ctl = CompressionController.from_config(CodecConfig(allow_lossy=True), disk_bw=200 * MB,
                                            **RATES)
    rising = {_key(i): importance for i, importance in enumerate([0.1, 0.2, 5.0, 6.0])}
    with _store(tmp_path, controller=ctl) as store:
        for key, importance in rising.items():   # each the hottest so far when it is written
            store.put(key, make_block(key), importance=importance)
        assert {store.disk.codec_of(k) for k in rising} == {"zstd"}
    with _store(tmp_path / "batch", controller=ctl) as store:
        store.put_many({k: make_block(k) for k in rising}, rising)
        assert [store.disk.codec_of(k) for k in rising] == ["int4", "int4", "zstd", "zstd"]
        with pytest.raises(ValueError, match="mappings"):
            store.put_many([(_key(0), make_block(_key(0)))])


def test_store_writes_raw_on_a_fast_disk(tmp_path, make_block, blocks_equal):
    ctl = CompressionController.from_config(CodecConfig(allow_lossy=True), disk_bw=5000 * MB,
                                            **RATES)
    with _store(tmp_path, controller=ctl) as store:
        assert _put_ranked(store, make_block) == ["raw"] * 4
        assert all(blocks_equal(store.get(_key(i)), make_block(_key(i))) for i in IMPORTANCE)


@pytest.mark.parametrize("disk_bw, codec", [(200 * MB, "zstd"), (5000 * MB, "raw")])
def test_store_keeps_every_record_lossless_unless_lossy_is_allowed(tmp_path, make_block,
                                                                   disk_bw, codec):
    ctl = CompressionController.from_config(CodecConfig(), disk_bw=disk_bw, **RATES)
    with _store(tmp_path, codec=CodecConfig(), controller=ctl) as store:
        assert _put_ranked(store, make_block) == [codec] * 4


def test_store_honours_a_fixed_codec(tmp_path, make_block, blocks_equal):
    fast = CompressionController(("raw", "zstd"), disk_bw=5000 * MB, **RATES)
    with _store(tmp_path, codec=CodecConfig("zstd"), controller=fast) as store:
        assert _put_ranked(store, make_block) == ["zstd"] * 4
    slow = CompressionController.from_config(CodecConfig(allow_lossy=True), disk_bw=200 * MB,
                                             **RATES)
    with _store(tmp_path / "put", controller=slow) as store:
        store.put(_key(0), make_block(_key(0)), importance=-1.0, codec="raw")  # coldest, fixed
        assert store.disk.codec_of(_key(0)) == "raw"
        assert blocks_equal(store.get(_key(0)), make_block(_key(0)))


def test_spill_from_the_host_asks_the_controller(tmp_path, make_block):
    ctl = CompressionController.from_config(CodecConfig(allow_lossy=True), disk_bw=200 * MB,
                                            **RATES)
    nbytes = make_block(_key(0)).nbytes
    with _store(tmp_path, controller=ctl, host=2 * nbytes) as store:
        for i in (0, 1, 2, 3):  # importance 5, 6, 0.1, 0.2: 2 and 3 colder than the full host
            store.put(_key(i), make_block(_key(i)), importance=IMPORTANCE[i])
        assert [store.where(_key(i)) for i in range(4)] == ["host", "host", "disk", "disk"]
        assert [store.disk.codec_of(_key(i)) for i in (2, 3)] == ["int4", "int4"]  # cold
        store.put(_key(4), make_block(_key(4)), importance=9.0)  # spills the coldest host
        assert store.where(_key(0)) == "disk"                   # record: 0, not cold (3 of 5
        assert store.disk.codec_of(_key(0)) == "zstd"           # rank at most as high)
        store.set_importance(_key(1), 0.05)                     # now the coldest of all
        store.put(_key(5), make_block(_key(5)), importance=9.0)
        assert store.where(_key(1)) == "disk" and store.disk.codec_of(_key(1)) == "int4"


def test_unmeasured_disk_leaves_the_default_and_unknown_codecs_are_calibrated(tmp_path,
                                                                            make_block):
    ctl = CompressionController.from_config(CodecConfig(allow_lossy=True))
    with _store(tmp_path, controller=ctl) as store:
        store.put(_key(0), make_block(_key(0)))
        assert store.disk.codec_of(_key(0)) == "zstd"        # the disk tier's "auto"
        assert ctl.state()["ratio"]["int4"] is None          # nothing asked of the codecs yet
        ctl.observe_read(10**8, 1.0)
        store.put(_key(1), make_block(_key(1)))
        assert all(v is not None for v in ctl.state()["ratio"].values())
        assert store.disk.codec_of(_key(1)) == ctl.choose(make_block(_key(1)).nbytes)


def test_pipeline_measurements_reach_the_stores_writes(tmp_path):
    shape = KVShape(layers=2, kv_heads=2, head_dim=64, dtype=torch.float16)
    keys = [RecordKey("doc", 0, i * 2048, (i + 1) * 2048) for i in range(4)]   # 1 MB each
    ctl = CompressionController.from_config(CodecConfig())
    with _store(tmp_path, codec=CodecConfig(), controller=ctl, shape=shape) as store:
        blocks = {key: _random(shape, key) for key in keys}
        for key in keys[:3]:
            store.put(key, blocks[key])
        assert {store.disk.codec_of(k) for k in keys[:3]} == {"zstd"}   # nothing measured yet
        with Pipeline(store, "cpu") as pipe:                          # the store's controller
            pipe.submit(FetchPlan([(0, keys[:3])])).wait(0)
        state = ctl.state()
        assert state["disk_bw"] is not None and state["ratio"]["raw"] is None   # zstd read only
        store.put(keys[3], blocks[keys[3]])
        assert ctl.state()["ratio"]["raw"] is not None     # calibrated by the write, then asked
        assert store.disk.codec_of(keys[3]) == ctl.choose(blocks[keys[3]].nbytes)


def _random(shape, key):
    g = torch.Generator().manual_seed(key.start)
    size = (shape.layers, shape.kv_heads, key.tokens, shape.head_dim)
    return KVBlock(torch.randn(size, generator=g).half(), torch.randn(size, generator=g).half())


def test_store_rejects_bad_controllers_and_inputs(tmp_path, make_block):
    lossy = CompressionController.from_config(CodecConfig(allow_lossy=True))
    with pytest.raises(ValueError, match="allow_lossy"):
        _store(tmp_path, codec=CodecConfig(), controller=lossy)
    with pytest.raises(ValueError, match="CompressionController"):
        _store(tmp_path, controller=object())
    with pytest.raises(ValueError, match="cold_fraction"):
        CodecConfig(cold_fraction=1.5)
    with pytest.raises(ValueError, match="config"):
        CompressionController(config="zstd")
    with pytest.raises(ValueError, match="block"):
        lossy.choose_for("not a block")
    with pytest.raises(ValueError, match="codecs"):
        CompressionController().calibrate(make_block(_key(0)), codecs=("int4",))
    with _store(tmp_path, codec=CodecConfig()) as store:
        with pytest.raises(ValueError, match="importance"):
            store.put(_key(0), make_block(_key(0)), importance=float("nan"))
        with pytest.raises(ValueError, match="lz4"):
            store.put(_key(0), make_block(_key(0)), codec="lz4")
        with pytest.raises(ValueError, match="lossy"):
            store.put(_key(0), make_block(_key(0)), codec="int8")
        assert store.where(_key(0)) is None


def test_calibration_repeats_and_throttle_bandwidth_checked():
    """``repeat=0`` measured nothing and left decode speeds of 0 that failed every later
    disk write; a NaN bandwidth did not throttle at all."""
    block = KVBlock(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8))
    ctl = CompressionController(disk_bw=1e9)
    for repeat in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="repeat=.*positive integer"):
            ctl.calibrate(block, repeat=repeat)
    ctl.choose_for(block)  # still usable
    for bw in (float("nan"), float("inf"), 0):
        with pytest.raises(ValueError, match="bandwidth"):
            ThrottledDisk(object(), bw)
    import copy
    throttled = ThrottledDisk(object(), 1e6)
    assert copy.copy(throttled).bandwidth == 1e6  # no recursion through __getattr__
