"""The layer-pipelined fetch (DTP): disk read -> decode -> copy to device, group by group.

``Pipeline.submit(plan)`` queues every layer group of the plan on a thread pool, in plan order,
so group g+1 is read and decoded while the consumer computes group g. ``StepHandle.wait(g)``
blocks on group g alone and returns its records concatenated along the token axis, on the
device. Records in the device cache or the device tier are not fetched again; host records skip
the read and decode stages. ``Pipeline.fetch_now(plan)`` fetches one group in the caller's
thread, for a consumer with nothing to compute meanwhile.

A group is delivered as soon as its block is assembled; what the store learns from the fetch
(the records' new ranks, host copies of those read from disk) follows on a worker thread, and a
failure there is raised by the next ``submit`` or ``fetch_now``.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from tierkv.pipeline.controller import CompressionController
from tierkv.pipeline.device_cache import DeviceCache
from tierkv.pipeline.groupfetch import GroupFetcher
from tierkv.pipeline.metrics import Metrics
from tierkv.pipeline.plan import FetchPlan, GroupFetch
from tierkv.pipeline.transfer import Delivery, Transfer
from tierkv.storage.base import KVBlock, StorageError
from tierkv.workers import worker_pool

# Least share of evicted device-cache records that must have been read again for admissions to
# go on (``DeviceCache``): on CUDA an admission is a device-side copy and a hit saves a PCIe
# (and maybe disk) fetch, some 50x dearer; on a CPU "device" it is a memory copy that saves
# about a disk read, decode and copy at ~1.6 GB/s against ~5 GB/s: break-even near 0.25.
MIN_REUSE = {"cuda": 0.02, "cpu": 0.25}


class PipelineClosedError(StorageError):
    """The pipeline was closed before the group's data arrived."""


class StepHandle:
    """The in-flight fetch of one plan; ``wait(group)`` returns a group's block."""

    def __init__(self, plan: FetchPlan, transfer: Transfer, metrics: Metrics):
        self.plan = plan
        self.futures: dict[int, Future] = {g.group: Future() for g in plan.groups}
        self.ready = transfer.mark_ready()
        self._lock = threading.Lock()
        self._running: dict[int, threading.Event] = {}  # groups a worker is fetching now
        self._transfer = transfer
        self._metrics = metrics

    def wait(self, group: int, timeout: float | None = None) -> KVBlock:
        """Block until ``group``'s records are on the device; return them.

        Returns
        -------
        KVBlock, keys and values of shape (layers, kv_heads, total_tokens, head_dim): the
        group's records concatenated along the token axis in plan order.

        Raises
        ------
        FetchError naming the record that failed; CancelledError after ``cancel()``;
        PipelineClosedError after ``Pipeline.close()``; TimeoutError after ``timeout`` seconds.
        """
        if group not in self.futures:
            raise ValueError(f"group {group} is not in this step's plan {self.plan!r}")
        start = time.perf_counter()
        try:
            delivery: Delivery = self.futures[group].result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"group {group} not fetched within {timeout} s") from None
        finally:
            self._metrics.record_stall(time.perf_counter() - start)
        return self._transfer.deliver(delivery)

    def done(self, group: int) -> bool:
        return self.futures[group].done()

    def cancel(self) -> None:
        """Drop the groups not yet delivered; their ``wait`` raises CancelledError. A fetch still
        reading or decoding stops at its next stage, unwaited (nothing of it is on the device);
        one already putting its block on the device is waited for, so that block is gone before
        the caller lets the group's device bytes go. That wait counts as stall."""
        cancelled = [group for group, future in self.futures.items() if future.cancel()]
        with self._lock:
            running = [self._running[g] for g in cancelled if g in self._running]
        if running:
            start = time.perf_counter()
            for ended in running:
                ended.wait()
            self._metrics.record_stall(time.perf_counter() - start)

    def _claim(self, group: int) -> bool:
        """For the worker about to put ``group``'s block on the device: False when the group
        was cancelled (or settled) meanwhile; else ``cancel()`` waits for it from now on, until
        ``_release``."""
        with self._lock:
            if self.futures[group].done():
                return False
            self._running[group] = threading.Event()
            return True

    def _release(self, group: int) -> None:
        with self._lock:
            ended = self._running.pop(group, None)
        if ended is not None:
            ended.set()

    def abort(self, exc: BaseException) -> None:
        """Fail every group not yet delivered with ``exc``."""
        for future in self.futures.values():
            settle(future, exc=exc)


