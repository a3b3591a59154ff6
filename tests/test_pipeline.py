"""Pipeline, plan and metrics, over a small in-memory store with a fake disk."""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import CancelledError
from typing import NamedTuple

import pytest
import torch

from dicttier import DictTier
from tierkv.pipeline import (FetchError, FetchPlan, Metrics, Pipeline, PipelineClosedError)
from tierkv.shapes import KVShape
from tierkv.storage.base import CorruptRecordError, KVBlock, RecordKey, StorageError
from tierkv.storage.codec import codec_by_id, decode_block, encode_block, make_codec

SHAPE = KVShape(layers=4, kv_heads=2, head_dim=8, dtype=torch.float16)
CPU = torch.device("cpu")



class RawRecord(NamedTuple):
    key: RecordKey
    codec: int
    dtype: torch.dtype
    shape: tuple
    payload: bytes


class FakeDisk:
    """read_raw_many / decode over real codecs; ``delay`` s per batch, ``bad`` keys fail."""

    def __init__(self):
        self.records: dict[RecordKey, RawRecord] = {}
        self.delay = 0.0
        self.bad: set[RecordKey] = set()
        self.reads = 0
        self.started = threading.Event()

    def put(self, key, block, codec="raw"):
        c = make_codec(codec)
        self.records[key] = RawRecord(key, c.id, block.keys.dtype, tuple(block.keys.shape),
                                      encode_block(c, block))

    def read_raw_many(self, keys):
        self.started.set()
        self.reads += len(keys)
        time.sleep(self.delay)
        for key in keys:
            if key in self.bad:
                raise CorruptRecordError(f"crc mismatch in {key}")
        return [self.records[k] for k in keys]

    def decode(self, raw):
        return decode_block(codec_by_id(raw.codec), raw.payload, raw.dtype, raw.shape)


class FakeStore:
    def __init__(self, device_budget=1 << 20):
        self.shape = SHAPE
        self.device = DictTier("device", device_budget)
        self.host = DictTier("host", None)
        self.disk = FakeDisk()
        self.controller = None

    def promote(self, key, block, importance):
        return False

    def touch(self, ranks):
        pass

    def where(self, key):
        for name in ("device", "host"):
            if key in getattr(self, name):
                return name
        return "disk" if key in self.disk.records else None

    def locate(self, keys):
        found = []
        for key in keys:
            where = self.where(key)
            found.append((getattr(self, where).get(key) if where in ("device", "host") else None,
                          where))
        return found

    def fetch(self, keys, device):
        out = []
        for key in keys:
            where = self.where(key)
            block = self.disk.decode(self.disk.records[key]) if where == "disk" else \
                getattr(self, where).get(key)
            out.append(block.to(device))
        return out


def make_block(key, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(key) % 2**31)
    shape = (SHAPE.layers, SHAPE.kv_heads, key.tokens, SHAPE.head_dim)
    return KVBlock(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())


def filled_store(groups=3, chunks=6, size=16, device_budget=1 << 20):
    """Chunks of each group spread over device, host and disk (raw and zstd)."""
    store = FakeStore(device_budget)
    keys = {}
    for g in range(groups):
        keys[g] = [RecordKey("doc", g, i * size, (i + 1) * size) for i in range(chunks)]
        for i, key in enumerate(keys[g]):
            block = make_block(key, seed=g * 100 + i)
            if i % 3 == 0:
                store.host.put(key, block)
            else:
                store.disk.put(key, block, "zstd" if i % 3 == 1 else "raw")
    store.device.put(keys[0][4], store.disk.decode(store.disk.records.pop(keys[0][4])))
    return store, keys


def sync_reference(store, keys):
    blocks = store.fetch(keys, CPU)
    return torch.cat([b.keys for b in blocks], 2), torch.cat([b.values for b in blocks], 2)


def assert_identical(block, reference):
    assert torch.equal(block.keys, reference[0]) and torch.equal(block.values, reference[1])
    assert block.keys.shape == (SHAPE.layers, SHAPE.kv_heads, reference[0].shape[2], SHAPE.head_dim)


# -- plans ----------------------------------------------------------------------------------
def test_plan_refuses_a_nan_importance():
    key = RecordKey("d", 0, 0, 4)
    with pytest.raises(ValueError, match="group 0: an importance is NaN"):
        FetchPlan([(0, [key])], importance={key: float("nan")})


