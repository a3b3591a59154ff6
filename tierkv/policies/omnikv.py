"""``omnikv``: filter layers score the context exactly; the layers after each reuse its selection.

Layers before the first filter layer, and the filter layers, attend densely. A filter layer's
attention over the sealed context (optionally smoothed over recent steps by the selector) is
summed per chunk of the following layer group; the best chunks within the token budget are that
group's fetch plan for the step (OmniKV), fetched as one packed load.
"""
import torch

from ..attention import scored_decode_attention
from .base import Policy, keys_lookup, register

# Proposed by `tierkv calibrate` for SmolLM2-135M (inter-layer attention similarity).
DEFAULT_FILTERS = (2, 8, 16)


@register
class OmniKV(Policy):
    """Filter layers choose; each following layer group fetches the chosen chunks together."""

    name = "omnikv"

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        filters = select.filter_layers or tuple(profile.get("filter_layers", DEFAULT_FILTERS))
        filters = tuple(f for f in filters if f < layers - 1)
        if not filters:
            raise ValueError(f"filter_layers={select.filter_layers}: none below the last layer {layers - 1}")
        self.filters = filters
        self._smoothed: dict[int, torch.Tensor] = {}
        self._to_adapt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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
        group = cache.groups[cache.group_of[layer]]
        return layer >= self.filters[0] and layer not in self.filters and not (
            self.select.full_after_filter and group[0] - 1 in self.filters and len(group) == 1)

    def fetch(self, cache, layer, q):
        if self.is_selecting(cache, layer):
            return cache.selection(cache.group_of[layer])
        return self.preselect(cache, layer, q) if layer in self.filters else None

    def dense(self, cache, layer):
        return not self.is_selecting(cache, layer) and not (
            layer in self.filters and self.preselects(cache, layer))

    def preselects(self, cache, layer) -> bool:
        """Whether filter ``layer`` narrows its own KV before scoring it (not in ``omnikv``)."""
        return False

    def preselect(self, cache, layer, q):
        """What a filter layer reads of its own KV: all of it (``omnikv``)."""
        return None

    def attend(self, cache, layer, q, k, v, positions, scaling):
        if layer not in self.filters:
            self._adapt(cache, layer, k, positions)
            return super().attend(cache, layer, q, k, v, positions, scaling)
        out, probs = scored_decode_attention(q, k, v, scaling)
        self._choose(cache, layer, probs.sum(dim=(0, 1)), positions)
        return out

    def _adapt(self, cache, layer, k, positions):
        """In the first layer of a group (whose keys the tree summarises), fold the filter
        layer's scores into the group's tree; its fetched keys serve the splits."""
        g = cache.group_of[layer]
        pending = self._to_adapt.pop(g, None)
        if pending is not None and cache.groups[g][0] == layer:
            scores, leaves = pending
            cache.indexes[g].adapt(scores, leaves, self.select.sinks, keys_lookup(k, positions),
                                   self.max_leaf(cache))

    def _choose(self, cache, layer, token_mass, positions):
        target = cache.group_of[layer + 1]
        index = cache.indexes[target]
        scores = torch.zeros(cache.layer_length(layer))
        scores[positions] = token_mass
        scores = self._smooth(layer, scores)
        mass = index.chunk_mass(scores)
        leaves = index.top_chunks(mass, self.budget(cache), self.select.sinks)
        cache.set_selection(target, index.fetch(leaves))
        if self.adaptive:
            self._to_adapt[target] = (scores, leaves)

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
