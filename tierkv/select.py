"""Which leaves of a chunk tree to fetch for one step, under a token budget.

The selected context is always: the first ``sinks`` tokens, the last ``window`` tokens, and whole
leaves chosen greedily until the budget (``SelectConfig.tokens``) is spent. A leaf costs only its
tokens not already in the sinks or the window. Leaves costing more than the whole budget are
never candidates (a merged desert must not block the ranking); the others are taken in order of
the ranking key while the running cost stays within the budget (a prefix of the ranking, ties
broken by leaf index), which keeps the rule one vectorised pass.

Two ranking keys, because the two inputs measure different things:

* exact token scores (a filter layer's attention) are *additive*: a leaf's value is its mass, so
  leaves are ranked by **density** (mass / cost), the greedy rule for a knapsack of whole leaves;
  a large cold leaf never crowds out small hot ones.
* a query against min/max summaries gives no mass, only the leaves' boxes. Each query head's
  attention over the leaves is estimated from the logit at each box's centre
  (``summary.attention_shares``), and leaves are ranked by **estimated density**
  ``log(share) - log(cost)``. Quest's key, the upper bound of the largest logit, is not used:
  its slack over the leaf's typical logit grows with the spread of the leaf's keys, so on
  SmolLM2 wide leaves and loose heads took the budget (``bench.selection``, 10 % budget:
  0.53-0.62 of the oracle's mass against 0.85-0.90 with centre shares). The estimate needs every
  leaf's logit per head, so every leaf is scored, in one batched call.

``select_by_bound`` keeps Quest's bound ranking (``scale * bound - log(cost)``) with the tree's
pruned search: with the tree's ``levels``, a first greedy descent reaches real leaves whose keys
give a threshold ``tau`` no higher than the last key the exact greedy would take; then every
node whose (scaled) bound is below ``tau`` is skipped with its whole subtree, since a node's
bound is at least the key of every leaf under it. Its selection is identical to exhaustive
scoring; ``evaluations`` counts the summaries scored. On SmolLM2 it captures less mass and,
its bounds being loose, prunes little (``bench.selection``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from tierkv.config import SelectConfig
from tierkv.summary import attention_shares, chunk_scores, rounding_margin
from tierkv.tree import FANOUT, ChunkTree

PRUNE_MIN_LEAVES = 256


class Selection(NamedTuple):
    """leaves : LongTensor (k,) ascending; tokens : LongTensor (t,) ascending token indices
    (sinks, chosen leaves, window); evaluations : summaries scored (0 for exact scores)."""

    leaves: torch.Tensor
    tokens: torch.Tensor
    evaluations: int


def _window_start(context: int, config: SelectConfig) -> int:
    return max(context - config.window, 0)


def leaf_costs(tree: ChunkTree, context: int, config: SelectConfig) -> torch.Tensor:
    """Tokens of each leaf outside the sinks and the window, LongTensor (m,)."""
    if context < tree.n:
        raise ValueError(f"context={context}: shorter than the tree's {tree.n} sealed tokens")
    starts, ends = tree.bounds[:-1], tree.bounds[1:]
    ws = _window_start(context, config)
    if ws <= config.sinks:
        return torch.zeros_like(starts)
    in_sinks = (ends.clamp(max=config.sinks) - starts).clamp(min=0)
    in_window = (ends - starts.clamp(min=ws)).clamp(min=0)
    return ends - starts - in_sinks - in_window


def _free_tokens(context: int, config: SelectConfig) -> int:
    return min(context, config.sinks + config.window)


def adaptation_scores(token_scores: torch.Tensor, config: SelectConfig) -> torch.Tensor:
    """``token_scores`` (context,) with the sinks and the window zeroed: what leaves compete
    for, and what ``ChunkTree.update`` should see."""
    scores = token_scores.clone()
    scores[: config.sinks] = 0
    scores[_window_start(scores.numel(), config):] = 0
    return scores


def adaptation_mass(tree: ChunkTree, token_scores: torch.Tensor, config: SelectConfig
                    ) -> torch.Tensor:
    """Mass per leaf (m,) of ``token_scores`` (context,) with sinks and window zeroed."""
    return tree.mass_per_leaf(adaptation_scores(token_scores, config))


def _fill(keys: torch.Tensor, ids: torch.Tensor, costs: torch.Tensor, budget: int) -> torch.Tensor:
    """Prefix of ``ids`` (ascending) ranked by ``keys`` descending whose costs fit ``budget``;
    leaves costing more than the whole budget are never candidates."""
    fits = (costs <= budget) & (costs > 0)
    keys, ids, costs = keys[fits], ids[fits], costs[fits]
    order = torch.sort(keys, descending=True, stable=True).indices
    take = costs[order].cumsum(0) <= budget
    return ids[order][take].sort().values


def _token_set(tree: ChunkTree, leaves: torch.Tensor, context: int, config: SelectConfig
               ) -> torch.Tensor:
    mask = tree.token_mask(leaves, context)
    mask[: config.sinks] = True
    mask[_window_start(context, config):] = True
    return mask.nonzero().flatten()


def select_by_scores(tree: ChunkTree, token_scores: torch.Tensor, config: SelectConfig
                     ) -> Selection:
    """Leaves by mass density from exact token scores.

    token_scores : Tensor, shape (context,), e.g. a filter layer's attention summed over heads.
    """
    context = token_scores.numel()
    costs = leaf_costs(tree, context, config)
    mass = adaptation_mass(tree, token_scores, config)
    density = torch.where(costs > 0, mass / costs.clamp(min=1), 0.0)
    budget = max(config.tokens(context) - _free_tokens(context, config), 0)
    leaves = _fill(density, torch.arange(tree.num_leaves), costs, budget)
    return Selection(leaves, _token_set(tree, leaves, context, config), 0)


def query_keys(tree: ChunkTree, query: torch.Tensor, costs: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
    """Estimated density of each leaf for ``query`` (q_heads, head_dim), Tensor (m,):
    ``log(share) - log(cost)`` with ``costs`` (m,) from ``leaf_costs``."""
    shares = attention_shares(query, tree.kmin, tree.kmax, scale)
    return shares - costs.clamp(min=1).float().log()


def select_by_query(tree: ChunkTree, query: torch.Tensor, config: SelectConfig, context: int,
                    scale: float | None = None) -> Selection:
    """Leaves by estimated density for ``query`` (q_heads, head_dim) over ``context`` tokens.

    Each query head's attention over the leaves is estimated from the logit at the centre of
    each leaf's min/max box; a leaf's key is its mean share over the heads per token fetched
    (``query_keys``).

    scale : the attention's logit scale, ``head_dim ** -0.5`` by default.
    """
    costs = leaf_costs(tree, context, config)
    budget = max(config.tokens(context) - _free_tokens(context, config), 0)
    if budget == 0 or tree.num_leaves == 0:
        leaves = torch.zeros(0, dtype=torch.long)
        return Selection(leaves, _token_set(tree, leaves, context, config), 0)
    keys = query_keys(tree, query, costs, scale)
    leaves = _fill(keys, torch.arange(tree.num_leaves), costs, budget)
    return Selection(leaves, _token_set(tree, leaves, context, config), tree.num_leaves)


def select_by_bound(tree: ChunkTree, query: torch.Tensor, config: SelectConfig, context: int,
                    prune: bool | None = None, scale: float | None = None) -> Selection:
    """Leaves by Quest's bound for ``query`` (q_heads, head_dim) over ``context`` tokens, found
    by a pruned walk of the tree (the ranking ``select_by_query`` replaced; kept because it can
    prune: a subtree whose bound is below the greedy threshold costs one evaluation).

    The key is ``scale * bound - log(cost)``: a leaf's mass is estimated from its largest
    possible logit alone (attention is peaked), so the mass per fetched token falls with size.
    For equal-size leaves this is Quest's ranking by bound.

    prune : use the tree's levels (True), score every leaf (False), or decide by size (None:
        prune from PRUNE_MIN_LEAVES leaves, below which one batched scoring is faster on CPU).
    scale : the attention's logit scale, ``head_dim ** -0.5`` by default.
    """
    costs = leaf_costs(tree, context, config)
    budget = max(config.tokens(context) - _free_tokens(context, config), 0)
    scale = tree.head_dim ** -0.5 if scale is None else scale
    if prune is None:
        prune = tree.num_leaves >= PRUNE_MIN_LEAVES
    if budget == 0:
        ids, keys, evaluations = torch.zeros(0, dtype=torch.long), torch.zeros(0), 0
    elif prune:
        ids, keys, evaluations = pruned_search(tree, query * scale, costs, budget)
    else:
        ids, evaluations = torch.arange(tree.num_leaves), tree.num_leaves
        keys = _density_key(chunk_scores(query * scale, tree.kmin, tree.kmax)[1], costs)
    leaves = _fill(keys, ids, costs[ids], budget)
    return Selection(leaves, _token_set(tree, leaves, context, config), evaluations)


def _density_key(bound: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    return bound - costs.clamp(min=1).float().log()


class _Scorer:
    """Bound scores of nodes, level by level, each node scored at most once."""

    def __init__(self, tree: ChunkTree, query: torch.Tensor):
        self.levels, self.query = tree.levels, query
        self.cache = [torch.full((lo.shape[0],), float("nan")) for lo, _ in self.levels]
        self.margin = [torch.zeros(lo.shape[0]) for lo, _ in self.levels]
        self.evaluations = 0

    def __call__(self, level: int, idx: torch.Tensor) -> torch.Tensor:
        cache = self.cache[level]
        missing = idx[cache[idx].isnan()]
        if missing.numel():
            lo, hi = self.levels[level][0][missing], self.levels[level][1][missing]
            cache[missing] = chunk_scores(self.query, lo, hi)[1]
            self.margin[level][missing] = rounding_margin(self.query, lo, hi)
            self.evaluations += missing.numel()
        return cache[idx]

    def survivors(self, level: int, idx: torch.Tensor, tau: float) -> torch.Tensor:
        """Nodes of ``idx`` whose bound may reach ``tau`` (rounding margin included); a bound
        is never below the key of a leaf under it, since ``log(cost) >= 0``."""
        return idx[self(level, idx) + self.margin[level][idx] >= tau]

    def children(self, level: int, idx: torch.Tensor) -> torch.Tensor:
        kids = (idx[:, None] * FANOUT + torch.arange(FANOUT)).flatten()
        return kids[kids < self.cache[level - 1].numel()]


def pruned_search(tree: ChunkTree, query: torch.Tensor, costs: torch.Tensor, budget: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Leaves whose key reaches the greedy threshold, with their keys and the evaluations.

    query : Tensor, shape (q_heads, head_dim), already multiplied by the logit scale.
    Returns ``ids`` (s,) ascending, ``keys`` (s,), and the number of summaries scored; every
    leaf the exhaustive greedy fill would take is among ``ids``.
    """
    if tree.num_leaves == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0), 0
    score = _Scorer(tree, query)
    tau = _beam_threshold(score, costs, budget)
    top = len(score.levels) - 1
    idx = torch.arange(score.cache[top].numel())
    for level in range(top, 0, -1):
        idx = score.children(level, score.survivors(level, idx, tau))
    idx = score.survivors(0, idx, tau)
    return idx, _density_key(score(0, idx), costs[idx]), score.evaluations


def _beam_threshold(score: _Scorer, costs: torch.Tensor, budget: int) -> float:
    """A key no higher than the last one the exact greedy fill takes (-inf if it takes all)."""
    mean_cost = max(float(costs.float().mean()), 1.0)
    width = int(budget / mean_cost) + 2
    top = len(score.levels) - 1
    idx = torch.arange(score.cache[top].numel())
    for level in range(top, 0, -1):
        s = score(level, idx)
        best = torch.topk(s, min(width, s.numel())).indices.sort().values
        idx = score.children(level, idx[best])
    idx = idx[(costs[idx] <= budget) & (costs[idx] > 0)]
    keys = _density_key(score(0, idx), costs[idx])
    order = torch.sort(keys, descending=True, stable=True).indices
    over = (costs[idx[order]].cumsum(0) > budget).nonzero()
    return float(keys[order[over[0, 0]]]) if over.numel() else float("-inf")