def test_plan_dedupes_keeping_order():
    a, b = RecordKey("d", 0, 0, 4), RecordKey("d", 0, 4, 8)
    plan = FetchPlan([(0, [b, a, b, a])], importance={a: 2.0})
    assert plan.groups[0].keys == (b, a)
    assert plan.groups[0].importance == (0.0, 2.0)


@pytest.mark.parametrize("groups, match", [
    ([(0, [RecordKey("d", 1, 0, 4)])], "belongs to group 1"),
    ([(0, [RecordKey("d", 0, 0, 4)]), (0, [RecordKey("d", 0, 4, 8)])], "listed twice"),
    ([(0, [])], "no keys"),
    ([(-1, [RecordKey("d", 0, 0, 4)])], "non-negative"),
    ([(0, ["not a key"])], "not a RecordKey"),
])
def test_plan_rejects_bad_groups(groups, match):
    with pytest.raises(ValueError, match=match):
        FetchPlan(groups)


def test_out_of_range_group_fails_at_submit():
    store, _ = filled_store()
    with Pipeline(store, CPU, groups=3) as pipe:
        with pytest.raises(ValueError, match="group 3 is out of range"):
            pipe.submit(FetchPlan([(3, [RecordKey("doc", 3, 0, 16)])]))


def test_unknown_key_surfaces_at_wait_of_its_group_only():
    store, keys = filled_store()
    ghost = RecordKey("doc", 1, 999, 1000)
    plan = FetchPlan([(0, keys[0]), (1, keys[1] + [ghost]), (2, keys[2])])
    with Pipeline(store, CPU) as pipe:
        step = pipe.submit(plan)
        assert_identical(step.wait(0), sync_reference(store, keys[0]))
        with pytest.raises(FetchError, match="999, end=1000.*unknown record"):
            step.wait(1)
        assert_identical(step.wait(2), sync_reference(store, keys[2]))
        with pytest.raises(ValueError, match="not in this step"):
            step.wait(5)


# -- results --------------------------------------------------------------------------------
def test_bit_identical_to_sync_fetch_and_cache_reuses_hits():
    store, keys = filled_store()
    metrics = Metrics()
    plan = FetchPlan([(g, keys[g][::-1]) for g in (2, 0, 1)])
    with Pipeline(store, CPU, threads=2, metrics=metrics) as pipe:
        for _ in range(2):
            metrics.step_begin()
            step = pipe.submit(plan)
            for g in (2, 0, 1):
                assert_identical(step.wait(g), sync_reference(store, keys[g][::-1]))
            metrics.step_end()
        first, second = metrics.step(0), metrics.step(1)
    assert first["records"]["disk"] == 11 and first["records"]["cache"] == 0
    assert second["records"]["disk"] == 0 and second["records"]["cache"] == 11
    assert second["records"]["host"] == 6 and second["records"]["device"] == 1
    assert store.disk.reads == 11
    assert first["codec_mix"] == {"raw": 6, "zstd": 5}
    total = metrics.summary()["total"]
    assert total["cache_hit_rate"] == pytest.approx(11 / 36, abs=1e-4)
    assert "stall frac" in metrics.format_table()


def test_delivered_block_is_not_the_cached_copy():
    store, keys = filled_store()
    plan = FetchPlan([(1, keys[1])])
    with Pipeline(store, CPU) as pipe:
        pipe.submit(plan).wait(1).keys.zero_()
        assert_identical(pipe.submit(plan).wait(1), sync_reference(store, keys[1]))


def test_cache_respects_device_budget():
    record = 4096
    store, keys = filled_store(device_budget=4 * record)  # the device tier holds one record
    assert store.device.used == record
    with Pipeline(store, CPU) as pipe:
        for g in range(3):
            pipe.submit(FetchPlan([(g, keys[g])])).wait(g)
            assert store.device.used <= store.device.budget
        assert len(pipe.cache) == 3 and pipe.cache.used == 3 * record
        assert store.where(keys[0][4]) == "device"   # the store's own record was not evicted


