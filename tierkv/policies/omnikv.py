"""``omnikv``: filter layers score the context exactly; the layers after each reuse its selection.

Layers before the first filter layer, and the filter layers, attend densely. A filter layer's
attention over the sealed context, its largest over the query heads per token (optionally
smoothed over recent steps by the selector), is summed per chunk of the following layer group;
the densest chunks within the token budget are that group's fetch plan for the step (OmniKV),
fetched as one packed load.

Chunks are sealed small (``ChunkConfig.base``, 8 tokens by default), and ``tierkv``'s adaptive
trees split the leaves the filter layers single out further, down to ``ChunkConfig.min``, while
the records stay whole (a fetch keeps the chosen leaves' tokens): the tokens a filter layer
singles out are scattered (the earlier uses of a word, a planted fact), and a chunk brings its
neighbours along at the same cost. Measured with ``tierkv`` on SmolLM2-135M, 2K-token generated
documents, 10 % budget, teacher-forced (3 x 64 tokens), against full attention: top-1
agreement 0.77 (KL 0.36) with 16-token chunks, 0.79 (0.28) with 8; scoring each token by its
largest query-head weight instead of the sum over the heads, 0.81 (0.26): a head that singles
a token out is not outvoted by heads spread thin.
"""
import torch

from .. import kernels
from ..attention import scored_decode_attention
from ..scattered import attend_parts
from .base import Policy, filter_layers_of, keys_gather, layers_of, per_layer, register

# Proposed by `tierkv calibrate` for SmolLM2-135M (inter-layer attention similarity).
DEFAULT_FILTERS = (2, 8, 16)
# Records of the layers that attend densely (before the first filter layer, and the one after a
# filter layer with ``full_after_filter``): no filter layer selects among their chunks, so they
# are sealed in large records and a step brings each such layer up in a few reads and copies
# (``tierkv`` preselects the first kind on long contexts, among these large chunks).
DENSE_RECORD_TOKENS = 128
# Records of the filter layers: read whole, or (``tierkv`` on long contexts) preselected by
# their LKA bounds with a wide margin, so coarser chunks than the selecting layers' serve them.
FILTER_RECORD_TOKENS = 32
# With ``fetch_unit="leaf"``, the records a step's chosen leaves bring stay within this many
# times the token budget. 8K decode on SmolLM2 (64 steps, ``bench.decode --fetch-unit leaf``):
# top-1 / MB read from disk per token: 0.922 / 12.8 at 1x, 0.938 / 20.7 at 1.25x, 0.969 / 25.5
# at 1.5x, 0.953 / 34.2 at 2x, 0.953 / 35.3 with no limit (whole records: 0.922 / 12.2), when
# the factor was chosen; with today's host ranking and preselection, 0.953 / 9.6 at 1.5x
# (whole records: 0.922 / 3.45).
LEAF_MOVE_FACTOR = 1.5
# Adaptive trees fold a filter layer's scores in every this many decode steps: the tree follows
# where attention settles over steps. On SmolLM2 at 8K (3 selecting groups of 600-800 leaves,
# ~80 splits per fold), a fold cost ~18 ms, 4.6 ms a step (splits applied one by one: 10.4);
# with the split leaves' keys gathered and summarised in one pass (``ChunkTree.split_packed``),
# ~4 ms per group folded, 3 ms a step (line profiler, 32 steps, 2026-11-27: 188 ms before).
# Every 8 steps (``bench.decode``'s ``tierkv`` case, one process, alternate blocks of 8 steps,
# 2026-11-27): 151.8 against 153.2 ms a token, top-1 agreement 0.953 against 0.969.
# A fold runs on the cache's helper thread while the group's layers compute
# (``TieredCache.in_background``; the fold needs only the group's first layer's keys, and no
# layer of the group reads its tree): the decoding thread's share fell from ~3 ms a step to 0.1,
# and each fold was done before the group's last layer (line profiler, 32 steps at 8K).
# The three groups fold at the same step, which is one of the slow steps; folding each at a
# different step (one cache decoding alternate blocks of 8 steps with and without, 2026-11-28)
# took 90.3 against 89.1 ms a token (median 88.3 against 88.7): the work moves, it does not
# shrink. Not kept.
ADAPT_EVERY = 4
# A question (``SelectConfig.question_tokens``) attends this many times the token budget: its
# first answer token is computed over what its queries chose together, and each of its queries
# would have had a budget of its own as a decode step. Ten seeded two-question cases on SmolLM2
# (a ~900-token document with a pass key and a city; the city asked after the pass key's
# answer; device 8 MB / host 16 MB, 10 % budget, ``tierkv``, 2026-11-29): the second question
# was answered 4 / 6 / 8 times of 10 at 1x / 2x / 4x, its layers attending 22 / 28 / 41 % of the
# sealed tokens they read whole, and 8 with the whole KV; the first question 10 every time.
# Scored by the attention mass over the question's queries instead of the largest weight: 2 / 4
# at 1x / 2x. Ten pass keys asked after ~2K-token documents (past what the model retrieves
# well): 6 at 1x, 4 at 4x, 3 with the whole KV; after ~1K-token ones, 10 at 1x and 4x, 9 whole.
QUESTION_BUDGET_FACTOR = 4


