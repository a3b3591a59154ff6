"""KVStore: the device, host and disk tiers together, without a model.

New records go to the host tier; when it is full the coldest host records (lowest importance,
then oldest) spill to disk. A record is always in at least one tier: a spill writes the disk copy
before it drops the host copy, and a failed disk write leaves the host copy where it was.
"""
from __future__ import annotations

import heapq
import itertools
import threading

import torch

from ..config import TierConfig
from ..shapes import KVShape
from .base import KVBlock, RecordKey, TierFullError
from .device import DeviceTier
from .disk import DiskTier
from .host import HostTier


class KVStore:
    """Three budgeted tiers holding ``RecordKey -> KVBlock``.

    Parameters
    ----------
    shape : the model's KV shape; blocks must have its kv_heads, head_dim and dtype and at most
        its layers.
    config : budgets, disk directory, device, codec.

    Attributes ``device``, ``host`` and ``disk`` are the tiers (``disk`` is None without
    ``config.disk_dir``). ``put`` never touches ``device``: the fetch pipeline manages it.
    """

    def __init__(self, shape: KVShape, config: TierConfig):
        if not isinstance(shape, KVShape) or not isinstance(config, TierConfig):
            raise ValueError("KVStore(shape, config): expected a KVShape and a TierConfig")
        self.shape, self.config = shape, config
        self.device = DeviceTier(config.device_budget, config.torch_device)
        self.host = HostTier(config.host_budget)
        self.disk = None if config.disk_dir is None else DiskTier(
            config.disk_dir, codec=config.codec, segment_size=config.segment_size,
            io_threads=config.io_threads, budget=config.disk_budget)
        self._rank: dict[RecordKey, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, RecordKey]] = []
        self._codecs: dict[RecordKey, str] = {}
        self._tick = itertools.count()
        self._lock = threading.RLock()

    # -- writing ------------------------------------------------------------------------
    def put(self, key: RecordKey, block: KVBlock, importance: float = 0.0,
            codec: str | None = None) -> None:
        """Store ``block`` in the host tier, spilling colder host records to disk as needed.

        block : KVBlock, keys and values of shape (layers <= shape.layers, kv_heads, tokens,
            head_dim). ``codec`` is the codec used if the record goes to disk.
        Raises TierFullError (nothing changed) when the host is full and there is no disk.
        """
        self._check(key, block)
        with self._lock:
            self._codecs[key] = codec
            self._set_rank(key, float(importance))
            self.device.remove(key)
            if block.nbytes > self.host.budget:
                self._to_disk(key, block)
                return
            self._make_room(key, block.nbytes)
            try:
                self.host.put(key, block)
            except TierFullError:
                self._to_disk(key, block)

    def _check(self, key: RecordKey, block: KVBlock) -> None:
        if not isinstance(key, RecordKey):
            raise ValueError(f"key={key!r}: expected a RecordKey")
        block.check(key)
        layers, heads, _, dim = block.keys.shape
        s = self.shape
        if layers > s.layers or heads != s.kv_heads or dim != s.head_dim \
                or block.keys.dtype != s.dtype:
            raise ValueError(f"block of {key}: shape {tuple(block.keys.shape)} {block.keys.dtype} "
                             f"does not fit KVShape(layers={s.layers}, kv_heads={s.kv_heads}, "
                             f"head_dim={s.head_dim}, dtype={s.dtype})")

    def _make_room(self, key: RecordKey, nbytes: int) -> None:
        need = nbytes - (self.host.size_of(key) if key in self.host else 0)
        if self.host.fits(need):
            return
        if self.disk is None:
            raise TierFullError(f"host tier full ({self.host.used} of {self.host.budget} B) and "
                                "no disk tier configured")
        while not self.host.fits(need):
            victim = self._coldest(exclude=key)
            if victim is None:
                return
            self._spill(victim)

    def _coldest(self, exclude: RecordKey) -> RecordKey | None:
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            importance, tick, key = entry
            if self._rank.get(key) != (importance, tick) or key not in self.host:
                continue
            if key == exclude:
                skipped.append(entry)
                continue
            found = key
            skipped.append(entry)
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def _spill(self, key: RecordKey) -> None:
        self.disk.put(key, self.host.get(key), codec=self._codecs.get(key))
        self.host.remove(key)

    def _to_disk(self, key: RecordKey, block: KVBlock) -> None:
        if self.disk is None:
            raise TierFullError(f"{key} ({block.nbytes} B) does not fit the host tier and no disk "
                                "tier is configured")
        self.disk.put(key, block, codec=self._codecs.get(key))
        self.host.remove(key)

    def _set_rank(self, key: RecordKey, importance: float) -> None:
        rank = (importance, next(self._tick))
        self._rank[key] = rank
        heapq.heappush(self._heap, (*rank, key))

    def set_importance(self, key: RecordKey, value: float) -> None:
        """Set the importance that orders spilling (lowest spills first); KeyError if absent."""
        with self._lock:
            if self.where(key) is None:
                raise KeyError(key)
            self._set_rank(key, float(value))

    # -- reading ------------------------------------------------------------------------
    def _tiers(self):
        return [t for t in (self.device, self.host, self.disk) if t is not None]

    def where(self, key: RecordKey) -> str | None:
        """"device", "host", "disk" (the fastest tier holding ``key``) or None."""
        for tier in self._tiers():
            if key in tier:
                return tier.name
        return None

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
        keys = list(keys)
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
    def remove(self, key: RecordKey) -> bool:
        """Forget ``key`` in every tier; whether it was stored."""
        with self._lock:
            self._rank.pop(key, None)
            self._codecs.pop(key, None)
            return sum(bool(tier.remove(key)) for tier in self._tiers()) > 0

    def delete_doc(self, doc: str) -> None:
        """Forget every record (and the disk metadata) of document ``doc``."""
        with self._lock:
            for tier in (self.device, self.host):
                tier.remove_many([k for k in tier.keys() if k.doc == doc])
            for key in [k for k in self._rank if k.doc == doc]:
                del self._rank[key]
                self._codecs.pop(key, None)
            if self.disk is not None:
                self.disk.delete_doc(doc)

    def stats(self) -> dict:
        """Bytes and records per tier, and the disk tier's bytes read / written."""
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