# -- failures -------------------------------------------------------------------------------
def test_worker_failure_mid_plan_names_the_record():
    store, keys = filled_store()
    bad = keys[1][2]
    store.disk.bad.add(bad)
    plan = FetchPlan([(g, keys[g]) for g in range(3)])
    with Pipeline(store, CPU) as pipe:
        step = pipe.submit(plan)
        with pytest.raises(FetchError) as info:
            step.wait(1)
        assert info.value.key == bad and info.value.group == 1
        assert "crc mismatch" in str(info.value) and str(bad) in str(info.value)
        assert isinstance(info.value.__cause__, CorruptRecordError)
        assert_identical(step.wait(0), sync_reference(store, keys[0]))
        assert_identical(step.wait(2), sync_reference(store, keys[2]))
        with pytest.raises(FetchError):
            pipe.submit(plan).wait(1)


@pytest.mark.parametrize("broken, match", [
    (lambda keys: (_ for _ in ()).throw(RuntimeError("disk driver bug")), "disk driver bug"),
    (lambda keys: None, "disk returned NoneType, not a list of records"),
])
def test_any_failure_of_the_disk_read_is_a_fetch_error_naming_a_record(broken, match):
    """Whatever the disk tier (any object with ``read_raw_many``) raises or returns wrongly,
    ``wait`` raises FetchError naming the group and a record, the cause chained."""
    store, keys = filled_store()
    store.disk.read_raw_many = broken
    with Pipeline(store, CPU) as pipe:
        step = pipe.submit(FetchPlan([(1, keys[1])]))
        with pytest.raises(FetchError, match=match) as info:
            step.wait(1)
        assert info.value.group == 1 and info.value.key in keys[1]


@pytest.mark.parametrize("bad, match", [
    (lambda key: make_block(RecordKey(key.doc, key.group, key.start, key.end + 2)),
     "holds 18 tokens but"),
    (lambda key: KVBlock(*(t[..., :4].contiguous() for t in make_block(key))), "differs from"),
])
def test_a_disk_record_that_does_not_fit_its_plan_is_named(bad, match):
    """Blocks decoded from disk are checked (the tiers checked theirs as they were put)."""
    store, keys = filled_store()
    wrong = keys[1][1]                                     # on disk, after a host record
    store.disk.put(wrong, bad(wrong))
    with Pipeline(store, CPU) as pipe:
        with pytest.raises(FetchError, match=match) as info:
            pipe.submit(FetchPlan([(1, keys[1])])).wait(1)
    assert info.value.key == wrong


def test_os_error_from_read_surfaces(monkeypatch):
    store, keys = filled_store()

    def broken(keys):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.disk, "read_raw_many", broken)
    with Pipeline(store, CPU) as pipe:
        with pytest.raises(FetchError, match="OSError.*Input/output error"):
            pipe.submit(FetchPlan([(0, keys[0])])).wait(0)


def test_close_with_reads_in_flight_does_not_hang():
    store, keys = filled_store()
    store.disk.delay = 0.5
    pipe = Pipeline(store, CPU, threads=2)
    step = pipe.submit(FetchPlan([(g, keys[g]) for g in range(3)]))
    assert store.disk.started.wait(5)
    start = time.perf_counter()
    pipe.close(timeout=2.0)
    for g in range(3):
        with pytest.raises(PipelineClosedError):
            step.wait(g, timeout=2)
    assert time.perf_counter() - start < 2.5
    assert pipe.close(timeout=2.0)  # idempotent; the in-flight reads have ended by now
    with pytest.raises(PipelineClosedError):
        pipe.submit(FetchPlan([(0, keys[0])]))


def test_cancel_and_wait_timeout():
    store, keys = filled_store()
    store.disk.delay = 0.3
    with Pipeline(store, CPU, threads=1) as pipe:
        step = pipe.submit(FetchPlan([(g, keys[g]) for g in range(3)]))
        with pytest.raises(TimeoutError):
            step.wait(0, timeout=0.01)
        step.cancel()
        with pytest.raises(CancelledError):
            step.wait(2)



