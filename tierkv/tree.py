"""The adaptive chunk tree of one layer group (IAKM, from LeoAM).

Leaves tile the sealed tokens ``[0, n)``: contiguous, non-overlapping, each ``config.min`` to
``config.max`` tokens, except the *tail* (the last leaf) which may be shorter than ``min`` while
it grows: the next append joins it. Leaves are a structure of arrays (``bounds``, ``kmin``,
``kmax``, ``ema``, ``selected_count``, ``cold``) so scoring and statistics are vectorised.

Payloads live in *records*, which tile ``[0, n)`` on their own: how they map to the leaves and
how they are rewritten to follow merges and splits is ``records.LeafRecords``.

Above the leaves, ``levels`` keeps a min/max summary of every ``FANOUT**j`` consecutive leaves,
so a search can prune a whole subtree whose bound is below the current k-th best.
"""
from __future__ import annotations

from typing import Hashable, NamedTuple

import torch

from tierkv.config import ChunkConfig
from tierkv.records import LeafRecords, RecordRef
from tierkv.summary import segment_minmax, summarize, summarize_segments

FANOUT = 4


class SplitRequest(NamedTuple):
    """Leaf ``[start, end)`` wants to split at ``cut``; ``first_share`` of its mass lies left."""

    start: int
    end: int
    cut: int
    first_share: float


class Changes(NamedTuple):
    """What ``update`` did: leaves made by merges, and splits that need the leaves' keys."""

    merged: list[tuple[int, int]]
    splits: list[SplitRequest]