@register
class OmniKV(Policy):
    """Filter layers choose; each following layer group fetches the chosen chunks together."""

    name = "omnikv"
    reads_parts = True
    selects_questions = True

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        if select.filter_layers is not None:
            filters = filter_layers_of(select.filter_layers, layers, "filter_layers")
        elif "filter_layers" in profile:
            filters = filter_layers_of(profile["filter_layers"], layers, "profile filter_layers")
        else:  # the defaults serve deep models: a shallower one keeps those below its last layer
            filters = tuple(f for f in DEFAULT_FILTERS if f < layers - 1)
            if not filters:
                raise ValueError(f"policy {self.name!r} needs a filter layer below the last layer "
                                 f"{layers - 1}: the model has too few layers")
        self.filters = filters
        self._smoothed: dict[int, torch.Tensor] = {}
        self._marked: dict[int, torch.Tensor] = {}  # ``_smoothed`` as the last pass began
        self._to_adapt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def chunk_tokens(self) -> int:
        return self.chunks.base

    def state(self):
        return per_layer("smoothed", self._smoothed)  # the selectors' running scores

    def load_state(self, arrays):
        self._smoothed = layers_of("smoothed", arrays)

    def mark(self):  # a step replaces each layer's running scores, never writes them
        self._marked = dict(self._smoothed)

    def roll_back(self, cache, tokens):
        self._to_adapt.clear()  # a fold the failed pass's filter layer left for a later group
        self._smoothed = dict(self._marked)

    def crop(self, cache, tokens):  # the selectors' running scores, by position
        self._smoothed = {layer: scores[:tokens] for layer, scores in self._smoothed.items()}

    def record_tokens(self, group):
        if group[0] < self.filters[0] or self._full_after(group):
            tokens = DENSE_RECORD_TOKENS
        elif group[0] in self.filters:
            tokens = FILTER_RECORD_TOKENS
        else:
            return self.chunk_tokens
        return min(self.chunks.max, max(self.chunk_tokens, tokens))

    def leaf_tokens(self, group):
        """With ``fetch_unit="leaf"`` a selecting group's records are sealed as leaves of
        ``ChunkConfig.min`` tokens, so the filter layers choose among them from the first step."""
        if self.select.fetch_unit != "leaf" or not self._selects(group):
            return None
        return self.chunks.min

    def _selects(self, group) -> bool:
        """Whether ``group`` fetches the chunks its filter layer chose (not dense)."""
        return group[0] >= self.filters[0] and group[0] not in self.filters and \
            not self._full_after(group)

    def _full_after(self, group) -> bool:
        return self.select.full_after_filter and len(group) == 1 and group[0] - 1 in self.filters

    def groups(self):
        first = self.filters[0]
        groups = [(i,) for i in range(first)]
        bounds = list(self.filters) + [self.layers]
        for f, nxt in zip(bounds, bounds[1:]):
            groups.append((f,))
            rest = list(range(f + 1, nxt))
            if rest and self.select.full_after_filter:
                groups.append((rest.pop(0),))
            if rest:
                groups.append(tuple(rest))
        return groups

    def is_selecting(self, cache, layer) -> bool:
        """Whether ``layer`` fetches the chunks its filter layer chose (not dense)."""
        return self._selects(cache.groups[cache.group_of[layer]])

    def fetch(self, cache, layer, q):
        if self.is_selecting(cache, layer):
            return cache.selection(cache.group_of[layer])
        return self.preselect(cache, layer, q)

    def dense(self, cache, layer):
        return not self.is_selecting(cache, layer) and not self.preselects(cache, layer)

    def preselect(self, cache, layer, q):
        """What a layer that does not select reads of its own KV: all of it (``omnikv``)."""
        return None

    def attend(self, cache, layer, q, k, v, positions, scaling):
        if layer not in self.filters:
            self._adapt(cache, layer, keys_gather(k), positions)
            return super().attend(cache, layer, q, k, v, positions, scaling)
        out, probs = scored_decode_attention(q, k, v, scaling)
        self._choose(cache, layer, _token_peaks(probs, q.shape[1]), positions)
        return out

    def attend_parts(self, cache, layer, q, parts, positions, scaling):
        if layer in self.filters:
            out, probs = attend_parts(q, parts, scaling, scored=True)
            self._choose(cache, layer, _token_peaks(probs, q.shape[1]), positions)
            return out
        g = cache.group_of[layer]
        if g in self._to_adapt and cache.groups[g][0] == layer:  # the fold reads the keys
            self._adapt(cache, layer, parts.keys_at, positions)
        return attend_parts(q, parts, scaling)

    def _adapt(self, cache, layer, keys_at, positions):
        """In the first layer of a group (whose keys the tree summarises), fold the filter
        layer's scores into the group's tree; its fetched keys (``keys_at``: index -> keys on
        the CPU) serve the splits."""
        g = cache.group_of[layer]
        pending = self._to_adapt.pop(g, None)
        if pending is not None and cache.groups[g][0] == layer:
            scores, leaves = pending
            cache.in_background(g, cache.indexes[g].adapt, scores, leaves, self.select.sinks,
                                keys_at, positions, self.max_leaf(cache))

    def _choose(self, cache, layer, token_mass, positions):
        """Choose what the group after filter ``layer`` fetches this step. ``token_mass`` (t,
        n): each query token's largest weight over the heads of the keys at ``positions``
        (a pass verifying drafted tokens has several)."""
        target = self._target(cache, layer)
        if target is None:
            return
        index = cache.indexes[target]
        scores = self._smooth(layer, _by_position(cache, layer, token_mass.amax(0), positions))
        budget = self.budget(cache, target)
        if self.select.fetch_unit == "leaf":  # the records leaves bring: what the device holds
            moved = cache.fit_to_device(target, int(LEAF_MOVE_FACTOR * budget))
            leaves = self._fill(index, scores, min(budget, moved), moved)
        elif token_mass.shape[0] > 1:
            leaves = self._chosen_each(cache, layer, target, token_mass, positions, scores)
        else:
            leaves = self._fill(index, scores, cache.fit_to_device(target, budget))
        cache.set_selection(target, index.fetch(leaves))
        if self.adaptive and cache.steps % ADAPT_EVERY == 0:
            self._to_adapt[target] = (scores, leaves)

    def _chosen_each(self, cache, layer, target, token_mass, positions, scores):
        """A verifying pass's leaves for group ``target``: those each of its tokens would choose
        alone within the budget, as its decode step would, all together where the device tier
        holds their records; else as many as it holds, chosen by ``scores``, the tokens'
        largest weights. ``bench.verify`` (2026-11-30), passes of 6 / 11 tokens against one
        token a step, top-1 agreement with full attention: at 2K, 0.750 / 0.719 against 0.734
        (0.688 / 0.688 chosen by their largest weights within one budget); at 8K, where the
        device tier (5 % of the KV) mostly holds less than the tokens' choices, 0.797 / 0.797
        against 0.906 (0.828 / 0.781 within one budget); with room for them (a 15 % tier, the
        same case run by hand), 0.859 / 0.859 against 0.841."""
        index, budget = cache.indexes[target], self.budget(cache, target)
        room = cache.fetch_room(target)
        alone = budget if room is None else min(budget, room)
        leaves = held_together(cache, target, [
            self._fill(index, _by_position(cache, layer, mass, positions), alone)
            for mass in token_mass])
        return self._fill(index, scores, room) if leaves is None else leaves

    def question_fetch(self, cache, layer, q):
        """A selecting group attends what its filter layer chose for the question
        (``observe_question``); the other layers what a decode step reads of them."""
        if self.is_selecting(cache, layer):
            return cache.question_choice.get(cache.group_of[layer])
        return self.question_preselect(cache, layer, q)

    def question_preselect(self, cache, layer, q):
        """What a layer that does not select reads of its own KV for a question: all of it."""
        return None

    def observe_question(self, cache, layer, peak, positions):
        """A filter layer chooses the leaves its group attends for the question as for a decode
        step (``_choose``), each token scoring its largest weight over the heads and the
        question's queries, within ``question_budget`` (the question's own tokens are attended
        beside it). Not cut to what the device tier holds of the whole group, as a decode
        step's fetch is: a question holds one layer's slice of it at a time, and
        ``check_prompt_room`` saw each layer's whole context fit. The selector's running scores
        and the tree's folds follow decode steps and are left as they are."""
        target = self._target(cache, layer) if layer in self.filters else None
        if target is None:
            return
        scores = _by_position(cache, layer, peak, positions)
        budget = self.question_budget(cache)
        moved = int(LEAF_MOVE_FACTOR * budget) if self.select.fetch_unit == "leaf" else None
        cache.question_choice[target] = self._fill(cache.indexes[target], scores, budget, moved)

    def question_budget(self, cache) -> int:
        """Tokens a question attends of a selecting layer's sealed context:
        ``QUESTION_BUDGET_FACTOR`` x a decode step's budget less the nominal window."""
        return QUESTION_BUDGET_FACTOR * self.budget(cache)


    def _target(self, cache, layer) -> int | None:
        """The group that reuses filter ``layer``'s choice: the next group, or the one after
        when the next layer attends fully; None when neither selects."""
        after = cache.group_of[layer] + 1
        for g in range(after, min(after + 2, len(cache.groups))):
            if self.is_selecting(cache, cache.groups[g][0]):
                return g
            if cache.groups[g][0] in self.filters:
                return None
        return None

    def _fill(self, index, scores, budget, moved=None):
        """Leaves to fetch: those holding the sinks, then whole fetch units by mass per token
        while they fit in ``budget`` tokens; ascending LongTensor of leaf indices.

        A fetch unit (``SelectConfig.fetch_unit``) is a leaf, or the shortest run of tokens that
        is both whole leaves and whole records (a leaf split or merged since its records were
        last rewritten brings them all), so the tokens counted are the tokens attended (a fetch
        keeps the chosen leaves' tokens of records that hold more, ``GroupIndex.fetch``). Units
        that do not fit after the first one that overflows still compete for what is left.
        Leaves also stop where the records they bring would pass ``moved`` tokens (default
        ``LEAF_MOVE_FACTOR`` x the budget; less where the device tier holds less,
        ``TieredCache.fit_to_device``), or what the sinks bring; what is left goes to leaves of
        records already brought.

        At 8K (~1,000 units) this takes 0.18 ms alone and ~0.7 ms inside a decode step. Written
        with numpy (the same results on 600 random cases), 0.10 ms alone and still ~0.7 ms in the
        step (one cache decoding alternate blocks of 8 steps, 2026-11-28): what a step adds to
        such bookkeeping is not the torch calls' dispatch. Not kept. In C (``kernels.fill_units``,
        record units; the same leaves on random trees with split and merged leaves and ties,
        ``tests/test_policies.py``), one call: on one cache decoding alternate blocks of 8
        steps with and without (2026-11-28), 86.3 against 86.9 ms a token (median 85.0 against
        85.7), ~0.2 ms a filter layer.
        """
        tree = index.tree
        cuts = tree.bounds
        leaf_units = self.select.fetch_unit == "leaf"
        if not leaf_units:
            cuts = tree.unit_cuts()
            if kernels.fill_units is not None and tree.n and scores.dtype == torch.float32:
                return _fill_native(tree, scores, cuts, self.select.sinks, budget)
        prefix = torch.zeros(tree.n + 1, dtype=torch.float64)
        torch.cumsum(scores[: tree.n].double(), 0, out=prefix[1:])
        mass, sizes = (prefix[cuts[1:]] - prefix[cuts[:-1]]).float(), cuts.diff()
        forced = cuts[:-1] < self.select.sinks
        density = (mass / sizes).masked_fill(forced, float("inf"))
        order = torch.argsort(density, descending=True, stable=True)
        cost = sizes[order]
        take = cost.cumsum(0) <= max(budget, int(sizes[forced].sum()))
        rest = ~take
        if leaf_units:  # and the records they bring within LEAF_MOVE_FACTOR x the budget
            first, end = tree.record_spans()
            spans = first, end - 1, tree.record_cuts.diff()
            records = spans[2].numel()
            brought = _first_needed(spans, order, records).cumsum(0)
            sinks = int(forced.sum())
            floor = int(brought[sinks - 1]) if sinks else 0
            limit = int(LEAF_MOVE_FACTOR * budget) if moved is None else moved
            take &= brought <= max(limit, floor)
            rest = ~take & _all_brought(spans, order[take], records)[order]
        left = budget - int(cost[take].sum())
        rest &= cost <= left
        take |= rest & ((cost * rest).cumsum(0) <= left)
        units = torch.zeros(sizes.numel(), dtype=torch.bool)
        units[order[take]] = True
        leaf_unit = torch.searchsorted(cuts, tree.bounds[:-1], right=True) - 1
        return units[leaf_unit].nonzero().flatten()

    def _smooth(self, layer, scores):
        """The selector: this step's scores, or an average over recent steps."""
        if self.select.selector == "last":
            return scores
        old = self._smoothed.get(layer)
        if old is not None:
            grown = torch.zeros_like(scores)
            grown[: old.numel()] = old
            rate = 1 / self.select.selector_window if self.select.selector == "uniform" else 0.5
            scores = (1 - rate) * grown + rate * scores
        self._smoothed[layer] = scores
        return scores