def test_cancel_returns_once_no_worker_holds_a_cancelled_groups_block():
    """A group whose block a worker is assembling when the step is cancelled: ``cancel()``
    returns only after the worker has let that block go, so a caller that then lets the
    group's device bytes go (``TieredCache``'s prefetches) never holds more than it counts.
    Without the wait, cancel() returned while the block still lived (0.3 s here)."""
    store, keys = filled_store()
    with Pipeline(store, CPU, threads=1) as pipe:
        real, assembling, made = pipe.transfer.assemble, threading.Event(), []

        def slow(*args, **kwargs):
            delivery = real(*args, **kwargs)
            made.append(weakref.ref(delivery))
            assembling.set()
            time.sleep(0.3)  # the copy to the device still running
            return delivery
        pipe.transfer.assemble = slow
        step = pipe.submit(FetchPlan([(0, keys[0])]))
        assert assembling.wait(5)
        step.cancel()
        assert made[0]() is None  # no longer held by the worker (nor by the future)
        with pytest.raises(CancelledError):
            step.wait(0)
        delivered = pipe.submit(FetchPlan([(1, keys[1])]))  # a delivered group stays delivered
        assert_identical(delivered.wait(1), sync_reference(store, keys[1]))
        delivered.cancel()
        assert_identical(delivered.wait(1), sync_reference(store, keys[1]))



def test_cancel_does_not_wait_for_a_read_that_has_put_nothing_on_the_device():
    """A group still being read from disk when its step is cancelled: ``cancel()`` returns at
    once (nothing of it is on the device; the read stops at its next stage), where waiting
    would hold the decoding thread for the whole read."""
    store, keys = filled_store()
    gate, real = threading.Event(), store.disk.read_raw_many

    def held_read(keys):
        store.disk.started.set()
        assert gate.wait(10)
        return real(keys)
    store.disk.read_raw_many = held_read
    with Pipeline(store, CPU, threads=1) as pipe:
        step = pipe.submit(FetchPlan([(0, keys[0])]))
        assert store.disk.started.wait(5)
        cancelling = threading.Thread(target=step.cancel)
        cancelling.start()
        cancelling.join(5)
        returned = not cancelling.is_alive()
        gate.set()  # the read ends now (the worker then stops before the device copy)
        assert returned
        with pytest.raises(CancelledError):
            step.wait(0)
        assert pipe.wait_idle(5)


# -- the real store -------------------------------------------------------------------------
def test_real_store_bit_identical_and_cached(tmp_path):
    from tierkv.config import TierConfig
    from tierkv.storage.store import KVStore

    record = 4096
    config = TierConfig(device_budget=8 * record, host_budget=4 * record, disk_dir=tmp_path,
                        device="cpu")
    keys = {g: [RecordKey("doc", g, i * 16, (i + 1) * 16) for i in range(6)] for g in range(3)}
    with KVStore(SHAPE, config) as store:
        for g, group in keys.items():
            for i, key in enumerate(group):
                store.put(key, make_block(key, seed=g * 10 + i), codec=("raw", "zstd")[i % 2])
        assert {store.where(k) for g in keys for k in keys[g]} == {"host", "disk"}
        plan = FetchPlan([(g, keys[g]) for g in (1, 0, 2)])
        with Pipeline(store, CPU) as pipe:
            for _ in range(2):
                step = pipe.submit(plan)
                for g in (1, 0, 2):
                    assert_identical(step.wait(g), sync_reference(store, keys[g]))
            assert pipe.cache.hits > 0 and store.device.used <= store.device.budget



def test_records_read_every_step_stay_on_the_host_while_new_ones_come_and_go(tmp_path):
    """The host keeps what decode reads again: a read re-ranks the records it finds, so a record
    read every step outranks records promoted from disk after it was (not first in, first out)."""
    from tierkv.config import TierConfig
    from tierkv.storage.store import KVStore

    record = 4096
    config = TierConfig(device_budget=2 * record, host_budget=4 * record, disk_dir=tmp_path,
                        device="cpu")
    keys = [RecordKey("doc", 0, i * 16, (i + 1) * 16) for i in range(12)]
    with KVStore(SHAPE, config) as store:
        for i, key in [*enumerate(keys)][4:] + [*enumerate(keys)][:4]:  # the last four stay
            store.put(key, make_block(key, seed=i), importance=1.0, codec="raw")
        hot = keys[0]
        assert hot in store.host and store.where(keys[4]) == "disk"
        with Pipeline(store, CPU) as pipe:
            for step, new in enumerate(keys[4:], start=2):
                plan = FetchPlan([(0, [hot, new])], default_importance=float(step))
                assert_identical(pipe.submit(plan).wait(0), sync_reference(store, [hot, new]))
                assert pipe.wait_idle(5)  # ranks and host copies follow the delivery
                assert hot in store.host, f"the record read every step spilled at step {step}"
                assert new in store.host  # promoted: the coldest others made room

