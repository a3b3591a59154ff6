"""The records that store a chunk tree's leaves (``tree.ChunkTree``).

Records (opaque handles with a token range) tile the sealed tokens ``[0, n)`` on their own,
apart from the leaves. After a merge or a split, leaves and records differ; ``records_for`` tells
which records to fetch for some leaves (the caller slices), and ``pending_rewrites`` lists the
record rewrites that make records follow the leaves again (never below ``config.base`` tokens:
smaller leaves share a record), for the storage to do when idle and ``commit_rewrite``.
"""
from __future__ import annotations

from typing import Hashable, NamedTuple

import torch


class RecordRef(NamedTuple):
    """A stored payload: an opaque ``handle`` holding tokens ``[start, end)``."""

    handle: Hashable
    start: int
    end: int


class Rewrite(NamedTuple):
    """Rewrite the records ``old`` (contiguous) as new records cut at ``cuts``."""

    old: tuple[RecordRef, ...]
    cuts: tuple[int, ...]


class LeafRecords:
    """The record side of a ``ChunkTree``: its records (``_records``, tiling ``[0, n)``), their
    cuts and how they map to the tree's leaves (``bounds``).

    The tree keeps ``_record_cuts`` None whenever the records change and ``_unit_cuts`` None
    whenever the leaves change.
    """

    @property
    def records(self) -> list[RecordRef]:
        return list(self._records)

    @property
    def record_cuts(self) -> torch.Tensor:
        """The records' starts, then ``n``: LongTensor (records + 1,), read-only (kept until the
        records change: decode asks several times a step per group)."""
        if self._record_cuts is None:
            self._record_cuts = torch.tensor([r.start for r in self._records] + [self.n],
                                             dtype=torch.long)
        return self._record_cuts

    def unit_cuts(self) -> torch.Tensor:
        """The leaf cuts that are record cuts too (the ends of the shortest runs of whole leaves
        and whole records): LongTensor, read-only, kept until the leaves or records change."""
        cuts = self.record_cuts
        held = self._unit_cuts
        if held is None or held[0] is not cuts:
            held = self._unit_cuts = (cuts, self._bounds[torch.isin(self._bounds, cuts)])
        return held[1]

    def record_spans(self, leaves: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The records holding each of ``leaves`` (LongTensor (k,); all when None): indices
        ``[first, end)`` into ``records``, two LongTensors (k,)."""
        starts = self.record_cuts
        lo, hi = (self.bounds[:-1], self.bounds[1:]) if leaves is None else \
            (self.bounds[leaves], self.bounds[leaves + 1])
        return (torch.searchsorted(starts, lo, right=True) - 1,
                torch.searchsorted(starts, hi, right=False))

    def record_indices(self, leaves: torch.Tensor | None = None) -> torch.Tensor:
        """Indices into ``records`` of the records holding the tokens of ``leaves`` (LongTensor
        (k,); all when None), once each, ascending."""
        if leaves is None:
            return torch.arange(len(self._records))
        first, end = self.record_spans(leaves)
        covered = torch.zeros(len(self._records) + 1, dtype=torch.long)
        covered.index_add_(0, first, torch.ones_like(first))
        covered.index_add_(0, end, -torch.ones_like(end))
        return (covered.cumsum(0) > 0).nonzero().flatten()

    def records_for(self, leaves: torch.Tensor) -> list[RecordRef]:
        """The records holding the tokens of ``leaves`` (LongTensor (k,)), once each, by start."""
        return [self._records[i] for i in self.record_indices(leaves).tolist()]

    def handles(self, indices: torch.Tensor) -> tuple[Hashable, ...]:
        """The handles of the records at ``indices`` (LongTensor, into ``records``)."""
        return tuple(self._records[i].handle for i in indices.tolist())

    def pending_rewrites(self) -> list[Rewrite]:
        """Record rewrites that make the records follow the leaves.

        Between two cuts that leaves and records share, the records are rewritten when their
        cuts differ from the leaf cuts kept by ``record_cuts``: a leaf made by merges gets one
        record, a record holding several leaves is cut at their bounds, but never into records
        of fewer than ``config.base`` tokens (the size chunks are sealed at). Leaves split below
        that share a record: a fetch reads it and keeps their tokens (``GroupIndex.fetch``), so
        a split never turns into many tiny records to read.
        """
        leaf_cuts = self.bounds.tolist()
        record_cuts = [r.start for r in self._records] + [self.n]
        shared = set(record_cuts)
        rewrites, first, r = [], 0, 0
        for i, cut in enumerate(leaf_cuts[1:], 1):
            if cut not in shared:
                continue
            r_lo = r
            while record_cuts[r] < cut:
                r += 1
            cuts = record_cuts_for(leaf_cuts[first:i + 1], self.config.base)
            if cuts != tuple(record_cuts[r_lo:r + 1]):
                rewrites.append(Rewrite(tuple(self._records[r_lo:r]), cuts))
            first = i
        return rewrites

    def commit_rewrite(self, rewrite: Rewrite, handles: list[Hashable]) -> None:
        """Replace ``rewrite.old`` by new records ``handles``, one per cut interval."""
        cuts = rewrite.cuts
        if len(handles) != len(cuts) - 1:
            raise ValueError(f"{len(handles)} handles for {len(cuts) - 1} new records")
        if not rewrite.old or rewrite.old[0] not in self._records:
            raise ValueError("stale rewrite: its records are no longer current")
        i = self._records.index(rewrite.old[0])
        if tuple(self._records[i: i + len(rewrite.old)]) != rewrite.old:
            raise ValueError("stale rewrite: its records are no longer current")
        if (cuts[0], cuts[-1]) != (rewrite.old[0].start, rewrite.old[-1].end):
            raise ValueError(f"cuts {cuts} do not span the old records")
        new = [RecordRef(h, a, b) for h, a, b in zip(handles, cuts, cuts[1:])]
        self._records[i: i + len(rewrite.old)] = new
        self._record_cuts = None


def record_cuts_for(leaf_cuts: list[int], floor: int) -> tuple[int, ...]:
    """The record cuts over the leaves cut at ``leaf_cuts`` (ascending, ends included): each leaf
    cut taken left to right unless it would leave a record of fewer than ``floor`` tokens on
    either side (a span shorter than ``floor`` stays one record)."""
    cuts = [leaf_cuts[0]]
    for cut in leaf_cuts[1:-1]:
        if cut - cuts[-1] >= floor and leaf_cuts[-1] - cut >= floor:
            cuts.append(cut)
    cuts.append(leaf_cuts[-1])
    return tuple(cuts)
