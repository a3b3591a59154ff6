"""Hot records kept on the device between decode steps, inside the device tier and its budget.

The blocks live in the store's device tier itself, so its budget bounds them, ``store.where``
reports them as "device", and a record the store rewrites or removes (``KVStore.put`` drops the
device copy) is never served stale. The cache adds what the tier lacks: which of its records it
may evict, ranked by priority, importance, then age.
"""
from __future__ import annotations

import itertools
import threading

from tierkv.storage.base import KVBlock, RecordKey, StorageError, Tier


class DeviceCache:
    """Admission and eviction of fetched records in a device ``Tier`` (``store.device``).

    Records rank by ``(priority, importance, last use)``. A new record may only displace records
    the cache admitted that rank lower on priority and importance, or equal and older (least
    recently used first). When that cannot make room it is not admitted and nothing is evicted.
    Records others put in the tier are never evicted. The pipeline gives priority 1 to the first
    group of a plan: its fetch has no compute to hide behind.

    Parameters
    ----------
    tier : the device tier; its ``budget`` bounds the cache and everything else it holds.
    """

    def __init__(self, tier: Tier):
        if not isinstance(tier, Tier):
            raise ValueError(f"tier={tier!r}: expected a storage Tier (the store's device tier)")
        self.tier = tier
        self._rank: dict[RecordKey, tuple[int, float, int]] = {}
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def used(self) -> int:
        """Bytes of the tier held by records the cache admitted."""
        with self._lock:
            return sum(self.tier.size_of(k) for k in self._rank if k in self.tier)

    def __len__(self) -> int:
        return sum(1 for k in list(self._rank) if k in self.tier)

    def __contains__(self, key: RecordKey) -> bool:
        return key in self._rank and key in self.tier

    def get(self, key: RecordKey, importance: float | None = None,
            priority: int | None = None) -> KVBlock | None:
        """The cached block (a hit refreshes its age and what is given of its importance and
        priority) or None."""
        with self._lock:
            if key not in self._rank:
                self.misses += 1
                return None
            try:
                block = self.tier.get(key)
            except (KeyError, StorageError):  # dropped by the store (rewritten, removed)
                del self._rank[key]
                self.misses += 1
                return None
            self.hits += 1
            old_priority, old_importance, _ = self._rank[key]
            self._rank[key] = (old_priority if priority is None else priority,
                               old_importance if importance is None else importance,
                               next(self._clock))
            return block

    def admit(self, key: RecordKey, block: KVBlock, importance: float, priority: int = 0) -> bool:
        """Copy ``block`` into the tier if room can be made; return whether it is cached."""
        with self._lock:
            if key in self._rank and key in self.tier:
                return True
            victims = self._victims(block.nbytes, (priority, importance))
            if victims is None:
                return False
            for victim in victims:
                self._evict(victim)
            try:
                self.tier.put(key, block)
            except StorageError:  # TierFullError: the tier filled up meanwhile; a closed tier
                return False
            self._rank[key] = (priority, importance, next(self._clock))
            return True

    def reserve(self, tag: str, nbytes: int) -> None:
        """Reserve ``nbytes`` of the tier under ``tag`` (``Tier.reserve``), first evicting the
        lowest-ranked cached records if that is what it takes: the decode working set comes
        before cached chunks. Atomic with admissions (same lock), so a worker cannot take the
        room back in between. TierFullError when even an empty cache leaves too little."""
        with self._lock:
            held = self.tier.reserved_for(tag)
            budget = self.tier.budget
            if budget is not None and budget - self.tier.used + held < nbytes:
                for key, _ in sorted(self._rank.items(), key=lambda item: item[1]):
                    if budget - self.tier.used + held >= nbytes:
                        break
                    self._evict(key)
            self.tier.reserve(tag, nbytes)

    def clear(self) -> None:
        """Evict every record the cache admitted."""
        with self._lock:
            for key in list(self._rank):
                self._evict(key)

    def _victims(self, need: int, rank: tuple[int, float]) -> list[RecordKey] | None:
        """Lowest-ranked cache records to evict so ``need`` bytes fit, all ranked below the
        newcomer; None when impossible."""
        if self.tier.budget is None:
            return []
        room = self.tier.budget - self.tier.used
        victims = []
        for key, entry in sorted(self._rank.items(), key=lambda item: item[1]):
            if room >= need:
                break
            if entry[:2] > rank or key not in self.tier:
                continue
            victims.append(key)
            room += self.tier.size_of(key)
        return victims if room >= need else None

    def _evict(self, key: RecordKey) -> None:
        del self._rank[key]
        self.tier.remove(key)