def test_a_group_is_delivered_before_the_store_ranks_and_keeps_its_disk_records():
    """Ranking the records read and keeping host copies of those from disk follow the
    delivery: the consumer does not wait for them."""
    store, keys = filled_store()
    release, promoted = threading.Event(), []

    def slow_promote(key, block, importance):
        assert release.wait(5)
        promoted.append(key)
        return False
    store.promote = slow_promote
    on_disk = {k for k in keys[0] if store.where(k) == "disk"}
    with Pipeline(store, CPU, threads=1) as pipe:
        block = pipe.submit(FetchPlan([(0, keys[0])])).wait(0, timeout=5)
        assert_identical(block, sync_reference(store, keys[0]))
        assert promoted == []  # delivered while the first promotion still waits
        release.set()
        assert pipe.wait_idle(5)
        assert set(promoted) == on_disk and on_disk


def test_bookkeeping_that_fails_after_delivery_surfaces_at_the_next_submit():
    store, keys = filled_store()

    def failing_promote(key, block, importance):
        raise OSError(28, "No space left on device")
    store.promote = failing_promote
    with Pipeline(store, CPU) as pipe:
        assert_identical(pipe.submit(FetchPlan([(0, keys[0])])).wait(0, timeout=5),
                         sync_reference(store, keys[0]))
        assert pipe.wait_idle(5)
        with pytest.raises(StorageError, match="layer group 0: .* after the fetch failed: "
                                               "OSError: .*No space left on device"):
            pipe.submit(FetchPlan([(1, keys[1])]))
        assert_identical(pipe.submit(FetchPlan([(1, keys[1])])).wait(1, timeout=5),
                         sync_reference(store, keys[1]))  # raised once; the pipeline goes on


def test_fetch_now_delivers_in_the_calling_thread_and_counts_as_stall():
    store, keys = filled_store()
    metrics = Metrics()
    with Pipeline(store, CPU, metrics=metrics) as pipe:
        threads = []
        real = pipe._fetcher.fetch

        def spy(*args, **kwargs):
            threads.append(threading.current_thread())
            return real(*args, **kwargs)
        pipe._fetcher.fetch = spy
        metrics.step_begin()
        block = pipe.fetch_now(FetchPlan([(1, keys[1])]))
        assert_identical(block, sync_reference(store, keys[1]))
        assert threads == [threading.current_thread()]
        metrics.step_end()
        assert metrics.step(0)["stall_s"] > 0
        with pytest.raises(ValueError, match="one group"):
            pipe.fetch_now(FetchPlan([(0, keys[0]), (1, keys[1])]))
        with pytest.raises(FetchError, match="unknown record"):
            pipe.fetch_now(FetchPlan([(1, [RecordKey("doc", 1, 999, 1000)])]))
        assert pipe.wait_idle(5)
    with pytest.raises(PipelineClosedError, match="fetch_now"):
        pipe.fetch_now(FetchPlan([(1, keys[1])]))


def test_refresh_ranks_a_groups_records_on_a_worker_without_fetching_them():
    store, keys = filled_store()
    touched = []
    real = store.touch

    def spy(ranks):
        ranks = list(ranks)
        touched.append((threading.current_thread(), ranks))
        real(ranks)
    store.touch = spy
    with Pipeline(store, CPU) as pipe:
        fetched = []
        pipe._fetcher.fetch = lambda *a, **k: fetched.append(a)
        pipe.refresh(FetchPlan([(1, keys[1])], default_importance=9.0))
        assert pipe.wait_idle(5)
        assert not fetched and len(touched) == 1
        thread, ranks = touched[0]
        assert thread is not threading.current_thread()
        assert ranks == [(key, 9.0) for key in keys[1]]
        with pytest.raises(ValueError, match="one group"):
            pipe.refresh(FetchPlan([(0, keys[0]), (1, keys[1])]))
    with pytest.raises(PipelineClosedError, match="refresh"):
        pipe.refresh(FetchPlan([(1, keys[1])]))


def test_fetch_now_leaves_the_bookkeeping_to_a_worker_and_raises_its_failure_next():
    store, keys = filled_store()
    done = []

    def failing_promote(key, block, importance):
        done.append(threading.current_thread())
        raise OSError(5, "Input/output error")
    store.promote = failing_promote
    with Pipeline(store, CPU) as pipe:
        assert_identical(pipe.fetch_now(FetchPlan([(0, keys[0])])), sync_reference(store, keys[0]))
        assert pipe.wait_idle(5)
        assert done and threading.current_thread() not in done
        with pytest.raises(StorageError, match="layer group 0: .*OSError"):
            pipe.fetch_now(FetchPlan([(1, keys[1])]))


