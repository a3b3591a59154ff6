"""Per layer group bookkeeping of the cache: sealed chunks, their records and key summaries.

A group's sealed tokens ``[0, sealed)`` are cut into chunks; each chunk is one stored record
and carries the min/max summary of its keys (of the group's scoring layer). Selection works on
chunk indices; fetching turns chunk indices into record keys and token positions.
"""
from __future__ import annotations

import torch

from ..storage.base import RecordKey


class GroupIndex:
    """Chunks of one layer group, as a structure of arrays.

    starts, ends : LongTensor, shape (m,) -- token range of each chunk.
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim) -- key summaries (fp32).
    """

    def __init__(self, doc: str, group: int, kv_heads: int, head_dim: int):
        self.doc, self.group = doc, group
        self.keys: list[RecordKey] = []
        self.starts = torch.zeros(0, dtype=torch.long)
        self.ends = torch.zeros(0, dtype=torch.long)
        self.kmin = torch.zeros(0, kv_heads, head_dim)
        self.kmax = torch.zeros(0, kv_heads, head_dim)
        self._positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def sealed(self) -> int:
        return int(self.ends[-1]) if len(self.keys) else 0

    def add(self, bounds: list[tuple[int, int]], keys: torch.Tensor) -> list[RecordKey]:
        """Add chunks over ``bounds`` (contiguous, after ``sealed``) of the scoring layer's keys.

        keys : Tensor, shape (kv_heads, tokens, head_dim) covering exactly the chunks, in order.
        Returns the record keys of the new chunks.
        """
        new = [RecordKey(self.doc, self.group, s, e) for s, e in bounds]
        lens = torch.tensor([e - s for s, e in bounds])
        seg = torch.repeat_interleave(torch.arange(len(bounds)), lens)
        k = keys.float().transpose(0, 1)  # (tokens, kv_heads, dim)
        shape = (len(bounds),) + tuple(k.shape[1:])
        kmin = torch.full(shape, float("inf")).index_reduce_(0, seg, k, "amin")
        kmax = torch.full(shape, float("-inf")).index_reduce_(0, seg, k, "amax")
        self.keys.extend(new)
        self.starts = torch.cat([self.starts, torch.tensor([s for s, _ in bounds])])
        self.ends = torch.cat([self.ends, torch.tensor([e for _, e in bounds])])
        self.kmin = torch.cat([self.kmin, kmin])
        self.kmax = torch.cat([self.kmax, kmax])
        self._positions = None
        return new

    def records(self, chunks: torch.Tensor | None) -> list[RecordKey]:
        """Record keys of ``chunks`` (LongTensor of chunk indices, ascending), or of all when None."""
        if chunks is None:
            return list(self.keys)
        return [self.keys[i] for i in chunks.tolist()]

    def positions(self, chunks: torch.Tensor | None) -> torch.Tensor:
        """Token positions covered by ``chunks`` in record order, LongTensor (tokens,)."""
        if chunks is None:
            if self._positions is None:
                self._positions = torch.arange(self.sealed)
            return self._positions
        starts, ends = self.starts[chunks], self.ends[chunks]
        lens = ends - starts
        offsets = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens)
        return torch.arange(int(lens.sum())) + offsets

    def bound_scores(self, q: torch.Tensor) -> torch.Tensor:
        """Upper bound of ``q . k`` over each chunk (LKA), max over query heads: (m,).

        q : Tensor, shape (q_heads, head_dim).
        """
        m, kv_heads, dim = self.kmin.shape
        qg = q.float().reshape(kv_heads, -1, dim)  # (kv, g, d)
        lo = torch.einsum("hgd,mhd->mhgd", qg, self.kmin)
        hi = torch.einsum("hgd,mhd->mhgd", qg, self.kmax)
        return torch.maximum(lo, hi).sum(-1).amax(dim=(1, 2))

    def chunk_mass(self, token_scores: torch.Tensor) -> torch.Tensor:
        """Sum of ``token_scores`` (sealed tokens, shape (sealed,)) over each chunk: (m,)."""
        csum = torch.cat([token_scores.new_zeros(1), torch.cumsum(token_scores, 0)])
        return csum[self.ends] - csum[self.starts]

    def top_chunks(self, scores: torch.Tensor, budget_tokens: int, sinks: int) -> torch.Tensor:
        """Chunks to fetch: those holding the first ``sinks`` tokens, then the best by ``scores``
        while they fit in ``budget_tokens``; ascending LongTensor of chunk indices."""
        if not len(self.keys):
            return torch.zeros(0, dtype=torch.long)
        lens = self.ends - self.starts
        forced = self.starts < sinks
        order = torch.argsort(scores.masked_fill(forced, float("inf")), descending=True)
        fits = torch.cumsum(lens[order], 0) <= max(budget_tokens, int(lens[forced].sum()))
        chosen = order[fits | forced[order]]
        return torch.sort(chosen).values
