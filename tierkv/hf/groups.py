"""Per layer group bookkeeping of the cache: the chunk tree over sealed tokens and its records.

A group's sealed tokens ``[0, sealed)`` are the leaves of a ``ChunkTree`` (adaptive for the
``leoam``/``tierkv`` policies, fixed otherwise); each sealed chunk is first one stored record.
Selection works on leaf indices and is turned into a ``Fetch`` (record keys + token positions)
before the tree adapts, so merges and splits never disturb a step's fetch. Record rewrites that
make records follow merged/split leaves (never below ``ChunkConfig.base`` tokens: smaller
leaves share a record) run only when the cache is idle (``rewrite``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import ChunkConfig
from ..storage.base import KVBlock, RecordKey
from ..summary import bound_scores as summary_bound_scores, chunk_scores, head_shares, summarize_segments
from ..records import RecordRef
from ..tree import ChunkTree


class Fetch(NamedTuple):
    """What a step brings up for a group: records (in token order), the positions attention
    reads, and ``keep``: which of the records' tokens those are (indices into the records'
    tokens concatenated; None for all), when leaves smaller than their records were chosen."""

    keys: tuple[RecordKey, ...]
    positions: torch.Tensor
    keep: torch.Tensor | None = None
    tokens: int = 0  # tokens the records hold (what the fetch moves)


class GroupIndex:
    """The chunk tree of one layer group, with the record keys of its payloads."""

    def __init__(self, doc: str, group: int, kv_heads: int, head_dim: int, chunks: ChunkConfig):
        self.doc, self.group = doc, group
        self.tree = ChunkTree(chunks, kv_heads, head_dim)
        self._all: Fetch | None = None  # fetch(None), kept until the records change
        self._last: tuple | None = None  # (the tree's bounds, record cuts, n; leaves; Fetch)

    def __len__(self) -> int:
        return self.tree.num_leaves

    @property
    def sealed(self) -> int:
        return self.tree.n

    @property
    def starts(self) -> torch.Tensor:
        return self.tree.bounds[:-1]

    @property
    def keys(self) -> list[RecordKey]:
        return [r.handle for r in self.tree.records]

    def add(self, bounds: list[tuple[int, int]], keys: torch.Tensor,
            leaf_tokens: int | None = None) -> list[RecordKey]:
        """Add records over ``bounds`` (contiguous, from ``sealed``) of the scoring layer's keys.

        keys : Tensor, shape (kv_heads, tokens, head_dim) covering exactly the records, in order.
        leaf_tokens : cut each record into leaves of this many tokens (its last leaf takes the
            remainder); one leaf per record when None.
        Returns the record keys of the new records.
        """
        start = bounds[0][0]
        cuts = [s for s, e in bounds for s in _leaf_starts(s, e, leaf_tokens)] + [bounds[-1][1]]
        cuts = torch.tensor(cuts)
        kmin, kmax = summarize_segments(keys, cuts - start)
        new = [RecordKey(self.doc, self.group, s, e) for s, e in bounds]
        self.tree.append_many(cuts, kmin, kmax, [RecordRef(key, s, e) for key, (s, e) in
                                                 zip(new, bounds)])
        self._all = None
        return new

    def truncate(self, mark: tuple) -> list[RecordKey]:
        """Drop the chunks and records added since ``ChunkTree.mark``; the dropped records'
        keys (``recover.roll_back``)."""
        dropped = [r.handle for r in self.tree.records if r.start >= mark[0]]
        self.tree.truncate(mark)
        self._all = self._last = None
        return dropped

    def fetch(self, leaves: torch.Tensor | None) -> Fetch:
        """The records holding ``leaves`` (LongTensor of leaf indices; all when None) and the
        positions of the leaves' tokens in them (``Fetch.keep`` when the records hold more)."""
        if leaves is None:
            if self._all is None:
                self._all = self._fetch(self.tree.record_indices())
            return self._all
        tree = self.tree
        # a preselecting layer asks the same leaves most steps: the same Fetch, while the tree
        # is the same (its leaves and records are replaced, never changed in place, but the
        # last leaf, which grows with ``n``). ~10 small torch calls a preselecting layer less;
        # one cache decoding alternate blocks of 8 steps at 8K: 100.9 against 102.4 ms a
        # token (median 100.0 against 98.8), below what one run resolves.
        bounds, cuts, n = tree.bounds, tree.record_cuts, tree.n
        held = self._last
        if held is not None and held[0] is bounds and held[1] is cuts and held[2] == n and \
                torch.equal(held[3], leaves):
            return held[4]
        spec = self._fetch(tree.record_indices(leaves))
        if int(tree.sizes[leaves].sum()) != spec.tokens or not bool((leaves.diff() > 0).all()):
            wanted = tree.token_mask(leaves, self.sealed)[spec.positions]  # leaves within records
            keep = wanted.nonzero().flatten()
            spec = spec._replace(positions=spec.positions[keep], keep=keep)
        self._last = bounds, cuts, n, leaves.clone(), spec
        return spec

    def _fetch(self, indices: torch.Tensor) -> Fetch:
        """The Fetch of the records at ``indices`` (ascending, into the tree's records)."""
        if indices.numel() == 0:
            return Fetch((), torch.zeros(0, dtype=torch.long))
        cuts = self.tree.record_cuts
        starts = cuts[indices]
        lens = cuts[indices + 1] - starts
        positions = _ranges(starts, lens)
        return Fetch(self.tree.handles(indices), positions, None, positions.numel())

    def bound_scores(self, q: torch.Tensor) -> torch.Tensor:
        """Ranking of the leaves by their LKA upper bound of ``q . k``: (m,), higher is better.

        Each KV head ranks the leaves by its own bound (max over its GQA query heads); a leaf
        scores by its best rank over the heads, so every head gets its top leaves into the budget
        (round robin) instead of the heads with the loosest bounds taking it all. Ties go to
        the higher bound.

        q : Tensor, shape (q_heads, head_dim).
        """
        per_head, _ = chunk_scores(q, self.tree.kmin, self.tree.kmax)
        return _round_robin(per_head.unsqueeze(0))[0]

    def bound_scores_each(self, q: torch.Tensor) -> torch.Tensor:
        """``bound_scores`` of each of ``t`` query tokens alone, their bounds computed in one
        pass: (t, m). q : Tensor, shape (q_heads, t, head_dim)."""
        heads, t, dim = q.shape
        kmin = self.tree.kmin
        m, kv_heads = kmin.shape[0], kmin.shape[1]
        per_head = summary_bound_scores(q.reshape(heads * t, dim), kmin, self.tree.kmax)
        return _round_robin(per_head.view(m, kv_heads, heads // kv_heads, t).amax(dim=2)
                            .permute(2, 0, 1))

    def share_scores(self, q: torch.Tensor) -> torch.Tensor:
        """Ranking of the leaves by estimated attention density: (m,), higher is better.

        Each query head estimates its shares of the leaves from the logits at the centres of
        their min/max boxes (``summary.head_shares``); a leaf scores ``log(largest share over
        the heads) - log(size)``. The largest share, not the mean, keeps a retrieval head's
        leaf, as ``omnikv`` scores tokens by their largest query-head weight: on SmolLM2's 10
        pass-key cases at a 10 % budget, ``quest`` found 9 keys with the mean and 10 with the
        max, and top-1 agreement rose over the LKA bound's ranking (``quest``; ``leoam`` at 5
        and 10 % budgets, not at 25 %). ``tierkv``'s filter-layer preselection keeps the bound:
        forced on the pass-key cases, it found 10 keys by the bound and 8 by shares.

        q : Tensor, shape (q_heads, head_dim), post-RoPE.
        """
        tree = self.tree
        return head_shares(q, tree.kmin, tree.kmax).amax(dim=1) - tree.sizes.float().log()

    def chunk_mass(self, token_scores: torch.Tensor) -> torch.Tensor:
        """Sum of ``token_scores`` (shape (>= sealed,)) over each leaf: (m,)."""
        return self.tree.mass_per_leaf(token_scores)

    def top_chunks(self, scores: torch.Tensor, budget_tokens: int, sinks: int) -> torch.Tensor:
        """Leaves to fetch: those holding the first ``sinks`` tokens, then the best by ``scores``
        while they fit in ``budget_tokens``; ascending LongTensor of leaf indices."""
        if not len(self):
            return torch.zeros(0, dtype=torch.long)
        lens = self.tree.sizes
        forced = self.starts < sinks
        order = torch.argsort(scores.masked_fill(forced, float("inf")), descending=True, stable=True)
        fits = torch.cumsum(lens[order], 0) <= max(budget_tokens, int(lens[forced].sum()))
        return torch.sort(order[fits | forced[order]]).values

    def adapt(self, token_scores: torch.Tensor, chosen: torch.Tensor, sinks: int,
              keys_at, positions: torch.Tensor | None, max_leaf: int) -> None:
        """Fold one step's exact scores into the tree: cold runs merge, concentrated leaves split.

        token_scores : Tensor, shape (>= sealed,), attention mass per token (0 where unknown).
        chosen : LongTensor of the leaves fetched this step.
        keys_at, positions : the keys at hand, ``index -> Tensor (kv_heads, len(index),
            head_dim)`` on the CPU (``index`` a CPU LongTensor into them), and their tokens'
            positions, shape (n,) on the CPU; a split whose leaf's tokens are not all among them
            is skipped (no split at all when ``keys_at`` is None).
        max_leaf : largest leaf a merge may make (a fraction of the fetch budget).
        """
        scores = token_scores[: self.sealed].clone()
        scores[:sinks] = 0
        selected = torch.zeros(len(self), dtype=torch.bool)
        selected[chosen] = True
        changes = self.tree.update(self.tree.mass_per_leaf(scores), selected, scores, max_leaf)
        if changes.splits and keys_at is not None:
            self.tree.split_packed(*_leaf_keys(changes.splits, keys_at, positions))

    def rewrite(self, store, keep=frozenset()) -> int:
        """Rewrite records to match the leaves (after merges/splits); returns records written.
        Replaced records in ``keep`` (a saved document's) keep their disk copies."""
        written = 0
        for rewrite in self.tree.pending_rewrites():
            old = [r.handle for r in rewrite.old]
            blocks = store.fetch(old, "cpu")
            keys = torch.cat([b.keys for b in blocks], dim=2)
            values = torch.cat([b.values for b in blocks], dim=2)
            base, new = rewrite.cuts[0], []
            for a, b in zip(rewrite.cuts, rewrite.cuts[1:]):
                key = RecordKey(self.doc, self.group, a, b)
                store.put(key, KVBlock(keys[:, :, a - base:b - base].clone(), values[:, :, a - base:b - base].clone()))
                new.append(key)
            self.tree.commit_rewrite(rewrite, new)
            self._all = None
            for key in set(old) - set(new):
                store.remove(key, keep_disk=key in keep)
            written += len(new)
        return written

    def state(self) -> dict[str, torch.Tensor]:
        return self.tree.state()

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.tree.load_state(state, lambda a, b: RecordKey(self.doc, self.group, a, b))
        self._all = None


def _leaf_starts(start: int, end: int, leaf_tokens: int | None) -> range:
    """Starts of the leaves a record ``[start, end)`` is cut into: ``leaf_tokens`` each, the
    last one taking the remainder (one leaf when None or when the record is smaller)."""
    if leaf_tokens is None or end - start < 2 * leaf_tokens:
        return range(start, start + 1)
    return range(start, end - leaf_tokens - (end - start) % leaf_tokens + 1, leaf_tokens)


def _leaf_keys(splits, keys_at, positions: torch.Tensor):
    """The ``splits`` whose leaves' tokens are all among the keys at hand (``keys_at``, at
    ``positions`` (n,, distinct)), and those leaves' keys one after another on the CPU
    (``ChunkTree.split_packed``'s arguments)."""
    order = None
    if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
        order = torch.argsort(positions)
        positions = positions[order]
        if not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("the positions of the keys at hand name a token twice")
    starts, ends = torch.tensor([(r.start, r.end) for r in splits]).T.contiguous()
    lens = ends - starts
    # ascending and distinct: a leaf is whole when its last token sits len - 1 places after its
    # first (``at`` is where its first token is, or would be)
    at = torch.searchsorted(positions, starts)
    last = at + lens - 1
    whole = last < positions.numel()
    whole[whole.clone()] = positions[last[whole]] == ends[whole] - 1
    found = whole.nonzero().flatten()
    index = _ranges(at[found], lens[found])
    if order is not None:
        index = order[index]
    return [splits[i] for i in found.tolist()], keys_at(index)


def _round_robin(per_head: torch.Tensor) -> torch.Tensor:
    """``GroupIndex.bound_scores``' ranking from the bounds ``per_head`` (t, m, kv_heads) of
    ``t`` queries: (t, m), each leaf scoring its best rank over the kv heads, ties going to the
    higher bound."""
    rank = torch.argsort(torch.argsort(per_head, dim=1, descending=True), dim=1)
    best = rank.min(dim=2).values.float()
    per_layer = per_head.amax(dim=2)
    low, high = per_layer.amin(dim=1, keepdim=True), per_layer.amax(dim=1, keepdim=True)
    return -best + 0.5 * (per_layer - low) / (high - low + 1e-9)


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``starts[i] .. starts[i] + lens[i] - 1`` for every ``i``, one after another."""
    offsets = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
    return torch.arange(int(lens.sum())) + offsets
