"""The work of one layer group: find each record, read and decode what is on disk, copy up."""
from __future__ import annotations

import itertools
import time
from concurrent.futures import CancelledError
from typing import Callable

from tierkv.pipeline.controller import CompressionController, ReadMeter
from tierkv.pipeline.device_cache import DeviceCache
from tierkv.pipeline.metrics import Metrics
from tierkv.pipeline.plan import GroupFetch
from tierkv.pipeline.transfer import Delivery, Transfer
from tierkv.scattered import Scattered
from tierkv.storage.base import KVBlock, RecordKey, StorageError
from tierkv.storage.codec import codec_name_by_id

# Any error of the disk tier's read or decode (a tier passed in may be any object with
# ``read_raw_many``/``decode``) becomes a FetchError naming the record, its cause chained.
READ_ERRORS = (Exception,)


class FetchError(StorageError):
    """A record of a fetch plan could not be brought to the device.

    ``group`` and ``key`` name the layer group and the record; the cause is chained.
    """

    def __init__(self, group: int, key: RecordKey, reason: str):
        self.group, self.key = group, key
        super().__init__(f"layer group {group}: record {key}: {reason}")


class GroupFetcher:
    """Fetch one ``GroupFetch`` into a ``Delivery`` (called from the pipeline's threads)."""

    def __init__(self, store, disk, cache: DeviceCache, transfer: Transfer, metrics: Metrics,
                 controller: CompressionController | None):
        self.store = store
        self.disk = disk
        self.cache = cache
        self.transfer = transfer
        self.metrics = metrics
        self.controller = controller
        self.meter = None if controller is None else ReadMeter(controller)

    def fetch(self, group: GroupFetch, ready, stopped: Callable[[], bool],
              deliver: Callable[[Delivery], None] | None = None,
              later: Callable[..., None] | None = None,
              claim: Callable[[], bool] | None = None) -> Delivery:
        """The group's records, concatenated on the device; stops early once ``stopped()``.

        ``deliver(delivery)``, when given, is called as soon as the block is assembled. What the
        store learns from the fetch comes after it, off the consumer's critical path: the held
        records are ranked anew by this read, and those read from disk get host copies. Measured
        at 8K on the CPU (``bench.decode``'s ``tierkv`` case), that bookkeeping took ~11 ms of
        the fetch threads' ~44 ms a step, and every group's fetch is waited for within ~2 ms of
        its submission (a filter layer chooses just before the layers that read its choice).
        ``later(fn, *args)``, when given, runs that bookkeeping instead (on another thread).
        ``claim()``, when given, is asked right before the block is put on the device: False
        stops the fetch there (CancelledError), as ``stopped()`` does.
        """
        start = time.perf_counter()
        try:
            parts, on_disk = self._resident(group)
            if on_disk:
                self._from_disk(group, on_disk, parts, stopped)
            _check_alike(group, parts, on_disk)
            _raise_if(stopped)
            if claim is not None and not claim():
                raise CancelledError()
            copy_start = time.perf_counter()
            delivery = self.transfer.assemble(
                parts, ready, lambda block: self._admit(group, parts, on_disk, block), group.spare,
                group.packed)
            copy_s = time.perf_counter() - copy_start
            self.metrics.record_stage("copy", copy_s)
            if self.controller is not None and isinstance(delivery.block, KVBlock):
                self.controller.observe_copy(delivery.block.nbytes, copy_s)
        finally:
            self.metrics.record_fetch(time.perf_counter() - start)
        if deliver is not None:
            deliver(delivery)
        if later is not None:
            later(self._learn, group, parts, on_disk)
        else:
            self._learn(group, parts, on_disk)
        return delivery

    def _resident(self, group: GroupFetch) -> tuple[list[KVBlock | None], list[int]]:
        """Blocks found in the device cache, device tier or host tier; indices left on disk.

        Each lookup takes its lock once for the whole group (dozens of records a step)."""
        keys = group.keys
        parts = self.cache.get_many(keys, group.importance, _priority(group))
        sources = ["cache" if part is not None else "disk" for part in parts]
        missing = [i for i, part in enumerate(parts) if part is None]
        if missing:
            for i, (block, where) in zip(missing, self.store.locate([keys[i] for i in missing])):
                if where is None:
                    raise FetchError(group.group, keys[i], "not held by any tier (unknown record)")
                parts[i], sources[i] = block, where
        held = [i for i, part in enumerate(parts) if part is not None]
        if held:  # a held record spans its key's tokens (checked as it was put): bytes by tokens
            first = parts[held[0]]
            per_token = first.nbytes // first.keys.shape[2]
            self.metrics.record_deliveries([sources[i] for i in held],
                                           [keys[i].tokens * per_token for i in held])
        return parts, [i for i, part in enumerate(parts) if part is None]

    def refresh(self, group: GroupFetch) -> None:
        """Rank ``group``'s records anew as a fetch of them would (device cache, then store),
        without reading them: its consumer still holds them from its last read of them."""
        self.cache.touch_many(group.keys, group.importance, _priority(group))
        self._learn(group, [], [])

    def _learn(self, group: GroupFetch, parts: list[KVBlock], on_disk: list[int]) -> None:
        """Rank the records this read found anew, so the host keeps what decode reads, then
        keep host copies of those read from disk (room made from less important records)."""
        read = set(on_disk)
        self.store.touch((key, rank) for i, (key, rank) in enumerate(zip(group.keys, group.importance))
                         if i not in read)
        for i in on_disk:
            self.store.promote(group.keys[i], parts[i], group.importance[i])

    def _from_disk(self, group: GroupFetch, on_disk: list[int], parts: list, stopped) -> None:
        keys = [group.keys[i] for i in on_disk]
        raws = self._read(group.group, keys)
        for i, raw in zip(on_disk, raws):
            _raise_if(stopped)
            if raw.key != group.keys[i]:
                raise FetchError(group.group, group.keys[i], f"disk returned {raw.key} instead")
            parts[i] = self._decode(group.group, group.keys[i], raw)

    def _read(self, group: int, keys: list[RecordKey]) -> list:
        start = time.perf_counter()
        if self.meter is not None:
            self.meter.begin()
        raws = []
        try:
            raws = self.disk.read_raw_many(keys)
            if not isinstance(raws, list):
                raise FetchError(group, keys[0], f"disk returned {type(raws).__name__}, not a "
                                 "list of records")
        except FetchError:
            raws = []
            raise
        except READ_ERRORS as exc:
            raws = []
            self._blame(group, keys, exc)
        finally:
            if self.meter is not None:
                self.meter.end(sum(len(raw.payload) for raw in raws))
        self.metrics.record_stage("read", time.perf_counter() - start)
        if len(raws) != len(keys):
            raise FetchError(group, keys[0], f"disk returned {len(raws)} records for {len(keys)}")
        return raws

    def _blame(self, group: int, keys: list[RecordKey], exc: Exception):
        """Raise a FetchError naming the record of a failed batch (re-read one by one)."""
        reason = _describe(exc)
        if len(keys) > 1:
            for key in keys:
                try:
                    self.disk.read_raw_many([key])
                except READ_ERRORS as single:
                    raise FetchError(group, key, _describe(single)) from single
            reason += f" (batch of {len(keys)} records from this one; each alone read fine)"
        raise FetchError(group, keys[0], reason) from exc

    def _decode(self, group: int, key: RecordKey, raw) -> KVBlock:
        start = time.perf_counter()
        try:
            block = self.disk.decode(raw)
        except READ_ERRORS as exc:
            raise FetchError(group, key, _describe(exc)) from exc
        seconds = time.perf_counter() - start
        codec = codec_name(raw.codec)
        self.metrics.record_stage("decode", seconds)
        self.metrics.record_disk(codec, len(raw.payload))
        self.metrics.record_delivery("disk", block.nbytes)
        if self.controller is not None:
            self.controller.observe_decode(codec, block.nbytes, len(raw.payload), seconds)
        return block

    def _admit(self, group: GroupFetch, parts: list[KVBlock], fetched: list[int],
               out: KVBlock | Scattered) -> None:
        """Offer the records just read from disk to the device cache (the tier copies them)."""
        if not fetched:
            return
        if isinstance(out, Scattered):  # the parts themselves, on the CPU device
            for i in fetched:
                self.cache.admit(group.keys[i], parts[i], group.importance[i], _priority(group))
            return
        offsets = list(itertools.accumulate((part.keys.shape[2] for part in parts), initial=0))
        for i in fetched:
            a, b = offsets[i], offsets[i + 1]
            view = KVBlock(out.keys[:, :, a:b], out.values[:, :, a:b])
            self.cache.admit(group.keys[i], view, group.importance[i], _priority(group))


