"""The importance order of a store's records: which host record spills first, which are cold.

Decode ranks records by the last step that read them (``TieredCache._importance``); a prompt's
records rank between the step before and the next, by the attention its last queries paid them
(``hf/prefill.py``, ``prompt_ranks``). At 8K
on the CPU (``bench.decode``'s ``tierkv`` case, host tier 20 % of the KV) a step reads
~644 records, 55 MB, of which 110-180 were not read the step before, and 40-117 come from disk
(5-8 MB): most of those were read at some earlier step and left the host since, as they drift
in and out of the selection. Their reads (a few ms a group, on the critical path once the
filter layer has chosen) are most of the step's stall (~40 ms of 170). Replayed on a recorded
trace of 48 steps, ranking by the last step and a decayed count of reads (``step + w *
count``, count x 0.9 a step) read 5.1-5.4 MB a step from disk against 6.5 by the last step:
not built (a fifth less of the reads that stall; not measured end to end). Those figures came
before ``tierkv``'s preselection kept the leaves it fetched the step before
(``policies/tierkv.py``, ``PRESELECT_STICKINESS``), which brought the disk reads from 7.4 to
3.9 MB a token at the source.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Container

from .base import RecordKey


class Ranking:
    """Records ranked by importance (higher = hotter), ties by age (older = colder).

    ``coldest`` finds the next record to spill (a heap, stale entries dropped as they surface);
    ``is_cold`` tells whether a record is among the least important share of every ranked record
    (a count of records per importance, over the sorted distinct importances: O(1) to change,
    O(distinct importances) to ask). Decode re-ranks hundreds of records a step and asks only
    when a record is written to disk; a sorted list of every rank (O(n) memmove per change) cost
    3.6 ms per 650 re-ranks among 15,000 records, ~10 ms of a fetch thread's step at 8K.

    Tried and not kept (2026-11-27): raising a layer group's read as one batch (one importance
    for all: ``dict.update``, ``collections.Counter``, a loop of ``heappush``), with levels left
    empty deleted in bulk. Alone (8 groups x 75 reads among 15,200 records a step): 2.05 against
    2.3 ms a step; of that, heap pushes 1.2 and heap rebuilds (``_compact``) 1.2. In
    ``bench.decode``'s 8K case the helper thread's CPU for the re-ranks fell from 2.2 to 1.2 ms
    a step, and the step was no faster: one cache decoding alternate blocks of 8 steps with
    each, 85.4 (batched) against 86.3 ms a token, and 88.6 with no re-ranking at all.
    """

    def __init__(self):
        self._rank: dict[RecordKey, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, RecordKey]] = []
        self._count: dict[float, int] = {}  # ranked records per importance
        self._levels: list[float] = []       # the importances counted, ascending
        self._tick = itertools.count()

    def set(self, key: RecordKey, importance: float) -> None:
        """Rank ``key`` at ``importance``, as the newest record of that importance."""
        self._place(key, importance)
        self._compact()

    def raise_to(self, key: RecordKey, importance: float) -> None:
        """Rank ``key`` at ``importance`` if it is ranked lower now; unranked keys stay so."""
        self.raise_many(((key, importance),))

    def raise_many(self, pairs) -> None:
        """``raise_to`` of each ``(key, importance)`` pair, in order (one call for a step's
        reads: a decode step raises hundreds of records)."""
        ranks = self._rank
        for key, importance in pairs:
            rank = ranks.get(key)
            if rank is not None and importance > rank[0]:
                self._place(key, importance)
        self._compact()

    def _place(self, key: RecordKey, importance: float) -> None:
        self.discard(key)
        rank = self._rank[key] = (importance, next(self._tick))
        heapq.heappush(self._heap, (*rank, key))
        count = self._count.get(importance, 0)
        if not count:
            bisect.insort(self._levels, importance)
        self._count[importance] = count + 1

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._rank) + 1024:  # re-ranked keys left stale entries
            self._heap = [(*r, k) for k, r in self._rank.items()]
            heapq.heapify(self._heap)

    def discard(self, key: RecordKey) -> None:
        rank = self._rank.pop(key, None)
        if rank is None:
            return
        importance = rank[0]
        count = self._count[importance] - 1
        if count:
            self._count[importance] = count
        else:
            del self._count[importance]
            del self._levels[bisect.bisect_left(self._levels, importance)]

    def importance(self, key: RecordKey) -> float:
        """The importance ``key`` was ranked at (KeyError when unranked)."""
        return self._rank[key][0]

    def keys(self) -> list[RecordKey]:
        return list(self._rank)

    def coldest(self, among: Container[RecordKey], exclude: RecordKey) -> RecordKey | None:
        """The lowest-ranked key in ``among`` other than ``exclude``; None if there is none.

        Heap entries of keys no longer in ``among`` are dropped: a key re-enters by ``set``.
        """
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            importance, tick, key = entry
            if self._rank.get(key) != (importance, tick) or key not in among:
                continue
            skipped.append(entry)
            if key != exclude:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def is_cold(self, key: RecordKey, fraction: float) -> bool:
        """Whether ``key`` is among the ``fraction`` least important ranked records.

        Ties count as hotter: a record is cold only if the records at most as important as it
        (itself included) are no more than ``fraction`` of all, so with every importance equal
        (nobody ranked them) no record is cold unless ``fraction`` is 1. Unranked keys are not
        cold.
        """
        rank = self._rank.get(key)
        if rank is None:
            return False
        levels = self._levels[: bisect.bisect_right(self._levels, rank[0])]
        return sum(map(self._count.__getitem__, levels)) <= fraction * len(self._rank)