def held_together(cache, group: int, each: list[torch.Tensor]) -> torch.Tensor | None:
    """The union of the leaf sets ``each`` (sorted), or None when the device tier does not
    hold their records in one fetch of ``group`` (``TieredCache.fetch_room``)."""
    leaves = torch.cat(each).unique()
    room = cache.fetch_room(group)
    if room is not None and cache.indexes[group].fetch(leaves).tokens > room:
        return None
    return leaves


def _token_peaks(probs: torch.Tensor, t: int) -> torch.Tensor:
    """Each of ``t`` query tokens' largest weight over the query heads of each key: (t, n),
    from ``probs`` (kv_heads, group * t, n) as ``attention.scored_decode_attention`` gives."""
    kv_heads, rows, n = probs.shape
    return probs.view(kv_heads, rows // t, t, n).amax(dim=(0, 1))


def _by_position(cache, layer: int, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``weights`` of the keys ``layer`` attended (at ``positions``) as a CPU vector over all of
    its tokens, 0 where it attended none."""
    scores = torch.zeros(cache.layer_length(layer))
    scores[positions] = weights.cpu()
    return scores


def _fill_native(tree, scores: torch.Tensor, cuts: torch.Tensor, sinks: int,
                 budget: int) -> torch.Tensor:
    """``OmniKV._fill`` over fetch units of whole records by ``kernels.fill_units``: the same
    leaves in one call."""
    scores, cuts, bounds = scores.contiguous(), cuts.contiguous(), tree.bounds.contiguous()
    if scores.numel() < tree.n or cuts.dtype != torch.long or bounds.dtype != torch.long:
        raise ValueError(f"scores {tuple(scores.shape)} for {tree.n} tokens, cuts {cuts.dtype}, "
                         f"bounds {bounds.dtype}: expected >= n fp32 scores and int64 bounds")
    out = torch.empty(tree.num_leaves, dtype=torch.long)
    count = kernels.fill_units(scores.data_ptr(), tree.n, cuts.data_ptr(), cuts.numel() - 1,
                               bounds.data_ptr(), tree.num_leaves, sinks, budget, out.data_ptr())
    return out[:count]


def _first_needed(spans, order: torch.Tensor, records: int) -> torch.Tensor:
    """Tokens of the records that leaf ``order[i]`` brings and no leaf before it in ``order``
    did: LongTensor (m,), in ``order``'s order."""
    first, last, sizes = spans
    m = first.numel()
    rank = torch.empty(m, dtype=torch.long)
    rank[order] = torch.arange(m)
    span = last - first + 1
    leaf = torch.repeat_interleave(torch.arange(m), span)
    record = first[leaf] + torch.arange(leaf.numel()) - torch.repeat_interleave(span.cumsum(0) - span, span)
    needed_at = torch.full((records,), m, dtype=torch.long).scatter_reduce_(0, record, rank[leaf], "amin")
    return torch.zeros(m + 1, dtype=torch.long).index_add_(0, needed_at, sizes)[:m]


def _all_brought(spans, taken: torch.Tensor, records: int) -> torch.Tensor:
    """Whether all records of each leaf are brought by the leaves ``taken``: BoolTensor (m,)."""
    first, last, _ = spans
    brought = torch.zeros(records + 1, dtype=torch.long)
    brought.index_add_(0, first[taken], torch.ones_like(taken))
    brought.index_add_(0, last[taken] + 1, -torch.ones_like(taken))
    count = torch.cat([torch.zeros(1, dtype=torch.long), (brought[:-1].cumsum(0) > 0).long().cumsum(0)])
    return count[last + 1] - count[first] == last - first + 1