def test_metrics_steps_and_loose_records():
    metrics = Metrics()
    metrics.record_delivery("disk", 100)           # outside a step: counts towards the next
    metrics.step_begin()
    metrics.record_stall(0.01)
    time.sleep(0.02)
    metrics.step_end()
    metrics.record_delivery("cache", 50)
    assert metrics.steps == 1 and metrics.step(0)["bytes"]["disk"] == 100
    summary = metrics.summary()
    assert summary["total"]["bytes"] == {"cache": 50, "device": 0, "host": 0, "disk": 100}
    assert 0 < summary["stall_frac_per_step"][0] < 0.5
    with pytest.raises(ValueError, match="source"):
        metrics.record_delivery("tape", 1)
    metrics.step_begin()
    metrics.record_deliveries(["host", "disk", "host"], [10, 20, 30])
    metrics.step_end()
    assert metrics.step(1)["bytes"] == {"cache": 50, "device": 0, "host": 40, "disk": 20}
    assert metrics.step(1)["records"] == {"cache": 1, "device": 0, "host": 2, "disk": 1}
    with pytest.raises(ValueError, match="'tape'"):
        metrics.record_deliveries(["host", "tape"], [1, 1])
    assert metrics.summary()["total"]["bytes"]["host"] == 40  # nothing of the refused batch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_staging_side_stream_bit_identical():
    cuda = torch.device("cuda")
    store, keys = filled_store()
    from tierkv.storage.device import DeviceTier

    gpu = DeviceTier(1 << 20, cuda)
    for key in store.device.keys():
        gpu.put(key, store.device.get(key))
    store.device = gpu
    plan = FetchPlan([(g, keys[g]) for g in range(3)])
    with Pipeline(store, cuda) as pipe:
        for _ in range(2):
            step = pipe.submit(plan)
            for g in range(3):
                block = step.wait(g)
                assert block.keys.device.type == "cuda"
                reference = sync_reference(store, keys[g])
                assert torch.equal(block.keys.cpu(), reference[0])
                assert torch.equal(block.values.cpu(), reference[1])


def test_real_disk_corrupt_record_named(tmp_path):
    from tierkv.config import TierConfig
    from tierkv.storage.store import KVStore

    config = TierConfig(device_budget=0, host_budget=0, disk_dir=tmp_path, device="cpu")
    keys = [RecordKey("doc", 0, i * 16, (i + 1) * 16) for i in range(4)]
    with KVStore(SHAPE, config) as store:
        for key in keys:
            store.disk.put(key, make_block(key), codec="raw")
        store.disk.flush()
        segment = next(tmp_path.glob("seg-*"))
        data = bytearray(segment.read_bytes())
        data[-1] ^= 0xFF                     # the tail of the last record written
        segment.write_bytes(bytes(data))
        with Pipeline(store, CPU) as pipe:
            step = pipe.submit(FetchPlan([(0, keys)]))
            with pytest.raises(FetchError) as info:
                step.wait(0)
            assert info.value.key == keys[-1]
            ok = pipe.submit(FetchPlan([(0, keys[:3])])).wait(0)
            assert_identical(ok, sync_reference(store, keys[:3]))


def test_work_on_another_thread_runs_as_the_caller_does():
    """Work handed to another thread (a tree fold) runs there as called, with the caller's
    inference mode and without autograd; on CUDA with the caller's stream current, so its
    kernels follow the caller's on the same tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from tierkv.pipeline.transfer import as_caller

    def modes():
        return torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(as_caller, None, False, lambda a, b: a + b, 2, 3).result() == 5
        assert pool.submit(as_caller, None, True, modes).result() == (True, False)
        assert pool.submit(as_caller, None, False, modes).result() == (False, False)
        with torch.inference_mode():
            made = torch.zeros(3)
        assert pool.submit(as_caller, None, True, made.add_, 1).result().sum() == 3
        if torch.cuda.is_available():
            side = torch.cuda.Stream()
            seen = pool.submit(as_caller, side, False, torch.cuda.current_stream).result()
            assert seen == side
