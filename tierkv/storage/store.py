"""KVStore: the device, host and disk tiers together, without a model.

New records go to the host tier; when it is full the coldest host records (lowest importance,
then oldest) spill to disk, and a new record less important than every host record goes to disk
itself. A record is always in at least one tier: a spill writes the disk copy before it drops the
host copy, and a failed disk write leaves the host copy where it was.

The codec of a disk write is, first match wins: the one given to ``put``; the config's when it
names one (``CodecConfig.codec != "auto"``); the compression controller's choice, when one is
attached, for the record's size and coldness; else the disk tier's default. A record is *cold*
when it is among the ``CodecConfig.cold_fraction`` least important records the store holds
(see ``Ranking.is_cold``): only cold records may get a lossy codec, and only with
``allow_lossy``.
"""
from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from pathlib import Path
from typing import Mapping

import torch

from ..config import CODECS, LOSSY_CODECS, TierConfig
from ..shapes import KVShape
from .base import KVBlock, RecordKey, TierFullError, check_put
from .device import DeviceTier
from .disk import DiskTier
from .host import HostTier
from .ranking import Ranking


class KVStore:
    """Three budgeted tiers holding ``RecordKey -> KVBlock``.

    Parameters
    ----------
    shape : the model's KV shape; blocks must have its kv_heads, head_dim and dtype and at most
        its layers.
    config : budgets, disk directory, device, codec.
    controller : chooses the codec of each disk write when ``config.codec.codec`` is "auto":
        a ``tierkv.pipeline.CompressionController`` (anything with ``candidates`` and
        ``choose_for(block, cold) -> codec name or None``), whose candidates must lie within
        ``config.codec.candidates``. A Pipeline over this store feeds it its measurements.
    disk : the disk tier of ``config.disk_dir`` already opened (``open_disk(config)``: opening
        one directory twice reads its manifest twice), which the store then owns.

    Attributes ``device``, ``host`` and ``disk`` are the tiers (``disk`` is None without
    ``config.disk_dir``). ``put`` never touches ``device``: the fetch pipeline manages it.
    """

    def __init__(self, shape: KVShape, config: TierConfig, controller=None,
                 disk: DiskTier | None = None):
        if not isinstance(shape, KVShape) or not isinstance(config, TierConfig):
            raise ValueError("KVStore(shape, config): expected a KVShape and a TierConfig")
        if disk is not None and (config.disk_dir is None
                                 or disk.path.resolve() != Path(config.disk_dir).resolve()):
            raise ValueError(f"disk={disk.path}: not config.disk_dir ({config.disk_dir})")
        self.shape, self.config = shape, config
        self.controller = _check_controller(controller, config)
        self.device = DeviceTier(config.device_budget, config.torch_device)
        # Page-locked host memory only speeds copies to a GPU; with the device tier in CPU memory
        # it would only take RAM that cannot be swapped.
        self.host = HostTier(config.host_budget, pin=self.device.device.type == "cuda")
        self.disk = open_disk(config) if disk is None else disk
        if self.disk is not None:
            self._check_stored()
        self._ranks = Ranking()
        self._codecs: dict[RecordKey, str | None] = {}
        self._clean: set[RecordKey] = set()  # host copies whose disk copy is current
        self._late: deque[tuple[RecordKey, float]] = deque()  # reads to rank (``touch``)
        self._lock = threading.RLock()

    # -- writing ------------------------------------------------------------------------
    def put(self, key: RecordKey, block: KVBlock, importance: float = 0.0,
            codec: str | None = None) -> None:
        """Store ``block`` in the host tier, spilling colder host records to disk as needed.

        block : KVBlock, keys and values of shape (layers <= shape.layers, kv_heads, tokens,
            head_dim). ``importance`` orders spilling and coldness (higher = hotter). ``codec``,
            when given, is the codec used if the record goes to disk (see the module docstring).
        Raises TierFullError (nothing changed) when the host is full and there is no disk.
        """
        self.put_many({key: block}, {key: importance}, codec)

    def put_many(self, blocks: Mapping[RecordKey, KVBlock],
                 importance: Mapping[RecordKey, float] | None = None,
                 codec: str | None = None) -> None:
        """``put`` of every record of ``blocks`` (importance 0 where ``importance`` has none),
        all ranked before any is placed: the coldness of each is judged against the whole batch
        and the records already stored, not only against the records put before it.

        Records are placed in order; on an error the records before the failing one are stored.
        """
        if not isinstance(blocks, Mapping) or not isinstance(importance or {}, Mapping):
            raise ValueError("put_many(blocks, importance): expected mappings of RecordKey")
        importance = importance or {}
        items = [(key, block, _importance(importance.get(key, 0.0))) for key, block in
                 blocks.items()]
        for key, block, _ in items:
            self._check(key, block)
        self._check_codec(codec)
        if codec in LOSSY_CODECS:  # found now, not when a later spill writes it
            bad = next((key for key, block, _ in items if not _finite(block)), None)
            if bad is not None:
                raise ValueError(f"block of {bad}: holds NaN or inf, which codec={codec!r} "
                                 "cannot store; use a lossless codec")
        with self._lock:
            for key, _, value in items:
                self._codecs[key] = codec
                self._ranks.set(key, value)
                self._clean.discard(key)
            for i, (key, block, _) in enumerate(items):
                try:
                    self._place(key, block)
                except BaseException:
                    self._forget_absent([key for key, _, _ in items[i:]])
                    raise

    def _place(self, key: RecordKey, block: KVBlock) -> None:
        self.device.remove(key)
        if block.nbytes > self.host.budget:
            self._to_disk(key, block)
            return
        if not self._make_room(key, block.nbytes):
            self._to_disk(key, block)
            return
        try:
            self.host.put(key, block)
        except TierFullError:
            self._to_disk(key, block)

    def _forget_absent(self, keys: list[RecordKey]) -> None:
        """Drop the rank and codec of those ``keys`` that no tier holds (a failed put)."""
        for key in keys:
            if self.where(key) is None:
                self._ranks.discard(key)
                self._codecs.pop(key, None)

    def _check(self, key: RecordKey, block: KVBlock) -> None:
        check_put(key, block)
        layers, heads, _, dim = block.keys.shape
        s = self.shape
        if layers > s.layers or heads != s.kv_heads or dim != s.head_dim \
                or block.keys.dtype != s.dtype:
            raise ValueError(f"block of {key}: shape {tuple(block.keys.shape)} {block.keys.dtype} "
                             f"does not fit KVShape(layers={s.layers}, kv_heads={s.kv_heads}, "
                             f"head_dim={s.head_dim}, dtype={s.dtype})")

    def _check_stored(self) -> None:
        """ValueError (the directory closed, nothing changed) when the disk tier holds records
        that do not fit ``shape``: read back, they would be blocks of another shape."""
        s = self.shape
        for (layers, heads, dim, dtype), docs in self.disk.record_shapes().items():
            if layers > s.layers or heads != s.kv_heads or dim != s.head_dim or dtype != s.dtype:
                self.disk.close()
                raise ValueError(
                    f"{self.config.disk_dir}: the records of {', '.join(map(repr, sorted(docs)[:5]))} "
                    f"are {layers} layers x {heads} KV heads x head_dim {dim}, {dtype}, which do not "
                    f"fit KVShape(layers={s.layers}, kv_heads={s.kv_heads}, head_dim={s.head_dim}, "
                    f"dtype={s.dtype}): open it with the shape it was written with, or use another "
                    "directory")

    def _check_codec(self, codec: str | None) -> None:
        if codec is None:
            return
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r}: must be None or one of {', '.join(CODECS)}")
        if codec in LOSSY_CODECS and not self.config.codec.allow_lossy:
            raise ValueError(f"codec={codec!r} is lossy: the store's CodecConfig has "
                             "allow_lossy=False")

    def _make_room(self, key: RecordKey, nbytes: int) -> bool:
        """Spill host records no hotter than ``key`` (ties: the older first) until ``nbytes``
        for it fit; False once only hotter ones are left (``key`` then goes to disk)."""
        need = nbytes - (self.host.size_of(key) if key in self.host else 0)
        if self.host.fits(need):
            return True
        if self.disk is None:
            raise TierFullError(f"host tier full ({self.host.used} of {self.host.budget} B) and "
                                "no disk tier configured")
        self._rerank()
        importance = self._ranks.importance(key)
        while not self.host.fits(need):
            victim = self._ranks.coldest(self.host, exclude=key)
            if victim is None:
                return True
            if self._ranks.importance(victim) > importance:
                return False
            self._spill(victim)
        return True

    def _spill(self, key: RecordKey) -> None:
        if key in self._clean:  # promoted from disk: its disk copy is current
            self._clean.discard(key)
            self.host.remove(key)
            return
        block = self.host.get(key)
        self.disk.put(key, block, codec=self.disk_codec(key, block))
        self.host.remove(key)

    def promote(self, key: RecordKey, block: KVBlock, importance: float) -> bool:
        """Keep a host copy of ``block``, just read from disk for ``key``, if room can be made
        from host records strictly less important; whether it was kept.

        The host tier then caches the hottest disk records too: the next read is a memory copy.
        The disk copy stays, so giving the host copy up later costs no write. ``importance``
        re-ranks the record (e.g. the step that last read it).
        """
        importance = _importance(importance)
        with self._lock:
            if self.disk is None or key in self.host or key not in self.disk \
                    or block.nbytes > self.host.budget:
                return False
            self._rerank()
            while not self.host.fits(block.nbytes):
                victim = self._ranks.coldest(self.host, exclude=key)
                if victim is None or self._ranks.importance(victim) >= importance:
                    return False
                self._spill(victim)
            self.host.put(key, block.to("cpu"))
            self._ranks.set(key, importance)
            self._clean.add(key)
            return True

    def _to_disk(self, key: RecordKey, block: KVBlock) -> None:
        if self.disk is None:
            raise TierFullError(f"{key} ({block.nbytes} B) does not fit the host tier and no disk "
                                "tier is configured")
        self.disk.put(key, block, codec=self.disk_codec(key, block))
        self.host.remove(key)

    def disk_codec(self, key: RecordKey, block: KVBlock) -> str | None:
        """The codec to write ``key``'s ``block`` to disk with (module docstring); None: the disk
        tier's default. Writers outside the store (``TieredCache.save``) ask it too."""
        codec = self._codecs.get(key)
        if codec is not None:
            return codec  # put with it: a lossy one was refused then for NaN or inf
        if self.controller is not None and self.config.codec.codec == "auto":
            cold = self._ranks.is_cold(key, self.config.codec.cold_fraction)
            codec = self.controller.choose_for(block, cold)
        if (codec or self.config.codec.codec) in LOSSY_CODECS and not _finite(block):
            return "zstd"  # a lossy codec cannot store NaN or inf; losslessly, then
        return codec

    def set_importance(self, key: RecordKey, value: float) -> None:
        """Set the importance that orders spilling (lowest spills first); KeyError if absent."""
        with self._lock:
            if self.where(key) is None:
                raise KeyError(key)
            self._ranks.set(key, _importance(value))

    def touch(self, ranks) -> None:
        """Raise held records read just now to the importance of that read: ``ranks`` is
        (RecordKey, importance) pairs. A rank is never lowered: a pinned record stays pinned,
        and a read without an importance of its own (0) changes nothing.

        Without it a record read from the host every step keeps the rank it entered with and
        spills before the records promoted after it (first in, first out, not least recently
        read). Keys no tier holds any more are skipped. The fetch pipeline's threads call this:
        while the store is busy (a spill writing to disk) the pairs wait, in order, for the
        next decision they bear on (a touch, a spill, a promotion), not the thread.
        """
        self._late.extend((key, _importance(value)) for key, value in ranks)
        if self._lock.acquire(blocking=False):
            try:
                self._rerank()
            finally:
                self._lock.release()

    def _rerank(self) -> None:
        """Apply the touches waiting in ``_late`` (under ``_lock``)."""
        pairs = []
        while self._late:  # popleft, not a copy: the fetch threads may be appending
            pairs.append(self._late.popleft())
        self._ranks.raise_many(pairs)

    # -- reading ------------------------------------------------------------------------
    def _tiers(self):
        return [t for t in (self.device, self.host, self.disk) if t is not None]

    def _check_open(self) -> None:
        self.host._check_open()  # the tiers close together; StorageError once they have

    def where(self, key: RecordKey) -> str | None:
        """"device", "host", "disk" (the fastest tier holding ``key``) or None."""
        self._check_open()
        for tier in self._tiers():
            if key in tier:
                return tier.name
        return None

    def locate(self, keys) -> list[tuple[KVBlock | None, str | None]]:
        """``where`` and ``get`` of many keys, each memory tier's lock taken once: for each key,
        ``(block, "device" | "host")`` (the stored tensors: read-only), ``(None, "disk")`` when
        only the disk holds it, ``(None, None)`` when no tier does.

        A record moving meanwhile is found where it went: a spill writes the disk copy before
        it drops the host one, and a promotion keeps the disk copy."""
        self._check_open()
        found: list[tuple[KVBlock | None, str | None]] = [(None, None)] * len(keys)
        left = range(len(keys))
        for tier in (self.device, self.host):
            if tier is None or not left:
                continue
            blocks = tier.lookup_many([keys[i] for i in left])
            for i, block in zip(left, blocks):
                if block is not None:
                    found[i] = (block, tier.name)
            left = [i for i, block in zip(left, blocks) if block is None]
        if self.disk is not None:
            for i in left:
                if keys[i] in self.disk:
                    found[i] = (None, "disk")
        return found

    def get(self, key: RecordKey) -> KVBlock:
        """The block of ``key`` from the fastest tier holding it (device/host blocks are the
        stored tensors: read-only). KeyError when absent."""
        for tier in self._tiers():
            try:
                return tier.get(key)
            except KeyError:
                continue
        raise KeyError(key)

    def fetch(self, keys, device: torch.device | str) -> list[KVBlock]:
        """The blocks of ``keys`` copied onto ``device``, in order; disk reads are batched."""
        if isinstance(keys, RecordKey):
            raise ValueError(f"fetch: keys={keys!r} is one key; pass a list of RecordKeys")
        keys = list(keys)
        bad = next((k for k in keys if not isinstance(k, RecordKey)), None)
        if bad is not None:
            raise ValueError(f"fetch: {bad!r} is not a RecordKey")
        device = _fetch_device(device)
        out: list[KVBlock | None] = [None] * len(keys)
        on_disk = []
        for i, key in enumerate(keys):
            for tier in (self.device, self.host):
                try:
                    out[i] = tier.get(key).to(device, non_blocking=tier.name == "host")
                    break
                except KeyError:
                    continue
            else:
                on_disk.append(i)
        if on_disk:
            if self.disk is None:
                raise KeyError(keys[on_disk[0]])
            for i, block in zip(on_disk, self.disk.get_many([keys[i] for i in on_disk])):
                out[i] = block.to(device)
        return out

    # -- removing and the rest ----------------------------------------------------------
    def remove(self, key: RecordKey, keep_disk: bool = False) -> bool:
        """Forget ``key`` in every tier (with ``keep_disk``, in the device and host tiers only:
        its disk copy stays, e.g. a saved document's record a live cache no longer reads);
        whether it was stored."""
        with self._lock:
            self._check_open()
            self._ranks.discard(key)
            self._codecs.pop(key, None)
            self._clean.discard(key)
            tiers = [t for t in self._tiers() if not (keep_disk and t is self.disk)]
            return sum(bool(tier.remove(key)) for tier in tiers) > 0

    def delete_doc(self, doc: str) -> None:
        """Forget every record (and the disk metadata) of document ``doc``."""
        with self._lock:
            for tier in (self.device, self.host):
                tier.remove_many([k for k in tier.keys() if k.doc == doc])
            for key in [k for k in self._ranks.keys() if k.doc == doc]:
                self._ranks.discard(key)
                self._clean.discard(key)
                self._codecs.pop(key, None)
            if self.disk is not None:
                self.disk.delete_doc(doc)

    def stats(self) -> dict:
        """Bytes and records per tier, and the disk tier's bytes read / written."""
        self._check_open()
        out = {}
        for tier in self._tiers():
            out[f"{tier.name}_bytes"] = tier.used
            out[f"{tier.name}_records"] = len(tier)
        out["disk_bytes_read"] = self.disk.bytes_read if self.disk else 0
        out["disk_bytes_written"] = self.disk.bytes_written if self.disk else 0
        return out

    def close(self) -> None:
        """Close the tiers (the disk tier flushes its manifest)."""
        for tier in self._tiers():
            tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_disk(config: TierConfig) -> DiskTier | None:
    """The disk tier ``config`` describes, opened (None without ``config.disk_dir``)."""
    return None if config.disk_dir is None else DiskTier(
        config.disk_dir, codec=config.codec, segment_size=config.segment_size,
        io_threads=config.io_threads, budget=config.disk_budget, direct_io=config.direct_io)


def _importance(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"importance={value!r}: must be a number (not NaN)")
    return float(value)


def _check_controller(controller, config: TierConfig):
    """``controller`` if it can choose codecs within ``config.codec``; ValueError otherwise."""
    if controller is None:
        return None
    if not callable(getattr(controller, "choose_for", None)) \
            or not hasattr(controller, "candidates"):
        raise ValueError(f"controller={controller!r}: expected a CompressionController "
                         "(with candidates and choose_for)")
    floor = config.codec
    outside = [c for c in controller.candidates if c not in floor.candidates]
    if floor.codec == "auto" and outside:
        raise ValueError(f"controller candidates {outside} are outside the config's "
                         f"{list(floor.candidates)}: lossy codecs need allow_lossy=True")
    return controller


def _fetch_device(device) -> torch.device:
    """``device`` as a torch.device a fetch can copy to; ValueError naming what is wrong."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"fetch: device={device!r} is not a device (e.g. 'cpu', 'cuda:0')") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"fetch: device={device}: only 'cpu' and 'cuda' devices are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"fetch: device={device}: CUDA is not available on this machine")
    return device


def _finite(block: KVBlock) -> bool:
    return bool(torch.isfinite(block.keys).all()) and bool(torch.isfinite(block.values).all())