class ChunkTree(LeafRecords):
    """Leaves over the sealed tokens of one layer group, with summaries and statistics.

    Parameters
    ----------
    config : ChunkConfig, leaf sizes and adaptation rules.
    kv_heads, head_dim : int, shape of one token's keys.
    """

    def __init__(self, config: ChunkConfig, kv_heads: int, head_dim: int):
        if not isinstance(config, ChunkConfig):
            raise ValueError(f"config={config!r}: expected a ChunkConfig")
        for name, value in (("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        self.config, self.kv_heads, self.head_dim = config, kv_heads, head_dim
        self.bounds = torch.zeros(1, dtype=torch.long)
        self.kmin = torch.empty(0, kv_heads, head_dim)
        self.kmax = torch.empty(0, kv_heads, head_dim)
        self.ema = torch.empty(0)
        self.selected_count = torch.empty(0, dtype=torch.long)
        self.cold = torch.empty(0, dtype=torch.long)
        self._records: list[RecordRef] = []
        self._record_cuts: torch.Tensor | None = None  # record_cuts, until the records change
        self._levels: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # -- shape ------------------------------------------------------------------------
    @property
    def bounds(self) -> torch.Tensor:
        """Leaf cuts: 0, then each leaf's end, LongTensor (m + 1,), read-only."""
        return self._bounds

    @bounds.setter
    def bounds(self, value: torch.Tensor) -> None:
        self._bounds = value
        self._n = int(value[-1])  # decode asks a few hundred times a step
        self._unit_cuts = None

    @property
    def n(self) -> int:
        """Sealed tokens covered by the leaves."""
        return self._n

    @property
    def num_leaves(self) -> int:
        return self.bounds.numel() - 1

    @property
    def sizes(self) -> torch.Tensor:
        """Tokens per leaf, LongTensor (m,)."""
        return self.bounds.diff()

    # -- growth -----------------------------------------------------------------------
    def append(self, start: int, end: int, kmin: torch.Tensor, kmax: torch.Tensor,
               record: Hashable) -> None:
        """Seal tokens ``[start, end)`` (``start == n``) stored in ``record``.

        kmin, kmax : Tensor, shape (kv_heads, head_dim). A short tail (< min tokens) absorbs the
        new tokens; the result must not exceed ``max``.
        """
        if kmin.shape != (self.kv_heads, self.head_dim) or kmax.shape != kmin.shape:
            raise ValueError(f"kmin {tuple(kmin.shape)} / kmax {tuple(kmax.shape)}: expected "
                             f"({self.kv_heads}, {self.head_dim})")
        self.append_many(torch.tensor([start, end]), kmin[None], kmax[None],
                         [RecordRef(record, start, end)])

    def _grow_tail(self, end, lo, hi) -> None:
        self.ema[-1] += (end - self.n) / end
        self._bounds[-1] = end
        self.bounds = self._bounds  # n and what derives from the cuts anew
        self.kmin[-1] = torch.minimum(self.kmin[-1], lo[0])
        self.kmax[-1] = torch.maximum(self.kmax[-1], hi[0])

    def append_many(self, cuts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                    records: list[RecordRef]) -> None:
        """Seal tokens ``[cuts[0], cuts[-1])`` (``cuts[0] == n``) as leaves cut at ``cuts``
        (LongTensor (k+1,)), stored in ``records`` (contiguous, covering the same tokens), in
        one batched update. A record may hold several leaves.

        kmin, kmax : Tensor, shape (k, kv_heads, head_dim). Leaves hold ``min`` to ``max``
        tokens, the last one possibly fewer; a short tail before them absorbs the first.
        """
        cuts = torch.as_tensor(cuts, dtype=torch.long)
        k = cuts.numel() - 1
        sizes = cuts.diff()
        if k < 1 or int(cuts[0]) != self.n or bool((sizes < 1).any()):
            raise ValueError(f"leaf cuts {cuts.tolist()[:8]}...: must start at n={self.n} and "
                             "increase strictly")
        if kmin.shape != (k, self.kv_heads, self.head_dim) or kmax.shape != kmin.shape:
            raise ValueError(f"kmin {tuple(kmin.shape)} / kmax {tuple(kmax.shape)}: expected "
                             f"({k}, {self.kv_heads}, {self.head_dim})")
        c = self.config
        if bool((sizes > c.max).any()) or bool((sizes[:-1] < c.min).any()):
            raise ValueError(f"leaf sizes {sizes.tolist()[:8]}...: must be min={c.min} to "
                             f"max={c.max} tokens (the last may be shorter)")
        ends = [r.start for r in records[1:]] + [int(cuts[-1])]
        if not records or records[0].start != self.n or any(
                r.end != e or r.end <= r.start for r, e in zip(records, ends)) or \
                records[-1].end != int(cuts[-1]):
            raise ValueError(f"records {[(r.start, r.end) for r in records][:4]}...: must tile "
                             f"[{self.n}, {int(cuts[-1])})")
        grow = self.num_leaves > 0 and int(self.sizes[-1]) < c.min
        if grow and int(cuts[1]) - int(self.bounds[-2]) > c.max:
            raise ValueError(f"appending up to {int(cuts[1])} after a short tail would make a "
                             f"leaf over max={c.max} tokens")
        self._records.extend(records)
        self._record_cuts = self._levels = None
        lo, hi = kmin.float(), kmax.float()
        if grow:
            self._grow_tail(int(cuts[1]), lo[:1], hi[:1])
            cuts, lo, hi, k = cuts[1:], lo[1:], hi[1:], k - 1
            if k == 0:
                return
        ends = cuts[1:]
        self.bounds = torch.cat([self.bounds, ends])
        self.kmin, self.kmax = torch.cat([self.kmin, lo]), torch.cat([self.kmax, hi])
        self.ema = torch.cat([self.ema, cuts.diff().float() / ends.float()])
        self.selected_count = torch.cat([self.selected_count, self.cold.new_zeros(k)])
        self.cold = torch.cat([self.cold, self.cold.new_zeros(k)])

    def append_keys(self, keys: torch.Tensor, record: Hashable) -> None:
        """Seal ``keys`` (kv_heads, t, head_dim) as tokens ``[n, n + t)`` stored in ``record``."""
        kmin, kmax = summarize(keys)
        self.append(self.n, self.n + keys.shape[1], kmin, kmax, record)

    def mark(self) -> tuple:
        """Where the leaves end now, for ``truncate``: (n, the last leaf's kmin, kmax and ema,
        which a short tail's growth changes in place; None without leaves)."""
        if not self.num_leaves:
            return self.n, None
        return self.n, (self.kmin[-1].clone(), self.kmax[-1].clone(), self.ema[-1].clone())

    def truncate(self, mark: tuple) -> None:
        """Drop what was appended since ``mark`` (``append_many``; no leaf split or merged since):
        the leaves and records past its ``n``, a tail grown past it cut back."""
        n, tail = mark
        if n > self.n:
            raise ValueError(f"truncate to {n} tokens: the tree holds {self.n}")
        kept = int((self._bounds[:-1] < n).sum())  # leaves starting before n
        self.bounds = torch.cat([self._bounds[:kept], torch.tensor([n])])
        self.kmin, self.kmax = self.kmin[:kept].clone(), self.kmax[:kept].clone()
        self.ema = self.ema[:kept].clone()
        self.selected_count, self.cold = self.selected_count[:kept], self.cold[:kept]
        if tail is not None:
            self.kmin[-1], self.kmax[-1], self.ema[-1] = tail
        self._records = [r for r in self._records if r.start < n]
        self._record_cuts = self._levels = None
        self.validate()

    # -- statistics -------------------------------------------------------------------
    def mass_per_leaf(self, token_scores: torch.Tensor) -> torch.Tensor:
        """Sum of ``token_scores`` (L,) with L >= n over each leaf: Tensor (m,), fp32.

        Tokens past ``n`` (the unsealed window) are ignored.
        """
        if token_scores.dim() != 1 or token_scores.numel() < self.n:
            raise ValueError(f"token_scores {tuple(token_scores.shape)}: expected (L,), "
                             f"L >= {self.n}")
        prefix = self._prefix(token_scores)
        return (prefix[self.bounds[1:]] - prefix[self.bounds[:-1]]).float()

    def _prefix(self, token_scores: torch.Tensor) -> torch.Tensor:
        prefix = torch.zeros(self.n + 1, dtype=torch.float64)
        torch.cumsum(token_scores[: self.n].double(), 0, out=prefix[1:])
        return prefix

    def update(self, mass: torch.Tensor, selected: torch.Tensor,
               token_scores: torch.Tensor | None = None, max_size: int | None = None) -> Changes:
        """Fold one evaluation into the statistics, merge deserts, and ask for splits.

        Parameters
        ----------
        mass : Tensor, shape (m,), attention mass per leaf, ``mass_per_leaf(token_scores)``.
            Callers zero the sinks and the recent window first (``select.adaptation_scores``):
            they are always fetched, and a sink's mass would make every other leaf look cold.
        selected : BoolTensor, shape (m,), the leaves fetched this step.
        token_scores : Tensor, shape (L,), the scores ``mass`` came from; without them no split
            is proposed (concentration inside a leaf is unknown).
        max_size : cap on merged leaves below ``config.max`` (a selector passes a fraction of its
            token budget: a leaf larger than the budget could never be fetched again).
        """
        m = self.num_leaves
        if mass.shape != (m,) or selected.shape != (m,) or selected.dtype != torch.bool:
            raise ValueError(f"mass {tuple(mass.shape)} / selected {tuple(selected.shape)} "
                             f"{selected.dtype}: expected ({m},) float and ({m},) bool")
        total = float(mass.sum())
        share = mass.float() / total if total > 0 else torch.zeros(m)
        c = self.config
        self.ema = c.ema * self.ema + (1 - c.ema) * share
        self.selected_count += selected.long()
        cold = self.ema < c.desert_threshold * self.sizes.float() / max(self.n, 1)
        self.cold = torch.where(cold, self.cold + 1, 0)
        candidates = selected | ((self.sizes > c.base) & ~cold)
        splits = [] if token_scores is None else self._split_requests(mass, candidates,
                                                                       token_scores)
        eligible = self.cold >= c.merge_after
        if m and int(self.sizes[-1]) < c.min:
            eligible[-1] = False
        if splits:  # a leaf asked to split does not merge
            eligible[self._leaf_index(torch.tensor([r.start for r in splits]))] = False
        limit = self.config.max if max_size is None else max(self.config.min, min(max_size, self.config.max))
        return Changes(self._merge(eligible, limit), splits)

    def _split_requests(self, mass, candidates, token_scores) -> list[SplitRequest]:
        cuts = self.bounds[:-1] + self.sizes // 2
        prefix = self._prefix(token_scores)
        first = (prefix[cuts] - prefix[self.bounds[:-1]]).float()
        frac = (first / mass.clamp(min=1e-30)).clamp(0, 1)
        conc = torch.maximum(frac, 1 - frac) >= self.config.split_concentration
        want = candidates & (mass > 0) & (self.sizes >= 2 * self.config.min) & conc
        idx = want.nonzero().flatten()
        rows = zip(self.bounds[idx].tolist(), self.bounds[idx + 1].tolist(), cuts[idx].tolist(),
                   frac[idx].tolist())
        return [SplitRequest(*row) for row in rows]

    # -- structure --------------------------------------------------------------------
    def _merge(self, eligible: torch.Tensor, limit: int) -> list[tuple[int, int]]:
        sizes = self.sizes
        pair = eligible[:-1] & eligible[1:] & (sizes[:-1] + sizes[1:] <= limit)
        if not bool(pair.any()):
            return []
        groups = _pack_runs(eligible.tolist(), sizes.tolist(), limit)
        merged = [(int(self.bounds[first]), int(self.bounds[last])) for first, last in groups]
        keep = torch.ones(self.num_leaves + 1, dtype=torch.bool)
        for first, last in groups:
            keep[first + 1:last] = False
        self._regroup(keep.nonzero().flatten())
        return merged

    def _regroup(self, leaf_bounds: torch.Tensor) -> None:
        """Make leaf ``i`` the union of old leaves ``[leaf_bounds[i], leaf_bounds[i+1])``."""
        self.kmin, self.kmax = segment_minmax(self.kmin, self.kmax, leaf_bounds)
        segment = torch.repeat_interleave(torch.arange(leaf_bounds.numel() - 1), leaf_bounds.diff())
        m = leaf_bounds.numel() - 1
        self.ema = torch.zeros(m).index_add_(0, segment, self.ema)
        self.selected_count = torch.zeros(m, dtype=torch.long).index_add_(
            0, segment, self.selected_count)
        self.cold = torch.zeros(m, dtype=torch.long).scatter_reduce_(0, segment, self.cold, "amin",
                                                                      include_self=False)
        self.bounds = self.bounds[leaf_bounds]
        self._levels = None

    def split(self, request: SplitRequest, keys: torch.Tensor) -> None:
        """Split the leaf of ``request`` at its cut, summarising the halves from ``keys``.

        keys : Tensor, shape (kv_heads, end - start, head_dim), the leaf's keys.
        """
        self.split_many([request], [keys])

    def split_many(self, requests: list[SplitRequest], keys: list[torch.Tensor]) -> None:
        """``split`` every request in one rebuild of the leaf arrays: a fold's splits cost one
        copy of them, not one each. Nothing changes when any request is refused.

        requests : SplitRequest per leaf to split, distinct current leaves, in any order.
        keys : one Tensor per request, shape (kv_heads, end - start, head_dim), its leaf's keys.
        """
        if len(requests) != len(keys):
            raise ValueError(f"{len(requests)} split requests with {len(keys)} key tensors")
        if not requests:
            return
        for r, k in zip(requests, keys):
            if k.shape != (self.kv_heads, r.end - r.start, self.head_dim):
                raise ValueError(f"keys {tuple(k.shape)} of {r}: expected "
                                 f"({self.kv_heads}, {r.end - r.start}, {self.head_dim})")
        self.split_packed(requests, torch.cat(keys, dim=1))

    def split_packed(self, requests: list[SplitRequest], keys: torch.Tensor) -> None:
        """``split_many`` with the leaves' keys one after another in one tensor.

        keys : Tensor, shape (kv_heads, total, head_dim): request ``i``'s leaf's tokens follow
            those of requests ``0..i-1``; total is the sum of the leaves' sizes.
        """
        if not requests:
            return
        starts, ends, cuts = torch.tensor([(r.start, r.end, r.cut) for r in requests]).T.contiguous()
        idx = self._leaves_of(requests, starts, ends, cuts)
        lens = ends - starts
        if keys.shape != (self.kv_heads, int(lens.sum()), self.head_dim):
            raise ValueError(f"keys {tuple(keys.shape)}: expected ({self.kv_heads}, "
                             f"{int(lens.sum())}, {self.head_dim}) for {len(requests)} leaves")
        # each leaf's two halves are consecutive segments of ``keys``: one reduction for all
        offsets = lens.cumsum(0) - lens
        halves = torch.stack([offsets, offsets + cuts - starts], dim=1).flatten()
        lo, hi = summarize_segments(keys, torch.cat([halves, lens.sum().view(1)]))
        share = torch.tensor([[r.first_share, 1 - r.first_share] for r in requests])
        repeat = torch.ones(self.num_leaves, dtype=torch.long)
        repeat[idx] = 2
        source = torch.repeat_interleave(torch.arange(self.num_leaves), repeat)  # new -> old leaf
        first = (repeat.cumsum(0) - repeat)[idx]  # new index of each split leaf's first half
        second = first + 1
        bounds = self.bounds[:-1][source]
        bounds[second] = cuts
        kmin, kmax, ema = self.kmin[source], self.kmax[source], self.ema[source]
        kmin[first], kmax[first], kmin[second], kmax[second] = lo[0::2], hi[0::2], lo[1::2], hi[1::2]
        ema[first], ema[second] = self.ema[idx] * share[:, 0], self.ema[idx] * share[:, 1]
        cold = self.cold[source]
        cold[first] = cold[second] = 0
        self.bounds = torch.cat([bounds, self.bounds[-1:]])
        self.kmin, self.kmax, self.ema, self.cold = kmin, kmax, ema, cold
        self.selected_count = self.selected_count[source]  # both halves keep the count
        self._levels = None

    def _leaves_of(self, requests, starts, ends, cuts) -> torch.Tensor:
        """The leaf each request splits (LongTensor), after checking that each names a current
        leaf, once, and cuts inside it."""
        bounds = self.bounds
        leaves = self._leaf_index(starts).clamp(0, self.num_leaves - 1)
        bad = (bounds[leaves] != starts) | (bounds[leaves + 1] != ends) | (cuts <= starts) | \
            (cuts >= ends)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            leaf = int(leaves[i])
            raise ValueError(f"{requests[i]} does not match the current leaf "
                             f"[{int(bounds[leaf])}, {int(bounds[leaf + 1])})")
        if torch.unique(leaves).numel() != leaves.numel():
            named = leaves.tolist()
            twice = next(i for i in named if named.count(i) > 1)
            raise ValueError(f"split requests name leaf {twice} more than once")
        return leaves

    def token_mask(self, leaves: torch.Tensor, length: int) -> torch.Tensor:
        """BoolTensor (length,) (``length >= n``): True on the tokens of ``leaves``."""
        delta = torch.zeros(length + 1, dtype=torch.long)
        delta.index_add_(0, self.bounds[leaves], torch.ones_like(leaves))
        delta.index_add_(0, self.bounds[leaves + 1], -torch.ones_like(leaves))
        return delta[:-1].cumsum(0) > 0

    def leaf_at(self, token: int) -> int:
        """Index of the leaf holding ``token``."""
        if not 0 <= token < self.n:
            raise ValueError(f"token {token}: outside [0, {self.n})")
        return int(torch.searchsorted(self.bounds, token, right=True)) - 1

    def _leaf_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """``leaf_at`` of each of ``tokens`` (LongTensor, within ``[0, n)``, unchecked)."""
        return torch.searchsorted(self.bounds, tokens, right=True) - 1

    # -- persistence ------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Leaves, statistics and record ranges as named tensors (handles are not included)."""
        return {"bounds": self.bounds, "kmin": self.kmin, "kmax": self.kmax, "ema": self.ema,
                "selected_count": self.selected_count, "cold": self.cold,
                "records": self.record_cuts.clone()}

    def load_state(self, state: dict[str, torch.Tensor], handle_of) -> None:
        """Take back ``state()``; ``handle_of(start, end)`` names each record. Checked."""
        bounds, records = state["bounds"].long(), state["records"].long()
        m = bounds.numel() - 1
        arrays = {k: state[k] for k in ("kmin", "kmax", "ema", "selected_count", "cold")}
        if m < 0 or any(t.shape[0] != m for t in arrays.values()) or \
                state["kmin"].shape[1:] != (self.kv_heads, self.head_dim):
            raise ValueError("tree state: arrays disagree in shape")
        if int(bounds[0]) != 0 or int(records[0]) != 0 or int(records[-1]) != int(bounds[-1]) \
                or bool((bounds.diff() <= 0).any()) or bool((records.diff() <= 0).any()):
            raise ValueError("tree state: leaves or records do not tile [0, n)")
        self.bounds = bounds.clone()
        self.kmin, self.kmax = state["kmin"].float().clone(), state["kmax"].float().clone()
        self.ema = state["ema"].float().clone()
        self.selected_count = state["selected_count"].long().clone()
        self.cold = state["cold"].long().clone()
        cuts = records.tolist()
        self._records = [RecordRef(handle_of(a, b), a, b) for a, b in zip(cuts, cuts[1:])]
        self._record_cuts = self._levels = None
        self.validate()

    # -- hierarchy --------------------------------------------------------------------
    @property
    def levels(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Summaries per level, leaves first: level j node i covers leaves
        ``[i * FANOUT**j, (i + 1) * FANOUT**j)``; each level is (kmin, kmax) (m_j, kv_heads, d).
        The top level has at most FANOUT nodes.
        """
        if self._levels is None:
            levels = [(self.kmin, self.kmax)]
            while levels[-1][0].shape[0] > FANOUT:
                lo, hi = levels[-1]
                m = lo.shape[0]
                cuts = torch.cat([torch.arange(0, m, FANOUT), torch.tensor([m])])
                levels.append(segment_minmax(lo, hi, cuts))
            self._levels = levels
        return self._levels

    def validate(self) -> None:
        """Raise RuntimeError unless leaves and records tile [0, n) within the size limits."""
        sizes, c = self.sizes, self.config
        m = self.num_leaves
        body = sizes[:-1]
        if m and (bool((body < c.min).any()) or bool((sizes > c.max).any()) or sizes[-1] < 1):
            raise RuntimeError(f"leaf sizes {sizes.tolist()} outside [{c.min}, {c.max}]")
        if int(self.bounds[0]) != 0 or any(t.shape[0] != m for t in (
                self.kmin, self.kmax, self.ema, self.selected_count, self.cold)):
            raise RuntimeError("leaf arrays disagree in length or do not start at 0")
        ends = [0] + [r.end for r in self._records]
        if [r.start for r in self._records] != ends[:-1] or ends[-1] != self.n:
            raise RuntimeError("records do not tile [0, n)")


def _pack_runs(eligible: list[bool], sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Groups [first, last) of consecutive eligible leaves, packed left to right up to ``limit``."""
    groups, i = [], 0
    while i < len(sizes):
        j, total = i + 1, sizes[i]
        while eligible[i] and j < len(sizes) and eligible[j] and total + sizes[j] <= limit:
            total, j = total + sizes[j], j + 1
        if j - i > 1:
            groups.append((i, j))
        i = j
    return groups