class Pipeline:
    """Fetch the records of a plan to ``device``, layer group by layer group, ahead of compute.

    Parameters
    ----------
    store : KVStore, its ``device``, ``host`` and ``disk`` tiers, ``where``, ``promote``,
        ``touch``, ``shape`` and ``controller``.
    device : torch.device the blocks are delivered on.
    threads : worker threads; each fetches one group at a time, in plan order.
    metrics : Metrics to record into (a new one when None), readable as ``pipeline.metrics``.
    controller : CompressionController fed with the measured read and decode speeds; default:
        the store's own (``store.controller``, the one that chooses its disk codecs), if any.
    disk : the disk tier to read from instead of ``store.disk`` (e.g. a ThrottledDisk).
    groups : number of layer groups plans may name; default ``store.shape.layers``.
    """

    def __init__(self, store, device: torch.device | str, threads: int = 2,
                 metrics: Metrics | None = None, *, controller: CompressionController | None = None,
                 disk=None, groups: int | None = None):
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"threads={threads!r}: must be an integer in [1, 64]")
        self.groups = store.shape.layers if groups is None else groups
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups={groups!r}: must be a positive integer")
        self.store = store
        self.metrics = metrics if metrics is not None else Metrics()
        self.transfer = Transfer(torch.device(device))
        self.cache = DeviceCache(store.device, min_reuse=MIN_REUSE[self.transfer.device.type])
        controller = controller if controller is not None else store.controller
        self._fetcher = GroupFetcher(store, disk if disk is not None else store.disk, self.cache,
                                     self.transfer, self.metrics, controller)
        self._pool = worker_pool(threads, "tierkv-fetch")
        self._handles: weakref.WeakSet[StepHandle] = weakref.WeakSet()
        self._busy = 0
        self._idle = threading.Condition()
        self._closed = False
        self._late_error: tuple[int, BaseException] | None = None

    def submit(self, plan: FetchPlan) -> StepHandle:
        """Start fetching ``plan``; ValueError for a group outside the store's range."""
        if not isinstance(plan, FetchPlan):
            raise ValueError(f"plan={plan!r}: expected a FetchPlan")
        plan.check_groups(self.groups)
        with self._idle:
            self._check_usable("submit()")
            handle = StepHandle(plan, self.transfer, self.metrics)
            self._handles.add(handle)
            for group in plan.groups:
                self._busy += 1
                self._pool.submit(self._run, handle, group).add_done_callback(self._finished)
        return handle

    def close(self, timeout: float = 5.0) -> bool:
        """Stop: fail undelivered groups, drop queued work, wait up to ``timeout`` s for
        reads in flight. Idempotent; never blocks longer than ``timeout``. Returns whether
        every worker had finished."""
        with self._idle:
            if self._closed:
                return self._busy == 0
            self._closed = True
            handles = list(self._handles)
        error = PipelineClosedError("the pipeline was closed before this group was fetched")
        for handle in handles:
            handle.abort(error)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return self.wait_idle(timeout)

    def fetch_now(self, plan: FetchPlan) -> KVBlock:
        """Fetch the one group of ``plan`` in the calling thread and return its block, for a
        consumer that would only wait for it (nothing to compute meanwhile): no handoff to a
        worker thread and back (~0.3-0.5 ms on the 2-core CPU; at 8K, five such fetches a
        step). The time counts as stall. The store's bookkeeping after the delivery (ranks,
        host copies of records read from disk) still runs on a worker thread.

        Raises FetchError naming the record that failed; StorageError as ``submit``."""
        if not isinstance(plan, FetchPlan) or len(plan) != 1:
            raise ValueError(f"plan={plan!r}: expected a FetchPlan of one group")
        plan.check_groups(self.groups)
        with self._idle:
            self._check_usable("fetch_now()")
        group = plan.groups[0]
        start = time.perf_counter()
        try:
            delivery = self._fetcher.fetch(group, self.transfer.mark_ready(), lambda: False,
                                           later=self._later)
        finally:
            self.metrics.record_stall(time.perf_counter() - start)
        return self.transfer.deliver(delivery)

    def refresh(self, plan: FetchPlan) -> None:
        """Rank the records of ``plan``'s one group anew as ``fetch_now`` would, on a worker
        thread, without fetching them: for a consumer that holds them still, from its last
        fetch of the same records. Raises as ``fetch_now``."""
        if not isinstance(plan, FetchPlan) or len(plan) != 1:
            raise ValueError(f"plan={plan!r}: expected a FetchPlan of one group")
        plan.check_groups(self.groups)
        with self._idle:
            self._check_usable("refresh()")
        self._later(self._fetcher.refresh, plan.groups[0])

    def _later(self, fn, *args) -> None:
        """Run ``fn(*args)`` on a worker thread; an error in it is raised by the next
        ``submit`` or ``fetch_now``."""
        def run():
            try:
                fn(*args)
            except BaseException as exc:
                self._keep_late(args[0].group, exc)
        with self._idle:
            if self._closed:
                return
            self._busy += 1
            self._pool.submit(run).add_done_callback(self._finished)

    def _check_usable(self, what: str) -> None:
        """PipelineClosedError after ``close``; the kept failure of bookkeeping after a
        delivery, once (called holding ``_idle``)."""
        if self._closed:
            raise PipelineClosedError(f"{what} on a closed Pipeline")
        if self._late_error is not None:
            (group, exc), self._late_error = self._late_error, None
            raise StorageError(f"layer group {group}: its records were delivered, but the "
                               f"store's bookkeeping after the fetch failed: "
                               f"{type(exc).__name__}: {exc}") from exc

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no group is queued or being fetched, bookkeeping after delivery
        included; whether that happened within ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, handle: StepHandle, group: GroupFetch) -> None:
        future = handle.futures[group.group]
        delivered = []

        def deliver(delivery: Delivery) -> None:  # the store's bookkeeping follows, in this thread
            delivered.append(True)
            settle(future, result=delivery)
        try:
            if not future.done():
                self._fetcher.fetch(group, handle.ready, future.done, deliver,
                                    claim=functools.partial(handle._claim, group.group))
        except BaseException as exc:  # surfaced from wait(group), never lost in the pool
            if not delivered:
                settle(future, exc=exc)
            else:  # the store's bookkeeping after the delivery
                self._keep_late(group.group, exc)
        finally:
            handle._release(group.group)

    def _keep_late(self, group: int, exc: BaseException) -> None:
        """Keep the first failure after a delivery, for the next submit() or fetch_now()."""
        with self._idle:
            self._late_error = self._late_error or (group, exc)

    def _finished(self, _work: Future) -> None:
        """Called when a queued group ran or was dropped by ``close``."""
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()


def settle(future: Future, result=None, exc: BaseException | None = None) -> None:
    """Complete ``future`` unless it was already completed or cancelled."""
    try:
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
    except InvalidStateError:
        pass

