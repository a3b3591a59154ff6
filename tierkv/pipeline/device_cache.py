"""Hot records kept on the device between decode steps, inside the device tier and its budget.

The blocks live in the store's device tier itself, so its budget bounds them, ``store.where``
reports them as "device", and a record the store rewrites or removes (``KVStore.put`` drops the
device copy) is never served stale. The cache adds what the tier lacks: which of its records it
may evict, ranked by priority, importance, then age, and whether admitting pays at all.

Admitting a record costs a copy into the device tier; it pays only if the record is read again
before it is evicted. The cache measures that: the share of its evicted records that were hit
at least once (an EMA). Below ``min_reuse`` it admits only one record in ``probe_every`` (so the
share stays measured and admission resumes when reuse comes back). On a GPU the copy is
device-to-device and a hit saves a host or disk fetch over PCIe, so a few percent reuse pays; on
a CPU "device" the copy costs about what a hit saves from the host tier, and the break-even is
near a quarter (``Pipeline`` picks the threshold by device type).
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
    min_reuse : in [0, 1]; while the measured share of evicted records that were hit is below
        it, only one admission in ``probe_every`` is made (module docstring). 0: always admit.
    probe_every : admissions tried per one made while reuse is too low (>= 1).
    alpha : EMA weight of one eviction's outcome in the measured reuse, in (0, 1].
    """

    def __init__(self, tier: Tier, min_reuse: float = 0.0, probe_every: int = 8,
                 alpha: float = 0.05):
        if not isinstance(tier, Tier):
            raise ValueError(f"tier={tier!r}: expected a storage Tier (the store's device tier)")
        if isinstance(min_reuse, bool) or not isinstance(min_reuse, (int, float)) \
                or not 0 <= min_reuse <= 1:
            raise ValueError(f"min_reuse={min_reuse!r}: must be a number in [0, 1]")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every={probe_every!r}: must be a positive integer")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha!r}: must be in (0, 1]")
        self.tier = tier
        self.min_reuse, self.probe_every, self.alpha = float(min_reuse), probe_every, float(alpha)
        self._rank: dict[RecordKey, tuple[int, float, int]] = {}
        self._used: set[RecordKey] = set()  # admitted records hit since their admission
        self._clock = itertools.count()
        self._tries = itertools.count()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.skipped = 0  # admissions declined because reuse was too low
        self.reuse: float | None = None  # EMA of "an evicted record had been hit"

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
            return self._get(key, importance, priority)

    def get_many(self, keys, importance=None, priority: int | None = None) -> list[KVBlock | None]:
        """``get`` of each of ``keys`` (``importance``: one value per key, or None), under one
        acquisition of the lock: a decode step asks for dozens of records a layer group."""
        importance = [None] * len(keys) if importance is None else importance
        with self._lock:
            if not self._rank:  # nothing admitted (e.g. reuse too low): all misses
                self.misses += len(keys)
                return [None] * len(keys)
            return [self._get(key, value, priority) for key, value in zip(keys, importance)]

    def touch_many(self, keys, importance=None, priority: int | None = None) -> None:
        """Rank those of ``keys`` it holds as ``get_many`` would, for a consumer that still
        holds their blocks from its last read of them (a hit each, no block returned; a key not
        held is no miss: nothing was asked of the cache)."""
        importance = [None] * len(keys) if importance is None else importance
        with self._lock:
            for key, value in zip(keys, importance):
                if key in self._rank and key in self.tier:
                    self._refresh(key, value, priority)

    def _get(self, key: RecordKey, importance: float | None, priority: int | None):
        if key not in self._rank:
            self.misses += 1
            return None
        try:
            block = self.tier.get(key)
        except (KeyError, StorageError):  # dropped by the store (rewritten, removed)
            del self._rank[key]
            self._used.discard(key)
            self.misses += 1
            return None
        self._refresh(key, importance, priority)
        return block

    def _refresh(self, key: RecordKey, importance: float | None, priority: int | None) -> None:
        self.hits += 1
        self._used.add(key)
        old_priority, old_importance, _ = self._rank[key]
        self._rank[key] = (old_priority if priority is None else priority,
                           old_importance if importance is None else importance,
                           next(self._clock))

    def admit(self, key: RecordKey, block: KVBlock, importance: float, priority: int = 0) -> bool:
        """Copy ``block`` into the tier if room can be made; return whether it is cached."""
        with self._lock:
            if key in self._rank and key in self.tier:
                return True
            if self._declines():
                self.skipped += 1
                return False
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
            self._used.discard(key)
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
                self._evict(key, measured=False)

    def _declines(self) -> bool:
        """Whether to skip this admission: reuse measured below ``min_reuse`` and this is not
        one of the probes."""
        if self.reuse is None or self.reuse >= self.min_reuse:
            return False
        return next(self._tries) % self.probe_every != 0

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

    def _evict(self, key: RecordKey, measured: bool = True) -> None:
        del self._rank[key]
        hit = key in self._used
        self._used.discard(key)
        if measured:
            outcome = 1.0 if hit else 0.0
            self.reuse = outcome if self.reuse is None else \
                self.reuse + self.alpha * (outcome - self.reuse)
        self.tier.remove(key)