def _priority(group: GroupFetch) -> int:
    """Cache priority: the first group of a plan is fetched with no compute to hide behind."""
    return 1 if group.position == 0 else 0


def codec_name(codec) -> str:
    """The name of a codec given by name or by its on-disk id."""
    return codec if isinstance(codec, str) else codec_name_by_id(codec)


def _check_alike(group: GroupFetch, parts: list[KVBlock], decoded: list[int]) -> None:
    """FetchError unless the ``decoded`` parts (read from disk) are well-formed blocks spanning
    their records, and every part has the first one's layers, heads, head_dim and dtype. Parts
    from the tiers were checked as they were put."""
    for i in decoded:
        try:
            parts[i].check(group.keys[i])
        except ValueError as exc:
            raise FetchError(group.group, group.keys[i], str(exc)) from None
    first = parts[0].keys
    layout = first.shape[:2], first.shape[3], first.dtype
    for key, part in zip(group.keys, parts):
        k = part.keys
        if (k.shape[:2], k.shape[3], k.dtype) != layout:
            raise FetchError(group.group, key,
                             f"shape {tuple(k.shape)} {k.dtype} differs from "
                             f"{group.keys[0]}'s {tuple(first.shape)} {first.dtype}")


def _raise_if(stopped: Callable[[], bool]) -> None:
    if stopped():
        raise CancelledError()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
